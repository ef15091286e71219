"""The fp8 KV cache's model as HF runs it: every key and value vector (one KV head at one slot) rounded to e4m3
with its own scale before attention, written here in plain torch (not with the engine's helpers)."""

import contextlib
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

E4M3_MAX = 448.0


def round_kv(t: torch.Tensor) -> torch.Tensor:
    """(..., slots, head_dim): each vector as e4m3 times its own fp32 scale (its largest element maps to 448)."""
    s = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return ((t.float() / s).to(torch.float8_e4m3fn).float() * s).to(t.dtype)


@contextlib.contextmanager
def fp8_cache(model):
    """HF's attention of ``model`` (its eager or sdpa function) over rounded keys and values while inside. HF keeps
    its own cache unrounded and rounds on every call: rounding a vector is deterministic, so each slot is seen as
    the engine's fp8 cache keeps it."""
    impl = model.config._attn_implementation
    if impl == "eager":  # the modeling module's own function, looked up when each attention runs
        mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
        orig = mod.eager_attention_forward
        mod.eager_attention_forward = lambda m, q, k, v, *a, **kw: orig(m, q, round_kv(k), round_kv(v), *a, **kw)
        try:
            yield
        finally:
            mod.eager_attention_forward = orig
    else:
        orig = ALL_ATTENTION_FUNCTIONS[impl]
        ALL_ATTENTION_FUNCTIONS[impl] = lambda m, q, k, v, *a, **kw: orig(m, q, round_kv(k), round_kv(v), *a, **kw)
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[impl] = orig
