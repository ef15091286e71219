"""Compiling the decode step's functions (``compiled``) and capturing the step as CUDA graphs (``Graphs``): one graph
per cache length, sampling config and attention choice, all captured before generation (``warm_kvs``,
``capture_all``) and replayed with no host input."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("verlflow.fastgen")


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device):
    if on_cuda(device):
        torch.cuda.synchronize(device)


def compiled(fns: dict, options, fp8: bool) -> dict:
    """``fns`` through torch.compile with the engine's ``options`` (no cudagraph trees: we capture ourselves)."""
    # Inductor autotunes fp8 matmuls against its Triton templates even without max-autotune: set-up time on a cold
    # cache, and a kernel the start-up check never ran. Fp8Choices.gemm "unit"/"rowwise" keep the op's own kernel
    # (cuBLASLt), as for the bf16 matmuls; "autotune" lets inductor choose (an A/B)
    inductor = ({"max_autotune_gemm_backends": "ATEN"}
                if fp8 and options.fp8.gemm != "autotune" and options.compile_backend == "inductor" else {})
    inductor.update(options.inductor)
    opts = {"options": inductor} if inductor else {}
    return {k: torch.compile(f, fullgraph=k not in ("sample",), backend=options.compile_backend, **opts)
            for k, f in fns.items()}


def warm_kvs(state, kv_len, prompt_len: int, every_slot: bool) -> list[int]:
    """The cache lengths (``kv_len`` of a slot) of every decode step a generation may run: a micro-batch of prompts
    ``prompt_len`` wide decodes from slot prompt_len - 1 to prompt_len + max_new - 2; continuous batching up to slot
    T - 1 (its bound on the rows' slots stops there)."""
    first, last = (prompt_len - 1, state.T - 1) if every_slot else (prompt_len, prompt_len + state.max_new - 2)
    return sorted({kv_len(s) for s in range(max(0, min(first, last)), last + 1)})


def capture_all(kvs: list[int], capture, compiled_now: bool, to_eager):
    """``capture`` the step of every cache length in ``kvs``. A compile failure falls back to eager kernels
    (``to_eager``; still captured), with a warning."""
    try:
        for kv in kvs:
            capture(kv)
    except Exception as e:  # noqa: BLE001 - inductor/dynamo failures vary by version
        if not compiled_now:
            raise
        log.warning("fastgen: torch.compile failed (%s: %s); capturing eager kernels instead",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        to_eager()
        for kv in kvs:
            capture(kv)


class Graphs:
    """The captured decode steps by key, in one memory pool; ``parts`` (the engine's set-up record) counts the
    captures and their seconds."""

    def __init__(self, device, parts: dict):
        self.device = device
        self.parts = parts
        self.steps: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def get(self, key: tuple) -> torch.cuda.CUDAGraph | None:
        return self.steps.get(key)

    def clear(self):
        self.steps.clear()

    def capture(self, key: tuple, step, reset, what: str) -> torch.cuda.CUDAGraph:
        """Capture ``step()`` under ``key``: three warm-up runs on a side stream, then the capture, each from the
        state ``reset()`` leaves."""
        t0 = time.perf_counter()
        reset()  # warm-up steps run for real: keep them inside the cache
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        reset()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            step()
        torch.cuda.synchronize(self.device)
        self.steps[key] = g
        took = time.perf_counter() - t0
        self.parts["captures"] += 1
        self.parts["capture_s"] = round(self.parts["capture_s"] + took, 3)
        log.info("fastgen: captured decode step for %s in %.1fs", what, took)
        return g
