"""A fast sampler for Hugging Face decoder-only causal LMs (the rollout engine "static"): the families in
``families.py`` (SUPPORTED_MODEL_TYPES: Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma-2, Gemma-3 text, OLMo-2), one
small adapter each; anything an adapter cannot serve exactly is refused with a ValueError naming the field.

What it does, against ``model.generate``:

* reads the HF model's own weights (q/k/v and gate/up fused into one matrix each, copied once, or read as they
  are where HF already fuses them; the rest by reference) and runs its own forward: no HF cache objects, no
  per-step mask building;
* a static KV cache of (batch, kv_heads, max_prompt + max_new_tokens, head_dim) per layer, filled by one
  left-padded prefill; every decode step writes one slot (the same slot for every row: rows are left-padded,
  so row b's valid slots are [pad_b, slot]) and masks by that per-row range;
* decode attention never expands the shared K/V heads (HF's StaticCache path copied them to all query heads
  over the whole cache, every layer, every step). Three implementations, picked per engine: "sdpa"
  (F.scaled_dot_product_attention with enable_gqa over a *bucket* of the cache: the first multiple of
  ``bucket`` slots holding the current slot, one captured step per bucket), "triton" (our split-KV kernel:
  the group's query heads against their KV head, valid slots only, one captured step for every length),
  "bmm" (q viewed as (B, kv_heads, group, D) times the cache's (B, kv_heads, T, D); the CPU path). With
  attn="auto" on CUDA the engine times sdpa and the Triton configurations once per machine and shape and keeps
  the fastest, twice: for rows at one length (micro-batches) and at spread lengths (continuous batching, where
  sdpa reads the longest row's bucket for every row and the Triton kernel each row's own slots);
* on CUDA the whole decode step (embedding, all layers, head, sampling, EOS bookkeeping, state advance) is
  one CUDA graph replayed with no host input; the per-layer functions, the head and the prefill are
  ``torch.compile``d (no cudagraph trees: we capture ourselves) so elementwise work is fused;
* sampling matches HF's warpers (temperature -> top_k -> top_p) without sorting the vocabulary:
  - greedy: argmax;
  - top_k: the k largest through the block maxima (only k blocks of 128 are ranked), then HF's top-p on the
    k survivors (sorting k values, not the vocabulary);
  - full-vocabulary top_p: exact rejection sampling. Draw C candidates from softmax(x) by a two-level inverse
    CDF (block sums, then one block), keep the first one that lies in the nucleus: token i is in HF's nucleus
    iff the mass of tokens with logit <= x_i exceeds 1 - top_p (one pass for all C candidates; on CUDA the
    block sums and that test are Triton kernels, ``sampler="triton"``, the test in two passes: each row's first
    candidate alone, accepted with probability >= top_p, then all candidates of the rows it did not settle). The
    first accepted candidate of iid draws from p is distributed as p restricted to the nucleus, exactly.
    C is chosen so that P(all C rejected) = (1 - top_p)^C <= 1e-9; in that case the argmax (always in the
    nucleus) is taken. Tied logits at the nucleus boundary are kept together (HF keeps an arbitrary subset);
  - finished rows emit ``pad_id`` (HF's rule) and are checked for EOS; every ``check_every`` steps the host
    looks whether all rows finished and stops early. Nothing recompiles when rows finish.

On CPU (the tests) the same code runs eagerly, step by step, with no graphs and no compile.

Files: ``families.py`` (one adapter per model family; torch-free), ``sampling.py`` (the warpers without a vocabulary
sort), ``kernels.py`` (Triton: decode attention and the top-p passes), ``layers.py`` (the layer forward over fused
weights, and reading a model through its family), ``options.py`` (EngineOptions: the engine's switches, decided in
one place), ``engine.py`` (FastGen, a façade over the files after it, and ``sample``), ``state.py`` (the KV cache and
decode state), ``runner.py`` (the decode step and the prefill), ``graphs.py`` (compile, CUDA-graph capture and
replay), ``autotune.py`` (what runs: the attention timing, kept per machine by ``choices.py``) with ``checks.py``
(the kernels' start-up self-checks), ``batching.py`` (micro-batches and continuous batching).
"""

import importlib

from verlflow.core.ml.fastgen.support import SUPPORTED_MODEL_TYPES

# The engine's modules import torch (and triton on CUDA): loaded on first use, so that importing the package for
# SUPPORTED_MODEL_TYPES (the driver's preflight) costs nothing.
_LAZY = {
    "engine": ("FastGen", "engine_for", "sample", "sample_turns"),
    "options": ("EngineOptions", "Fp8Choices"),
    "kernels": ("HAVE_TRITON", "decode_attention_triton", "reference_decode_attention", "sample_logits_triton"),
    "sampling": ("SamplingConfig", "_Stats", "inverse_cdf", "nucleus_member", "sample_logits", "topk_filter",
                 "topk_values"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["FastGen", "EngineOptions", "Fp8Choices", "SamplingConfig", "sample", "sample_turns", "engine_for",
           "sample_logits", "sample_logits_triton", "decode_attention_triton", "reference_decode_attention",
           "nucleus_member", "inverse_cdf", "topk_filter", "topk_values", "HAVE_TRITON", "SUPPORTED_MODEL_TYPES"]
