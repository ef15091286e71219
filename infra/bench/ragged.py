"""Ragged-length rollout benchmark (issue 18 item 2): the static engine's micro-batches ("waves": each runs until
its longest response ends) against continuous batching (a row whose response ended takes the next waiting
prompt), on the same prompts, the same engine and the same response lengths, in one process.

Response lengths: real RL rollouts stop at EOS anywhere from tens to thousands of tokens. A random-weight model
almost never samples EOS, so each prompt gets a forced stop (its token budget) drawn log-uniformly from
[--min-len, --new]; both modes honour the same budgets, so they generate the same number of tokens.

    python infra/bench/ragged.py                        # GPU: Qwen2.5-1.5B shape, 256 rows, 1024 prompts, 32..1024
    python infra/bench/ragged.py --smoke                # CPU-sized (the test suite runs this)

Prints: tokens, seconds (prefill + decode, set-up apart), tok/s, decode steps, row occupancy (generated tokens /
(steps x rows): the share of row-steps doing useful work), GPU busy (torch.cuda.utilization sampled every 50 ms,
where NVML is available), and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SHAPES, build_model, say, sync  # noqa: E402

from verlflow.core.ml.compiletime import Meter  # noqa: E402
from verlflow.core.ml.fastgen import EngineOptions, FastGen, SamplingConfig  # noqa: E402


def workload(n: int, plen: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    """n prompts of lengths in [plen/2, plen] and a log-uniform response budget in [min_len, max_len] each."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, plen // 2), plen + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(10, vocab - 10, (k,), generator=g).tolist() for k in lens]
    u = torch.rand(n, generator=g, dtype=torch.float64)
    budgets = [int(round(math.exp(math.log(min_len) + x * (math.log(max_len) - math.log(min_len)))))
               for x in u.tolist()]
    return prompts, budgets


class GpuBusy:
    """torch.cuda.utilization() (NVML's busy share) sampled in a thread; None where NVML is missing."""

    def __init__(self, dev: torch.device, every_s: float = 0.05):
        self.dev, self.every_s, self.samples = dev, every_s, []
        self._stop = threading.Event()
        self._thread = None
        if dev.type == "cuda":
            try:
                torch.cuda.utilization(dev)
                self._thread = threading.Thread(target=self._run, daemon=True)
            except Exception:  # noqa: BLE001 - no pynvml / NVML
                self._thread = None

    def _run(self):
        while not self._stop.wait(self.every_s):
            self.samples.append(torch.cuda.utilization(self.dev))

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    @property
    def mean(self):
        return sum(self.samples) / len(self.samples) if self.samples else None


def run_waves(eng: FastGen, prompts, budgets, cfg, eos, pad, dev) -> dict:
    """Today's path (rollout.batching=micro_batches): left-padded micro-batches of the engine's rows, in order."""
    B, tokens, steps, gen_s = eng.B, 0, 0, 0.0
    meter = Meter()
    with GpuBusy(dev) as busy:
        for s in range(0, len(prompts), B):
            chunk, lim = prompts[s:s + B], budgets[s:s + B]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            eng.generate(ids.to(dev), mask.to(dev), cfg, [eos], pad, limits=torch.tensor(lim))
            st = eng.last_stats
            tokens, steps, gen_s = tokens + st["tokens"], steps + st["steps"], gen_s + st["prefill_s"] + st["decode_s"]
    return {"tokens": tokens, "seconds": gen_s, "tok_s": tokens / gen_s, "steps": steps,
            "occupancy": tokens / (steps * B), "gpu_busy_pct": busy.mean, **compiled(meter)}


def compiled(meter: Meter) -> dict:
    """dynamo's compiles while a mode ran (a first call's extra seconds: compiles mid-generation, or not)"""
    n, s, phases = meter.read(min_s=0)
    return {"compiles": n, "compile_s": round(s, 3), "compile_phases": phases}


