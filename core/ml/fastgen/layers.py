"""The decode and prefill forward of one decoder layer over fused weights, and those weights, for every family in
``families.py``.

The per-layer functions take the layer's tensors as a dict (a norm or q/k norm the family lacks is None, a bias
the model lacks is None) and the model's static facts as a ``Spec`` (python scalars): torch.compile specialises on
both, so Llama compiles to what it did before this file knew other families, and no family's step calls python
objects per token."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen.families import ACTIVATIONS, FAMILIES, LENGTH_DEPENDENT_ROPE, Family
from verlflow.core.ml.fastgen.kernels import combine_splits
from verlflow.core.ml.fastgen.options import EngineOptions, Fp8Choices
from verlflow.core.ml.fastgen.support import SUPPORTED_MODEL_TYPES

log = logging.getLogger("verlflow.fastgen")

# ------------------------------------------------------------------------------------------------ model


class Spec(NamedTuple):
    """A model's static facts, the same for every layer (what the compiled functions specialise on)."""

    eps: float
    nh: int
    nkv: int
    hd: int
    scaling: float
    rot: int  # rotary dims: the first ``rot`` of each head turn (hd: all; Phi-3's partial_rotary_factor)
    norm32: bool = False  # RMSNorm scales in fp32 before the cast (the weights hold w.float() / 1 + w.float())
    qk: str = ""  # q/k norm: "head" (each head), "full" (all of q / k), "" (none)
    act: str = "silu"  # "silu", "gelu", "gelu_tanh"
    softcap: float = 0.0  # attention logits: cap * tanh(scores / cap); 0: off
    fp8_fast: bool = False  # fp8 projections: the GPU's fast accumulation (fewer fp32 promotions; an A/B)
    fp8_unit: bool = False  # fp8 projections: a unit-scaled GEMM, the row and column scales applied after it
    kv8: bool = False  # the KV cache in e4m3, a scale per KV head and slot (rollout.kv_cache=fp8)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, f32: bool = False) -> torch.Tensor:
    # HF's RMSNorms, operation for operation: Llama w * h.to(dt); OLMo-2 (w * h).to(dt), Gemma (h * (1 + w)).to(dt)
    # with w already w.float() / 1 + w.float()
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if f32:
        return (h * w).to(dt)
    return w * h.to(dt)


def _norm(x, w, S: Spec):
    """The layer's optional norm: x itself where the family has none there."""
    return x if w is None else _rms(x, w, S.eps, S.norm32)


def _rot(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x, cos, sin, rot: int):
    """HF's apply_rotary_pos_emb; partial (Phi-3) when rot < head_dim. cos/sin in the dtype HF's rotary module
    returns (the model's; OLMo-2's fp32, then cast back as its apply_rotary_pos_emb does)."""
    if rot == x.shape[-1]:
        return (x * cos + _rot(x) * sin).to(x.dtype)
    xr = x[..., :rot]
    return torch.cat([xr * cos + _rot(xr) * sin, x[..., rot:]], dim=-1).to(x.dtype)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
PROJECTIONS = ("qkv", "o", "gu", "down")  # L["w" + p], L["b" + p], L["s" + p]: weight, bias, fp8 scale (or None)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) as e4m3 with one fp32 scale per output channel (row): w ~ w8 * scale; scale as (1, N)."""
    scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.t().contiguous()


def quantize_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (M, K) as e4m3 with one fp32 scale per token (row): x2 ~ x8 * sx; x8 row-major, as the GPU kernel takes it."""
    x2 = x2.float()
    sx = x2.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x2 / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), sx


def _fp8_gemm(x8, sx, w8, sw, dtype: torch.dtype, fast: bool, unit: bool) -> torch.Tensor:
    """x8 * sx @ (w8 * sw).T in ``dtype``, accumulating in fp32 (``fast``: Hopper's fast accumulation, which promotes
    the partial sums to fp32 less often). ``unit``: the GEMM with unit scales (cuBLASLt's tensor-scaled kernels; the
    row-scaled ones were slower than bf16 at decode shapes on the H200), then the token and channel scales on its
    output, a pointwise product inductor fuses into the kernel after it."""
    if not unit:
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=dtype, use_fast_accum=fast)
    one = torch.ones((), device=x8.device)
    y = torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=fast)
    return (y.float() * sx * sw).to(dtype)


def _fp8_linear(x, w8, sw, b, fast: bool = False, unit: bool = False):
    """x @ (w8 * sw).T + b with x scaled to e4m3 per token (row): the GPU's fp8 matmul (``_fp8_gemm``)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x8, sx = quantize_tokens(x.reshape(-1, K))
    y = _fp8_gemm(x8, sx, w8, sw, x.dtype, fast, unit)
    if b is not None:
        y = y + b
    return y.view(*lead, w8.shape[0])


