"""rollout.weights=auto's timed check at the shapes and rows the GPU blueprints run (issue 41): per Qwen2.5 shape and
engine rows, one decoder layer's four projections as bf16 and as the engine's fp8 matmuls (us per layer) and what
auto chooses. Compared with the whole decode step's A/B (rollout.py --ab-fp8) it says whether the check predicts it.

    python infra/bench/weights_auto.py --shape 1.5b --shape 7b --rows 256 --rows 640
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SHAPES  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--rows", action="append", type=int, default=[])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("VERLFLOW_CACHE_DIR", tempfile.mkdtemp())  # time afresh, keep nothing
    from transformers import Qwen2Config

    from verlflow.core.ml.fastgen.weightcheck import fp8_pays

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for shape in args.shape or ["1.5b", "7b"]:
        for rows in args.rows or [256, 640]:
            fp8, record = fp8_pays(Qwen2Config(**SHAPES[shape]), torch.bfloat16, rows, dev)
            out.append({"shape": shape, "rows": rows, **record})
            print(json.dumps(out[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