def run_continuous(eng: FastGen, prompts, budgets, cfg, eos, pad, dev, refill_min=None) -> dict:
    meter = Meter()
    with GpuBusy(dev) as busy:
        resp, _ = eng.generate_many(prompts, cfg, [eos], pad, limits=budgets, refill_min=refill_min)
    st = eng.last_stats
    gen_s = st["prefill_s"] + st["decode_s"]
    assert st["tokens"] == sum(map(len, resp))
    return {"tokens": st["tokens"], "seconds": gen_s, "tok_s": st["tokens"] / gen_s, "steps": st["steps"],
            "occupancy": st["occupancy"], "refills": st["refills"], "refill_shapes": st["refill_shapes"],
            "prefill_s": st["prefill_s"],
            "gpu_busy_pct": busy.mean, **compiled(meter)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=256, help="engine rows (rollout.micro_batch_size)")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128, help="prompt lengths in [prompt/2, prompt]")
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=1024, help="max_new_tokens, the longest response")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--refill-min", type=int, action="append", help="repeatable; default the engine's (rows/32)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--weights", default="model", choices=["model", "fp8"], help="the projections' precision "
                    "(rollout.weights)")
    ap.add_argument("--kv-cache", default="model", choices=["model", "fp8"], help="the KV cache's precision "
                    "(rollout.kv_cache)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: tiny shape, 4 rows, 16 prompts, 2..64 new")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="sdpa without its cuDNN backend (is the first call's "
                    "extra prefill time cuDNN planning each new refill shape?)")
    return ap


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.smoke:
        args.shape, args.batch, args.prompts, args.prompt, args.min_len, args.new = "tiny", 4, 16, 8, 2, 64
        args.device = args.device or "cpu"
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, eos, pad = build_model(args.shape, dtype, dev)
    prompts, budgets = workload(args.prompts, args.prompt, SHAPES[args.shape]["vocab_size"], args.min_len, args.new)
    cfg = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    say(f"{args.shape}: {args.prompts} prompts, {args.batch} rows, budgets {min(budgets)}..{max(budgets)} "
        f"(mean {sum(budgets) / len(budgets):.0f}), device {dev}")
    t0 = time.perf_counter()
    eng = FastGen(model, args.batch, args.prompt, args.new,
                  EngineOptions(weights=args.weights, kv_cache=args.kv_cache))
    eng.prepare([eos], pad, cfg, args.prompt // 2, every_slot=True)
    sync(dev)
    res = {"shape": args.shape, "weights": args.weights, "kv_cache": args.kv_cache, "rows": args.batch, "prompts": args.prompts,
           "engine_setup_s": time.perf_counter() - t0,
           "attn": [eng.attn, eng.attn_cfg], "attn_continuous": eng.ragged_attn or "the same",
           "attn_timings_us": {"one length": eng.attn_timings, "spread lengths": eng.ragged_timings},
           "budgets_mean": sum(budgets) / len(budgets)}
    torch.manual_seed(0)
    res["waves"] = run_waves(eng, prompts, budgets, cfg, eos, pad, dev)
    say("waves", res["waves"])
    for n, rm in enumerate(args.refill_min or [None, None]):  # default: twice, the first compiling the refill prefill
        torch.manual_seed(0)
        key = ("continuous" if rm is None else f"continuous_refill{rm}") + ("_again" if n and rm is None else "")
        res[key] = run_continuous(eng, prompts, budgets, cfg, eos, pad, dev, rm)
        say(key, res[key])
    rows = [("mode", "tokens", "seconds", "tok/s", "steps", "row occupancy", "GPU busy %", "compiles (s)",
             "prefill s (refill shapes)", "speed-up")]
    base = res["waves"]["tok_s"]
    for key in [k for k in res if k == "waves" or k.startswith("continuous")]:
        r = res[key]
        busy = "n/a" if r["gpu_busy_pct"] is None else f"{r['gpu_busy_pct']:.0f}"
        rows.append((key, str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tok_s']:.0f}", str(r["steps"]),
                     f"{r['occupancy']:.2f}", busy, f"{r['compiles']} ({r['compile_s']:.1f})",
                     f"{r['prefill_s']:.2f} ({r['refill_shapes']})" if "refill_shapes" in r else "-",
                     f"{r['tok_s'] / base:.2f}x"))
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows[1:]:
        print("| " + " | ".join(r) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
