"""The fp8 KV cache's model as HF runs it: every key and value vector (one KV head at one slot) rounded to e4m3
with its own scale before attention, written here in plain torch (not with the engine's helpers).

Rounding is a step function, and the engine computes the same vectors in another op order (one token a step, fused
projections): fp32 noise apart. Where a vector's element lies within that noise of a rounding midpoint, either
neighbour is the rounded model's, and a test cannot tell which the engine will take on a given CPU. Given the
engine's own codes (``engine_codes``), the reference takes the engine's at those elements only: everything else is
the reference's rounding, exactly, so the engine's cache and log-probs can be compared exactly and tightly."""

import contextlib
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

E4M3_MAX = 448.0
# fp32 noise between the engine's op order and HF's, relative to a vector's largest element: at most 3.5e-6 measured
# (the engine's keys, values and projection inputs against HF's, every family the tests build); about ten times that
NOISE = 2 ** -15


def ordered(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 values (as float) as integers in their order: neighbours differ by one (both zeros are 0)."""
    bits = codes.to(torch.float8_e4m3fn).view(torch.uint8).long()
    return torch.where(bits >= 128, 128 - bits, bits)


def e4m3(u: torch.Tensor, engine: torch.Tensor | None = None) -> torch.Tensor:
    """u (fp32, scaled: each vector's largest element is 448) rounded to e4m3, as float. ``engine``: the engine's
    codes of the same vectors; where the engine's code is a nearest e4m3 value of u up to fp32 noise (u within noise
    of the midpoint between it and ours), it is taken. Nowhere else: a wrong scale, a skipped or truncating rounding
    lands codes farther from u than that."""
    ours = u.to(torch.float8_e4m3fn).float()
    if engine is None or torch.equal(engine, ours):
        return ours
    engine = engine.float()
    as_near = (engine - u).abs() <= (ours - u).abs() + 2 * NOISE * E4M3_MAX  # False where engine is NaN (no code)
    tie = as_near & ((ordered(engine) - ordered(ours)).abs() == 1)
    return torch.where(tie, engine, ours)


def quantize_kv(t: torch.Tensor, engine: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., slots, head_dim): each vector's e4m3 codes (as float) and its fp32 scale (its largest element maps to
    448)."""
    s = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return e4m3(t.float() / s, engine), s


def round_kv(t: torch.Tensor, engine: torch.Tensor | None = None) -> torch.Tensor:
    """(..., slots, head_dim): each vector as e4m3 times its own fp32 scale."""
    codes, s = quantize_kv(t, engine)
    return (codes * s).to(t.dtype)


def engine_codes(eng) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The engine's fp8 cache as it stands (its e4m3 codes, (rows, KV heads, slots, head_dim) a layer): a copy."""
    return [(k.float(), v.float()) for k, v in zip(eng.kc, eng.vc)]


@contextlib.contextmanager
def fp8_cache(model, engine=None, seen: dict | None = None):
    """HF's attention of ``model`` (its eager or sdpa function) over rounded keys and values while inside. HF keeps
    its own cache unrounded and rounds on every call: rounding a vector is deterministic, so each slot is seen as
    the engine's fp8 cache keeps it. ``engine`` (``engine_codes``): ties within fp32 noise go the engine's way, its
    rows and slots those of HF's batch and positions (a prefill, then a token a call; or one teacher-forced
    forward). ``seen``: each layer's codes at its last call, ``seen[layer] = (K, V)`` (rows, KV heads, slots, hd)."""
    done = {}  # layer: positions attended so far (HF's sliding layers return their last keys only)

    def rounded(m, q, k, v):
        i = m.layer_idx
        done[i] = end = done.get(i, 0) + q.shape[-2]
        eng = (None, None) if engine is None else (c[:k.shape[0], :, end - k.shape[-2]:end] for c in engine[i])
        (kq, ks), (vq, vs) = (quantize_kv(t, e) for t, e in zip((k, v), eng))
        if seen is not None:
            seen[i] = (kq, vq)
        return (kq * ks).to(k.dtype), (vq * vs).to(v.dtype)

    impl = model.config._attn_implementation
    if impl == "eager":  # the modeling module's own function, looked up when each attention runs
        mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
        orig = mod.eager_attention_forward
        mod.eager_attention_forward = lambda m, q, k, v, *a, **kw: orig(m, q, *rounded(m, q, k, v), *a, **kw)
        try:
            yield
        finally:
            mod.eager_attention_forward = orig
    else:
        orig = ALL_ATTENTION_FUNCTIONS[impl]
        ALL_ATTENTION_FUNCTIONS[impl] = lambda m, q, k, v, *a, **kw: orig(m, q, *rounded(m, q, k, v), *a, **kw)
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[impl] = orig