def quantize_slots(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hd), one KV head's vector per slot, as e4m3 with one fp32 scale per vector: x ~ x8 * scale[..., None]
    (the cache's layout: a slot's scale is written with it, so nothing is rescaled when later slots come)."""
    scale = x.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_slots(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * scale.unsqueeze(-1)).to(dtype)


def read_cache(kc, vc, ks, vs, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first kv_len cache slots in the model's dtype: the cache itself, or an fp8 cache (ks/vs its scales)
    read back (bmm's and sdpa's input; the Triton kernel reads the fp8 cache directly)."""
    K, V = kc[:, :, :kv_len], vc[:, :, :kv_len]
    if ks is None:
        return K, V
    return dequantize_slots(K, ks[:, :, :kv_len], dtype), dequantize_slots(V, vs[:, :, :kv_len], dtype)


def _linear(h, L, p: str, S: Spec):
    """Projection ``p`` of the layer: in the model's dtype, or fp8 where the weights hold a scale for it."""
    if L["s" + p] is None:
        return F.linear(h, L["w" + p], L["b" + p])
    return _fp8_linear(h, L["w" + p], L["s" + p], L["b" + p], S.fp8_fast, S.fp8_unit)


def _qkv(h, L, S: Spec):
    """q (..., nh, hd), k and v (..., nkv, hd) from the normed input h (..., H), q/k normed as the family does."""
    lead = h.shape[:-1]
    q, k, v = _linear(h, L, "qkv", S).split([S.nh * S.hd, S.nkv * S.hd, S.nkv * S.hd], dim=-1)
    if S.qk == "full":  # OLMo-2: over the whole projection, before the heads are split
        q = _rms(q, L["qn"], S.eps, S.norm32)
        k = _rms(k, L["kn"], S.eps, S.norm32)
    q = q.view(*lead, S.nh, S.hd)
    k = k.view(*lead, S.nkv, S.hd)
    v = v.view(*lead, S.nkv, S.hd)
    if S.qk == "head":  # Qwen3, Gemma-3: each head over head_dim
        q = _rms(q, L["qn"], S.eps, S.norm32)
        k = _rms(k, L["kn"], S.eps, S.norm32)
    return q, k, v


def _mlp(h, L, S: Spec):
    g, u = _linear(h, L, "gu", S).chunk(2, dim=-1)
    if S.act == "silu":
        a = F.silu(g)
    elif S.act == "gelu_tanh":
        a = F.gelu(g, approximate="tanh")
    else:
        a = F.gelu(g)
    return _linear(a * u, L, "down", S)


def _after_attn(x, o, L, S: Spec):
    """Output projection, the attention residual, the MLP and its residual, with the family's norms around each
    (Llama: x + o; x + mlp(ln2(x)). Gemma: x + ln_pa(o); x + ln_pf(mlp(ln2(x))). OLMo-2: x + ln_pa(o); x +
    ln_pf(mlp(x)))."""
    x = x + _norm(_linear(o, L, "o", S), L["ln_pa"], S)
    return x + _norm(_mlp(_norm(x, L["ln2"], S), L, S), L["ln_pf"], S)


def _pre_attn(h, L, kc, vc, slot, cos, sin, S: Spec, ks=None, vs=None):
    """q/k/v of the layer's normed input h (the previous layer's graph computed the norm, fused with its last
    residual: one kernel fewer a layer), rotary, and this step's K/V into the cache at each row's ``slot`` (B,)
    (an fp8 cache: with their scales into ks/vs (B, nkv, T)); returns q (B, nh, hd)."""
    q, k, v = _qkv(h, L, S)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = _rope(q, c, s, S.rot)
    k = _rope(k, c, s, S.rot)
    rows = torch.arange(h.shape[0], device=h.device)
    if S.kv8:
        (k, sk), (v, sv) = quantize_slots(k), quantize_slots(v)
        ks[rows, :, slot] = sk
        vs[rows, :, slot] = sv
    kc[rows, :, slot] = k  # (B, nkv, hd): row b at slot[b]
    vc[rows, :, slot] = v
    return q.contiguous()


