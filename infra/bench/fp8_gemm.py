"""Where the fp8 projections' time goes at the decode step's shape (issue 18 item 3; CUDA).

rollout.weights=fp8 measured 3.72 ms a step at 1.5B against 3.14 in bf16 (H200, session 15). Per projection of the
shape, at M rows (the engine's batch), each replayed from CUDA graphs (``choices.graph_times``), one process:

* bf16: ``F.linear``, the baseline;
* the fp8 GEMM alone on input already in e4m3: ``torch._scaled_mm`` with row-wise scales, with fast accumulation,
  and with one scale per tensor;
* the activations' quantization alone (row max, scale, cast), compiled;
* the engine's projection as it compiles it: the RMSNorm before it, then the quantization and the GEMM (``_fp8_linear``
  under ``torch.compile`` with the ATen GEMM), against the same with bf16 ``F.linear``; and with the unit-scaled GEMM
  (``Fp8Choices(gemm="unit")``, the default), whose scales are applied in the kernel after it (a SiLU here, as after
  gate/up).

Then (``--steps``) the decode step of the bf16 and the fp8 engine under the profiler: their kernel tables side by
side in ``--out``.

    python infra/bench/fp8_gemm.py --shape 1.5b --json $OUT/fp8_gemm.json --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SHAPES, build_model, make_prompts, model_config, profile_step, say  # noqa: E402

from verlflow.core.ml.fastgen import EngineOptions, FastGen, Fp8Choices, SamplingConfig  # noqa: E402
from verlflow.core.ml.fastgen import choices  # noqa: E402
from verlflow.core.ml.fastgen.layers import (FP8, FP8_MAX, _fp8_linear, _rms, quantize_rows,  # noqa: E402
                                              quantize_tokens)


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each fused projection the engine runs."""
    cfg, _ = model_config(shape)
    H, inter = cfg.hidden_size, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // nh
    return {"qkv": ((nh + 2 * nkv) * hd, H), "o": (H, nh * hd), "gate_up": (2 * inter, H), "down": (H, inter)}


def quantize_act_two_level(x):  # a long row's maximum over blocks of 128, then the blocks (the same maximum)
    x2 = x.float()
    M, K = x2.shape
    amax = x2.view(M, K // 128, 128).abs().amax(-1).amax(-1, keepdim=True) if K % 128 == 0 else x2.abs().amax(-1, True)
    sx = amax.clamp(min=1e-12) / FP8_MAX
    return (x2 / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8), sx


def times_for(M: int, N: int, K: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g, device=dev) * K ** -0.5).to(torch.bfloat16)
    norm_w = torch.ones(K, device=dev, dtype=torch.bfloat16)
    w8, sw = quantize_rows(w)
    x8, sx = quantize_tokens(x)
    one = torch.ones((), device=dev)
    opts = {"options": {"max_autotune_gemm_backends": "ATEN"}}
    q_compiled = torch.compile(quantize_tokens, **opts)
    q_two = torch.compile(quantize_act_two_level, **opts)
    norm_bf16 = torch.compile(lambda x: F.linear(_rms(x, norm_w, 1e-6), w), **opts)
    norm_fp8 = torch.compile(lambda x: _fp8_linear(_rms(x, norm_w, 1e-6), w8, sw, None), **opts)
    # the unit-scaled GEMM, its scales applied after it with the activation that follows (SiLU, as gate/up's)
    norm_fp8_unit = torch.compile(lambda x: F.silu(_fp8_linear(_rms(x, norm_w, 1e-6), w8, sw, None, unit=True)),
                                  **opts)
    norm_bf16_act = torch.compile(lambda x: F.silu(F.linear(_rms(x, norm_w, 1e-6), w)), **opts)
    fns = {
        "bf16_linear": (0.0, lambda: F.linear(x, w)),
        "fp8_gemm_rowwise": (0.0, lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw,
                                                           out_dtype=torch.bfloat16)),
        "fp8_gemm_rowwise_fast_accum": (0.0, lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw,
                                                                      out_dtype=torch.bfloat16, use_fast_accum=True)),
        "fp8_gemm_tensorwise": (0.0, lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16)),
        "quantize_compiled": (0.0, lambda: q_compiled(x)),
        "quantize_two_level_compiled": (0.0, lambda: q_two(x)),
        "norm_then_bf16_linear_compiled": (0.0, lambda: norm_bf16(x)),
        "norm_then_fp8_linear_compiled": (0.0, lambda: norm_fp8(x)),
        "norm_bf16_linear_silu_compiled": (0.0, lambda: norm_bf16_act(x)),
        "norm_fp8_unit_linear_silu_compiled": (0.0, lambda: norm_fp8_unit(x)),
    }
    out = {}
    for name, fn in fns.items():  # one at a time: a failing variant (a GEMM this torch lacks) is reported, not fatal
        try:
            out.update(choices.graph_times({name: fn}, dev))
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in out.items()}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=256, help="M: the engine's batch")
    ap.add_argument("--steps", action="store_true", help="also profile the bf16 and fp8 engines' decode steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="folder for the profiles")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    dev = torch.device("cuda")
    res = {"shape": args.shape, "rows": args.rows, "gpu": torch.cuda.get_device_name(dev), "us": {}}
    say(f"{args.shape}, M={args.rows}, {res['gpu']}; microseconds per call, CUDA-graph replayed")
    for name, (N, K) in projections(args.shape).items():
        res["us"][name] = t = times_for(args.rows, N, K, dev)
        say(f"{name} (N={N}, K={K}): {json.dumps(t)}")
    if args.steps:
        model, eos, pad = build_model(args.shape, torch.bfloat16, dev)
        ids, mask = make_prompts(args.rows, 128, model.config.vocab_size, False, dev)
        cfg = SamplingConfig(1.0, 0.95)
        out = Path(args.out or ".")
        for name, kw in (("model", {}), ("fp8_rowwise", {"weights": "fp8", "fp8": Fp8Choices(gemm="rowwise")}),
                         ("fp8", {"weights": "fp8"})):
            eng = FastGen(model, args.rows, 128, 128, EngineOptions(**kw))
            eng.prepare([eos], pad, cfg, 128)
            table = profile_step(eng, ids, mask, cfg, eos, pad, out / f"profile_{args.shape}_{name}_step.txt",
                                 graphs=True)
            say(f"decode step, {name}:\n" + "\n".join(table.splitlines()[:22]))
            del eng
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
