"""The decode attention an engine timed (``graph_times``), kept across processes (rank side).

Timing the candidates costs a pool's first rollout seconds (each Triton configuration compiled and loaded, every
candidate captured and replayed). The winner depends only on the chip, the software and the engine's shape, so it is
kept under the machine's cache folder, keyed by all of them, and a later engine of that shape on that machine reuses
it. A file that cannot be read or written is no error: the engine times again."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time

import torch

from verlflow.core.cachedir import cache_root

log = logging.getLogger("verlflow.fastgen")


def where():
    return cache_root() / "fastgen" / "attention.json"


def key(device, **shape) -> str:
    import triton

    facts = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                 cuda=torch.version.cuda, **shape)
    return json.dumps(facts, sort_keys=True, default=str)


def _read() -> dict:
    try:
        return json.loads(where().read_text())
    except (OSError, ValueError):
        return {}


def load(k: str, valid=lambda got: got.get("attn") in ("sdpa", "triton")) -> dict | None:
    """The choice kept under ``k`` (an attention choice, or what ``valid`` accepts), None if none or unreadable."""
    got = _read().get(k)
    return got if isinstance(got, dict) and valid(got) else None


def store(k: str, choice: dict) -> None:
    path = where()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read(), k: choice}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".attention-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)  # whole or not at all: another rank may be reading it
    except OSError as e:
        log.info("fastgen: could not keep the attention choice in %s (%s)", path, e)


def graph_times(fns: dict, dev, reps: int = 20) -> dict:
    """{name: us per call + its fixed extra} for fns {name: (extra_us, fn)}, each replayed from a CUDA graph of
    ``reps`` calls as the decode step runs them (timed eagerly, a Triton kernel's Python launch, ~50 us, hid its GPU
    time, ~25 us, and sdpa always won); interleaved rounds, the best of three each."""
    def graphed(fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        return g

    def timed(g):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize(dev)
        return a.elapsed_time(b) / reps * 1e3

    side = torch.cuda.Stream(device=dev)  # compile everything off the capture, as the step's warm-up does
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _, fn in fns.values():
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graphs = {k: (extra, graphed(fn)) for k, (extra, fn) in fns.items()}
    t0 = time.perf_counter()
    first = next(iter(graphs.values()))[1]
    while time.perf_counter() - t0 < 0.1:  # ~100 ms of work so the clocks are up
        timed(first)
    times: dict = {}
    for _ in range(3):
        for k, (extra, g) in graphs.items():
            times[k] = min(times.get(k, float("inf")), extra + timed(g))
    return times
