"""Making the background save's pinned CPU slab (verlflow.core.ml.dcpio.make_slab): page-locking N GB with the
pages faulted in first on every core (`touch`, today's) or by cudaHostRegister itself, and what registering does
to GPU work launched meanwhile from another thread (a warm pool's build reserves the first update's slab while
the first rollout runs).

    python infra/bench/pin.py --gb 19.5 --json pin.json          # GPU only
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def gpu_loop(seconds: float, until: threading.Thread | None = None) -> float:
    """Matmul steps per second over `seconds` (or while `until` runs), each step synchronised (a decode loop's
    shape of work)."""
    a = torch.randn(256, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 8960, device="cuda", dtype=torch.bfloat16)
    n, t0 = 0, time.perf_counter()
    while (until.is_alive() if until is not None else time.perf_counter() - t0 < seconds):
        for _ in range(20):
            a @ w
        torch.cuda.synchronize()
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    from verlflow.core.ml import dcpio

    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=19.5)
    ap.add_argument("--json")
    a = ap.parse_args()
    nbytes = int(a.gb * 1e9)
    out = {"gb": a.gb, "threads": torch.get_num_threads()}
    for touch in (False, True):
        t = time.perf_counter()
        slab = dcpio.make_slab(nbytes, pin=True, touch=touch)
        out[f"make_s_touch_{touch}"] = round(time.perf_counter() - t, 2)
        src = torch.empty(nbytes // 8, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        slab[: src.numel()].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"copy_gbps_touch_{touch}"] = round(src.numel() / (time.perf_counter() - t) / 1e9, 2)
        del slab, src
        print(json.dumps(out), flush=True)
    # The whole CPU copy of a GPU state of that size (what a role's first background save makes), then a refill.
    n = 200
    sd = {f"t{i}": torch.empty(nbytes // n // 4, dtype=torch.float32, device="cuda") for i in range(n)}
    t = time.perf_counter()
    copy = dcpio.CpuCopy(sd, pin=True)
    out["cpu_copy_make_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    copy.copy_from(sd)
    out["cpu_copy_refill_s"] = round(time.perf_counter() - t, 2)
    del copy, sd
    print(json.dumps(out), flush=True)
    gpu_loop(1.0)  # warm
    out["gpu_steps_per_s_alone"] = round(gpu_loop(5.0), 1)
    done = {}

    def register() -> None:
        t = time.perf_counter()
        done["slab"] = dcpio.make_slab(nbytes, pin=True)
        done["s"] = time.perf_counter() - t

    th = threading.Thread(target=register)
    t0 = time.perf_counter()
    th.start()
    rate = gpu_loop(0.0, until=th)
    th.join()
    out["gpu_steps_per_s_while_pinning"] = round(rate, 1)
    out["make_s_beside_gpu_work"] = round(done["s"], 2)
    out["overlap_wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
