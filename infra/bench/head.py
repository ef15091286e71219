"""The fused log-prob head alone (algorithm.fused_kernels_backend): verl's FusedLinearForPPO ("torch") against its
linear_cross_entropy Triton kernels ("triton"), at the Qwen2.5-1.5B head (hidden 1536, vocabulary 151,936, bf16),
forward only (the reference and old-log-prob passes) and forward + backward (training), and each one's error
against fp64 log-softmax on a sample of tokens.

    python infra/bench/head.py --tokens 32768 --repeats 5 --json head.json      # GPU only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timed(fn, repeats: int) -> float:
    fn()  # compile / autotune
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    from verlflow.core.ml import fusedhead

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(a.vocab, a.hidden, device="cuda", generator=g) / a.hidden ** 0.5).bfloat16()
    labels = torch.randint(0, a.vocab, (a.tokens,), device="cuda", generator=g)
    sample = torch.arange(0, a.tokens, max(1, a.tokens // 512), device="cuda")
    exact = torch.log_softmax(h[sample].double() @ w.double().T, -1).gather(1, labels[sample, None])[:, 0]
    flops = 2 * a.tokens * a.hidden * a.vocab
    rows = {}
    for backend in fusedhead.BACKENDS:
        fn = fusedhead.head(backend)
        with torch.no_grad():
            fwd = timed(lambda: fn(h, w, labels, 1.0), a.repeats)
            logp = fn(h, w, labels, 1.0)[0]
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            logp, ent = fn(hg, wg, labels, 1.0)
            (logp.float().sum() + 0.0 * ent.float().sum()).backward()
            hg.grad = wg.grad = None

        both = timed(step, a.repeats)
        rows[backend] = {"forward_ms": round(fwd * 1e3, 2), "fwd_bwd_ms": round(both * 1e3, 2),
                         "forward_tflops": round(flops / fwd / 1e12, 1),
                         "fwd_bwd_tflops": round(3 * flops / both / 1e12, 1),
                         "logp_max_err_vs_fp64": float((logp[sample].double() - exact).abs().max()),
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        torch.cuda.reset_peak_memory_stats()
        print(backend, json.dumps(rows[backend]), flush=True)
    t, x = rows["torch"], rows["triton"]
    print(f"triton / torch: forward {t['forward_ms'] / x['forward_ms']:.2f}x, forward+backward "
          f"{t['fwd_bwd_ms'] / x['fwd_bwd_ms']:.2f}x faster ({a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab})")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
