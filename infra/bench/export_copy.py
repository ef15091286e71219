"""Where the checkpoint stage's export copy goes (issue 15: 6.4 s of a steady 1.5B iteration on an H200).

The stage casts the policy's full state dict on the GPU, allocates an uninitialised CPU model and copies into it
(`export.export_model`). This times the parts apart, and three other ways to make the same CPU copy, each in the
same run: reusing the CPU model (no new pages), pre-faulting new pages first, and a pinned slab
(`dcpio.CpuCopy`, registration included). One process, one GPU.

    python infra/bench/export_copy.py --shape 1.5b --dtype bfloat16 --repeats 3 --json out.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SHAPES  # noqa: E402

from verlflow.core.ml import dcpio  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(shape: str, dtype, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).to(dtype)
    return model.to_empty(device=device)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, round(time.perf_counter() - t, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    src = {k: v for k, v in build(args.shape, torch.float32, dev).state_dict().items()}  # fp32 master weights
    nbytes = sum(v.numel() for v in src.values()) * torch.finfo(dtype).bits // 8
    rows = []
    reused = None
    for rep in range(args.repeats):
        row = {"repeat": rep, "gb": round(nbytes / 1e9, 2)}
        cast, row["cast_on_gpu_s"] = timed(lambda: {k: v.to(dtype) for k, v in src.items()})
        model, row["alloc_cpu_model_s"] = timed(lambda: build(args.shape, dtype, "cpu"))
        _, row["copy_into_new_pages_s"] = timed(lambda: model.load_state_dict(cast, strict=False))
        reused = reused or model
        _, row["copy_into_reused_model_s"] = timed(lambda: reused.load_state_dict(cast, strict=False))
        fresh = build(args.shape, dtype, "cpu")
        _, row["prefault_s"] = timed(lambda: [p.data.zero_() for p in fresh.parameters()])
        _, row["copy_after_prefault_s"] = timed(lambda: fresh.load_state_dict(cast, strict=False))
        if dev.type == "cuda":
            slab, row["pinned_slab_alloc_s"] = timed(lambda: dcpio.CpuCopy(cast, pin=True))
            _, row["pinned_slab_copy_s"] = timed(lambda: slab.copy_from(cast))
            del slab
        del cast, model, fresh
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "dtype": args.dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
