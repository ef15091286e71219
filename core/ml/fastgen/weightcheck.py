"""rollout.weights=auto: the static engine's projections in fp8 only where a timed check finds them faster here.

fp8 halves the bytes a decode step reads, but each projection then quantizes its input per token, and at small
shapes the fp8 matmul and that extra work cost more than they save (1.5B on an H100: fp8 sampling 27.8 s against
23.7 s). Which side wins depends on the card, the software, the model's projection shapes and the engine's rows, so
it is timed: one decoder layer's four projections (fused q/k/v, o, fused gate/up, down) at the engine's rows, each as
the model's matmul and as the engine's fp8 one, compiled and replayed from CUDA graphs (choices.graph_times, as the
decode step runs them). fp8 is chosen only if it is at least ``MARGIN`` faster: sampling from an fp8 model costs a
correction, so a tie goes to the model's weights. The result is kept per machine (choices.py) and the ranks agree on
it (core/stages/collect.py); on a CPU, a GPU without fp8 or a model not in bf16 the answer is no, without timing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen import choices
from verlflow.core.ml.fastgen.layers import _fp8_linear, fp8_gpu_problem, quantize_rows
from verlflow.core.ml.fastgen.options import Fp8Choices

MARGIN = 0.95  # fp8's time at most this share of the model's


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(N, K) of one decoder layer's projections as the engine runs them (q/k/v and gate/up fused)."""
    h, i = config.hidden_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gu": (2 * i, h), "down": (h, i)}


def why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 is not even timed here (None: it is)."""
    if torch.device(device).type != "cuda":
        return "no fp8 matmul off CUDA"
    if dtype != torch.bfloat16:
        return f"the model is {dtype}, the fp8 matmul writes bf16"
    return fp8_gpu_problem(torch.device(device))


def fp8_pays(config, dtype: torch.dtype, rows: int, device, fp8: Fp8Choices | None = None) -> tuple[bool, dict]:
    """(whether fp8 projections are faster for this model's shapes at ``rows`` rows on this device, the record:
    the two times in us per layer, or the reason it was not timed)."""
    problem = why_not(device, dtype)
    if problem:
        return False, {"fp8": False, "reason": problem}
    fp8 = fp8 or Fp8Choices.from_env()
    shapes = projection_shapes(config)
    k = choices.key(device, what="weights", rows=int(rows), shapes=shapes, gemm=fp8.gemm, fast=fp8.fast_accum)
    kept = choices.load(k, valid=lambda got: isinstance(got.get("fp8"), bool))
    if kept is not None:
        return kept["fp8"], {**kept, "kept": True}
    model_us, fp8_us = _timed(shapes, int(rows), torch.device(device), fp8)
    record = {"fp8": fp8_us <= MARGIN * model_us, "model_us": round(model_us, 2), "fp8_us": round(fp8_us, 2)}
    choices.store(k, record)
    return record["fp8"], record


def _timed(shapes: dict, rows: int, dev: torch.device, fp8: Fp8Choices) -> tuple[float, float]:
    """us per layer of the four projections: the model's bf16 matmuls, the engine's fp8 ones."""
    g = torch.Generator(device=dev).manual_seed(0)
    fns = {}
    for p, (N, K) in shapes.items():
        x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) / K ** 0.5
        w8, sw = quantize_rows(w)
        unit = fp8.gemm == "unit"
        model_fn = torch.compile(lambda x=x, w=w: F.linear(x, w), fullgraph=True, dynamic=False)
        fp8_fn = torch.compile(lambda x=x, w8=w8, sw=sw: _fp8_linear(x, w8, sw, None, fp8.fast_accum, unit),
                               fullgraph=True, dynamic=False)
        fns[f"model:{p}"], fns[f"fp8:{p}"] = (0.0, model_fn), (0.0, fp8_fn)
    # the lambdas share one code object, so each shape is a recompile of it: more than dynamo's default allows
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        times = choices.graph_times(fns, dev)
    return (sum(t for name, t in times.items() if name.startswith("model:")),
            sum(t for name, t in times.items() if name.startswith("fp8:")))