def _post_attn(x, mp, lp, op, L, nxt, S: Spec):
    """Merge the attention splits, then everything after attention (both residuals); returns x and x under the
    next norm ``nxt`` (the next layer's input norm, or the final one after the last layer; None: x)."""
    o = combine_splits(mp, lp, op, S.nh // S.nkv).to(x.dtype)
    x = _after_attn(x, o, L, S)
    return x, _norm(x, nxt, S)


def _capped_attention(q, k, v, mask, S: Spec):
    """HF's eager attention with logit soft-capping (SDPA has none): q (n, nh, P, hd), k/v (n, nkv, P, hd), mask
    (n, 1, P, P) bool. The query heads are grouped under their KV head rather than K/V repeated."""
    n, nh, P, hd = q.shape
    qg = q.view(n, S.nkv, nh // S.nkv, P, hd)
    sc = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * S.scaling  # (n, nkv, g, P, P)
    sc = torch.tanh(sc / S.softcap) * S.softcap
    p = sc.float().masked_fill(~mask.unsqueeze(2), float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(p, v.unsqueeze(2)).view(n, nh, P, hd)


def _prefill_layer(x, L, cos, sin, mask, S: Spec):
    """One decoder layer over left-padded prompts x (n, P, H); returns (x, k, v, k scales, v scales) with k/v (n,
    nkv, P, hd) as the cache keeps them (an fp8 cache: e4m3, with scales (n, nkv, P); else the scales are None)."""
    n, P, _ = x.shape
    q, k, v = _qkv(_norm(x, L["ln1"], S), L, S)
    q = _rope(q.transpose(1, 2), cos, sin, S.rot)
    k = _rope(k.transpose(1, 2), cos, sin, S.rot)
    v = v.transpose(1, 2)
    kept = (k, v, None, None)
    if S.kv8:  # the prompt attends to what the cache keeps, as every later token does: one model throughout
        (k8, sk), (v8, sv) = quantize_slots(k), quantize_slots(v)
        kept = (k8, v8, sk, sv)
        k, v = dequantize_slots(k8, sk, x.dtype), dequantize_slots(v8, sv, x.dtype)
    if S.softcap:
        o = _capped_attention(q, k, v, mask, S)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=S.scaling, enable_gqa=True)
    x = _after_attn(x, o.transpose(1, 2).reshape(n, P, S.nh * S.hd), L, S)
    return (x, *kept)


def _head(h, lm_w, cap: float = 0.0):
    """Logits of the final-normed hidden state h."""
    y = F.linear(h, lm_w)
    if cap:  # Gemma's final_logit_softcapping, in the model dtype as HF does
        y = torch.tanh(y / cap) * cap
    return y


def _logits(x, norm_w, lm_w, eps: float, f32: bool = False, cap: float = 0.0):
    return _head(_rms(x, norm_w, eps, f32), lm_w, cap)


def _decode_layer(x, h, L, nxt, kc, vc, slot, cos, sin, bias, S: Spec, attn: str = "bmm", ks=None, vs=None):
    """One decoder layer for one new token per row. x (B, H) and h, x under the layer's input norm; kc/vc (B, nkv,
    T, hd) written at ``slot`` ((B,) long: each row's own); bias (B, kv_len) float: 0 where the slot is valid for the
    row (and inside the layer's sliding window), -inf elsewhere. The cache bucket's length kv_len is bias's: a
    dynamic size, so one compile serves every bucket. An fp8 cache (ks/vs its scales) is read back in the model's
    dtype: the Triton kernel reads it directly, these paths are its reference. Returns x and x under the next norm
    ``nxt`` (see ``_post_attn``)."""
    B, kv_len = x.shape[0], bias.shape[-1]
    q = _pre_attn(h, L, kc, vc, slot, cos, sin, S, ks, vs)
    K, V = read_cache(kc, vc, ks, vs, kv_len, q.dtype)
    if attn == "sdpa":  # the engine never picks it with soft-capping
        o = F.scaled_dot_product_attention(q.unsqueeze(2), K, V, attn_mask=bias[:, None, None, :].to(q.dtype),
                                           scale=S.scaling, enable_gqa=True)  # (B, nh, 1, hd)
    else:
        qg = q.view(B, S.nkv, S.nh // S.nkv, S.hd)  # query heads grouped under their shared KV head
        sc = torch.matmul(qg, K.transpose(-1, -2)) * S.scaling  # (B, nkv, g, T)
        if S.softcap:
            sc = torch.tanh(sc / S.softcap) * S.softcap
        p = (sc.float() + bias[:, None, None, :]).softmax(-1).to(q.dtype)
        o = torch.matmul(p, V)  # (B, nkv, g, hd)
    x = _after_attn(x, o.reshape(B, S.nh * S.hd), L, S)
    return x, _norm(x, nxt, S)


# ------------------------------------------------------------------------------------------------ weights


def fp8_gpu_problem(device: torch.device, field: str = "rollout.weights") -> str | None:
    """Why this CUDA device cannot run ``field``=fp8 (None: it can): the fp8 projections' matmuls, or the Triton
    kernel's e4m3 conversions reading an fp8 KV cache; the validate stage asks it per rank."""
    cap = torch.cuda.get_device_capability(device)
    if cap >= (8, 9):  # fp8 tensor cores and conversions came with Ada (8.9) and Hopper (9.0)
        return None
    return (f"{field}=fp8 needs a GPU with fp8 support (compute capability 8.9 or newer); "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: use {field}=model")


def _fp8_wanted(weights: str, device: torch.device, dtype: torch.dtype) -> bool:
    """rollout.weights: "model" (the model's dtype) or "fp8", refused where this device cannot run it."""
    if weights not in ("model", "fp8"):
        raise ValueError(f"rollout.weights must be 'model' or 'fp8', got {weights!r}")
    if weights == "model":
        return False
    if device.type == "cuda":
        problem = fp8_gpu_problem(device)
        if problem:
            raise ValueError(problem)
        if dtype != torch.bfloat16:  # the row-scaled fp8 matmul writes bf16
            raise ValueError(f"rollout.weights=fp8 on CUDA needs a bf16 model, this one is {dtype}: set "
                             "fsdp.mixed_precision=bf16, or rollout.weights=model")
    return True


def _kv8_wanted(kv_cache: str, device: torch.device) -> bool:
    """rollout.kv_cache: "model" (the model's dtype) or "fp8", refused where this device cannot run it."""
    if kv_cache not in ("model", "fp8"):
        raise ValueError(f"rollout.kv_cache must be 'model' or 'fp8', got {kv_cache!r}")
    if kv_cache == "fp8" and device.type == "cuda":
        problem = fp8_gpu_problem(device, "rollout.kv_cache")
        if problem:
            raise ValueError(problem)
    return kv_cache == "fp8"


def _bias_of(x: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor | None:
    return x.detach() if x is not None else (None if n == 0 else torch.zeros(n, dtype=like.dtype, device=like.device))


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"rollout.engine=static: {field}={value!r} {why}; use rollout.engine=hf")


def _eps(norm) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


_NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_SOFTCAP_ATTN = ("eager", "flash_attention_2", "flash_attention_3", "flex_attention")  # HF passes `softcap` on


class _Weights:
    """The model's tensors in the layout the engine wants, read through its family's adapter; fused matrices
    and fp32 norm scales are copies (``refresh`` re-copies them in place), the rest are the model's own. Of the
    options, what it computes: weights, kv_cache and the fp8 switches (their defaults where None)."""

    def __init__(self, model, options: EngineOptions = EngineOptions()):
        cfg = model.config
        model_type = getattr(cfg, "model_type", None)
        fam: Family | None = FAMILIES.get(model_type)
        if fam is None:
            raise ValueError(f"rollout.engine=static supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, "
                             f"not {model_type!r}; use rollout.engine=hf")
        self.family = fam
        for field in fam.must_be_off:
            if getattr(cfg, field, None):
                raise _refuse(field, getattr(cfg, field), "is not supported")
        act = getattr(cfg, fam.act_field, None)
        if act not in ACTIVATIONS:
            raise _refuse(fam.act_field, act, f"is not supported (only {', '.join(ACTIVATIONS)})")
        self.model = model
        base = model.model
        self.base = base
        rope = getattr(base.rotary_emb, "rope_type", "default")
        for kind in (rope.values() if isinstance(rope, dict) else [rope]):
            if kind in LENGTH_DEPENDENT_ROPE:
                raise _refuse("rope_type", kind, "depends on the sequence length")
        layer0, a0 = base.layers[0], base.layers[0].self_attn
        # a module the adapter would not read means the family is not the one it describes: refuse, don't guess
        for name in _NORM_NAMES:
            if hasattr(layer0, name) and name not in fam.norms:
                raise _refuse("model_type", model_type, f"has a layer norm {name} its adapter does not read")
        for name in ("q_norm", "k_norm"):
            if hasattr(a0, name) != bool(fam.qk_norm):
                raise _refuse("model_type", model_type, f"attention {'has' if hasattr(a0, name) else 'lacks'} "
                              f"{name}, against its adapter")
        if hasattr(base.embed_tokens, "embed_scale") != fam.embed_scale:
            raise _refuse("model_type", model_type, "embedding scale differs from its adapter")

        attn_cap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0) if fam.attn_softcap else 0.0
        impl = getattr(cfg, "_attn_implementation", None) or "eager"
        if attn_cap and impl == "sdpa":
            # HF's SDPA path takes no softcap and drops it: the model's forward (and so the update's log-probs)
            # has none, so the rollout has none either
            log.warning("fastgen: %s with attn_implementation=sdpa: transformers ignores attn_logit_softcapping=%s, "
                        "and so does the static engine (eager attention applies it)", model_type, attn_cap)
            attn_cap = 0.0
        elif attn_cap and impl not in _SOFTCAP_ATTN:
            raise _refuse("attn_implementation", impl, "may or may not apply attn_logit_softcapping")
        self.final_cap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0) if fam.final_softcap else 0.0

        n = len(base.layers)
        if fam.window == "module":
            wins = [getattr(layer.self_attn, "sliding_window", None) for layer in base.layers]
        elif fam.window == "config":
            wins = [getattr(cfg, "sliding_window", None)] * n
        else:
            wins = [None] * n
        self.windows = [int(w or 0) for w in wins]  # 0: full attention

        keys = [cfg.layer_types[i] for i in range(n)] if fam.rope_by_layer_type else [None] * n
        self.rope_keys = list(dict.fromkeys(keys))  # distinct tables, first-use order
        self.rope_of = [self.rope_keys.index(k) for k in keys]

        self.hidden = cfg.hidden_size
        self.n_layers = n
        self.embed = base.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.vocab = model.lm_head.weight.shape[0]
        rots = {c.shape[-1] for c, _ in self.rope_tables(torch.zeros(1, dtype=torch.long, device=self.device))}
        norms = [getattr(layer, name) for layer in base.layers for name in fam.norms if name is not None]
        norms += [getattr(layer.self_attn, name) for layer in base.layers for name in ("q_norm", "k_norm")
                  if fam.qk_norm]
        eps = {_eps(m) for m in norms}
        if len(rots) != 1 or len(eps) != 1:
            raise _refuse("model_type", model_type, f"has layers that differ (rotary dims {rots}, eps {eps})")
        self.spec = Spec(eps=eps.pop(), nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=a0.head_dim,
                         scaling=float(getattr(a0, "scaling", a0.head_dim ** -0.5)), rot=rots.pop(),
                         norm32=fam.norm_form != "llama", qk=fam.qk_norm, act=ACTIVATIONS[act], softcap=attn_cap)
        self.norm_eps = _eps(base.norm)
        self.fp8 = _fp8_wanted(options.weights, self.device, self.dtype)
        fp8 = options.fp8 or Fp8Choices()
        unit = self.fp8 and fp8.gemm == "unit"
        self.spec = self.spec._replace(  # (the engine's cache too: a static fact the compiled functions specialise on)
            fp8_fast=self.fp8 and fp8.fast_accum, fp8_unit=unit, kv8=_kv8_wanted(options.kv_cache, self.device))
        self.layers: list[dict] = []
        self.refresh()

    # kept for callers that read them off the weights
    @property
    def eps(self) -> float:
        return self.spec.eps

    @property
    def nh(self) -> int:
        return self.spec.nh

    @property
    def nkv(self) -> int:
        return self.spec.nkv

    @property
    def hd(self) -> int:
        return self.spec.hd

    @property
    def scaling(self) -> float:
        return self.spec.scaling

    @torch.no_grad()
    def rope_tables(self, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin), each (len(pos), rot), per distinct rotary table, from the model's own rotary module (so
        every static rope_type's scaling is HF's), in the dtype that module returns."""
        x = torch.zeros(1, dtype=self.dtype, device=self.device)
        out = []
        for key in self.rope_keys:
            args = (x, pos.unsqueeze(0)) if key is None else (x, pos.unsqueeze(0), key)
            cos, sin = self.base.rotary_emb(*args)
            out.append((cos[0].contiguous(), sin[0].contiguous()))
        return out

    def _norm_w(self, norm) -> torch.Tensor | None:
        if norm is None:
            return None
        w = norm.weight.detach()
        form = self.family.norm_form
        return w if form == "llama" else (w.float() if form == "fp32" else 1.0 + w.float())

    def _fused(self, mods) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One matrix (and bias) of the projections, by reference when HF already fused them."""
        if len(mods) == 1:
            p = mods[0]
            return p.weight.detach(), _detached(p.bias)
        w = torch.cat([p.weight.detach() for p in mods])
        b = None
        if any(p.bias is not None for p in mods):
            b = torch.cat([_bias_of(p.bias, p.weight.shape[0], p.weight) for p in mods])
        return w, b

    def _layer(self, layer) -> dict:
        fam = self.family
        a, mlp = layer.self_attn, layer.mlp
        ln1, ln_pa, ln2, ln_pf = (None if name is None else getattr(layer, name) for name in fam.norms)
        wqkv, bqkv = self._fused([getattr(a, name) for name in fam.qkv])
        wgu, bgu = self._fused([getattr(mlp, name) for name in fam.gate_up])
        L = dict(
            ln1=self._norm_w(ln1), ln_pa=self._norm_w(ln_pa), ln2=self._norm_w(ln2), ln_pf=self._norm_w(ln_pf),
            qn=self._norm_w(getattr(a, "q_norm", None)), kn=self._norm_w(getattr(a, "k_norm", None)),
            wqkv=wqkv, bqkv=bqkv, wo=a.o_proj.weight.detach(), bo=_detached(a.o_proj.bias),
            wgu=wgu, bgu=bgu, wdown=mlp.down_proj.weight.detach(), bdown=_detached(mlp.down_proj.bias))
        for p in PROJECTIONS:
            N, K = L["w" + p].shape
            fits = self.fp8 and N % 16 == 0 and K % 16 == 0  # the GPU's fp8 matmul takes multiples of 16
            L["w" + p], L["s" + p] = quantize_rows(L["w" + p]) if fits else (L["w" + p], None)
        return L

    @torch.no_grad()
    def refresh(self):
        """(Re)read the model's weights; copies are refreshed in place so captured graphs stay valid."""
        base, model = self.base, self.model
        scale = None
        if self.family.embed_scale:  # HF: embedding * embed_scale.to(weight dtype)
            scale = base.embed_tokens.embed_scale.detach().to(device=self.device, dtype=self.dtype)
        for name, t in (("embed", base.embed_tokens.weight.detach()), ("norm_w", self._norm_w(base.norm)),
                        ("lm_w", model.lm_head.weight.detach()), ("embed_scale", scale)):
            old = getattr(self, name, None)
            if old is not None and t is not None and old.data_ptr() != t.data_ptr():
                old.copy_(t)
            else:
                setattr(self, name, t)
        if not self.layers:
            self.layers = [self._layer(layer) for layer in base.layers]
            return
        for old, layer in zip(self.layers, base.layers):  # a layer at a time: one layer's fresh copies at most
            for key, t in self._layer(layer).items():
                if t is not None and old[key] is not None and old[key].data_ptr() != t.data_ptr():
                    old[key].copy_(t)  # keep the addresses graphs captured
                else:
                    old[key] = t

    def nbytes_step(self) -> int:
        """Weight bytes one decode step reads (everything but the embedding table, which is gathered)."""
        n = self.lm_w.numel() * self.lm_w.element_size() + self.norm_w.numel() * self.norm_w.element_size()
        for L in self.layers:
            n += sum(t.numel() * t.element_size() for t in L.values() if t is not None)
        return n
