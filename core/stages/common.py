"""What every stage worker shares: its entry point, the job (process group, seeds, the stage's run, the commit), and
the retention pass.

A stage module is `main = stage_main(run)` where `run(ctx) -> metrics`. The worker writes its outputs into
`ctx.out`, takes its models from `ctx.models` and hands writes to `ctx.write` (verlflow.core.stages.runtime: where
the models come from and when the writes run is the runtime's business); after every rank is done, rank 0 commits
the manifest (so a crash commits nothing).
"""

import logging
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from verlflow.core import faults
from verlflow.core.blueprint import Blueprint
from verlflow.core.checks import memplan
from verlflow.core.job import JobSpec
from verlflow.core.ml import compiletime
from verlflow.core.stages import loads
from verlflow.core.stages.runtime import commit
from verlflow.core.stages.runtime.committer import for_pool
from verlflow.core.stages.runtime.context import StageContext
from verlflow.core.stages.runtime.models import Models
from verlflow.core.store import retention
from verlflow.core.store.artifacts import open_store

__all__ = ["StageContext", "retention_pass", "run_job", "stage_main"]  # StageContext: verlflow.core.stages.runtime

log = logging.getLogger("verlflow.stage")


def setup_logging(rank: int) -> None:
    import warnings

    # DCP's single-process load (the inference copy, the HF export) warns on every call; it is intended here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    # verl calls logging.basicConfig on import; force our format. The rank is not in it: the launcher prefixes
    # every line of a rank with `[rankN]` already (core/orchestrate/launcher.py), and core/orchestrate/logsink.py reads this format.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True, stream=sys.stdout)


def _init_process_group(bp: Blueprint) -> tuple[int, int, int, torch.device]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if bp.resources.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(bp.resources.dist_backend, timeout=collective_timeout(bp))
    return rank, world, local_rank, device


def collective_timeout(bp: Blueprint) -> timedelta:
    """Past the stage's own timeout, so that one (which prints every rank's stack first) fires before a collective's
    (which names only the rank that gave up)."""
    return timedelta(seconds=bp.resources.stage_timeout_s + 60)


def _seed(bp: Blueprint, iteration, rank: int) -> None:
    import random

    import numpy as np

    it = iteration if isinstance(iteration, int) else 0
    s = bp.seed * 100_003 + it * 1_009 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    _set_deterministic(bp.deterministic)


def _set_deterministic(mode: bool) -> None:
    """Set either way: a warm pool's next job must not inherit the last one's setting. torch's setter also imports
    torch._inductor (and with it dynamo: ~2 s a rank on a busy core) to set inductor's flag, which is False until
    then: we pay that only to turn it on, or to turn it off where inductor is already loaded."""
    if mode or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=True)
    else:
        torch._C._set_deterministic_algorithms(False, warn_only=True)


def stage_main(run: Callable[[StageContext], dict],
               after_commit: Callable[[StageContext, dict], None] | None = None) -> Callable[[], None]:
    """The torchrun entry point of a stage module: one job (sys.argv[1]) in a fresh process group."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from verlflow.core.stages.runtime.entry import run_and_exit, worker_guard

    @record
    def job() -> None:
        worker_guard()
        try:
            run_job(Path(sys.argv[1]), run, after_commit)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def main() -> None:
        run_and_exit(job)

    main.run, main.after_commit = run, after_commit  # what the warm pool's serve loop calls per job
    return main


def run_job(job_file: Path, run: Callable[[StageContext], dict],
            after_commit: Callable[[StageContext, dict], None] | None = None,
            in_pool: bool = False, pool_ready_at: float | None = None) -> dict | None:
    """One stage job on every rank: its outputs, then (rank 0) the manifest. The process group is made on the
    first job and kept, so a warm pool runs job after job in the same processes.

    In a warm pool the commit may go to the background (verlflow.core.stages.runtime.commit): the return value then
    says so, with the manifest to come. The pool's first job gets `pool_ready_at` (when its ranks had started and
    imported), so the pool's start-up is its own timing, not the stage's."""
    t_start = time.time()
    job = JobSpec.read(job_file)
    rank, world, local_rank, device = _init_process_group(job.blueprint)
    bp = memplan.resolved(job.blueprint, device)  # its `auto` settings, by the memory plan for this card
    retried = {}
    if job.oom_retry:  # the runner's retry after an out-of-memory error (resources.oom_retry)
        bp, retried = memplan.at_half(bp, job.stage, job.phase)
    setup_logging(rank)
    _seed(bp, job.iteration, rank)
    store = open_store(bp.storage)
    out = store.local_path(job.output)
    if out is None:  # remote store: write on local disk, upload at commit
        out = Path(job.scratch) / "out"
        if local_rank == 0:
            shutil.rmtree(out, ignore_errors=True)
    if world > 1:
        dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    write = commit.Writes(for_pool(collective_timeout(bp)) if in_pool else None, bp.resources.async_checkpoint)
    ctx = StageContext(job, bp, store, rank, world, local_rank, device, out, write,
                       timings=_launch_timings(job, t_start, pool_ready_at))
    ctx.models = Models(ctx, loads)
    faults.hang_point(job.stage, rank)  # VERLFLOW_FAULT=hang_in_<stage>, barrier_hang_in_<stage>
    compiles = compiletime.Meter()
    with commit.no_space_named(ctx), memplan.watched(ctx) as memory:  # an OOM names the stage, peak, card and setting
        metrics = run(ctx) or {}
    metrics.update(memory.metrics, **retried)
    n, seconds, parts = compiles.read()
    if n:  # a first iteration's excess: how much of it was torch.compile (its other timings include it)
        ctx.timings["compile_s"] = round(seconds, 3)
        metrics["compiles"] = n
        log.info("%s: %d torch.compile runs took %.1f s (%s)", job.name, n, seconds, parts)
    if hits := ctx.models.hits():
        metrics["warm_cache_hits"] = hits
    return commit.finish(ctx, metrics, t_start, after_commit)


def _launch_timings(job: JobSpec, t_start: float, pool_ready_at: float | None) -> dict:
    """From the runner's launch to this worker's start: a fresh job's spawn and imports, a warm job's hand-over;
    a pool's first job has the pool's own start-up apart."""
    launched = job.launched_at
    if pool_ready_at is None:
        return {"launch_to_worker_s": round(t_start - launched, 3)}
    return {"pool_start_s": round(max(0.0, pool_ready_at - launched), 3),
            "launch_to_worker_s": round(t_start - max(pool_ready_at, launched), 3)}


def retention_pass(ctx: StageContext, manifest: dict | None = None) -> None:
    """Prune what the run no longer keeps, now that this stage is committed (an after_commit: store operations
    only, it may run on a warm pool's committer thread)."""
    head = ctx.iteration if isinstance(ctx.iteration, int) else None  # a phase's epoch is no rl iteration
    retention.retain(ctx.store, ctx.bp.storage, ctx.job.run_id, head=head, reads=ctx.job.checkpoint_reads,
                     between=lambda: faults.kill_point("prune", ctx.rank))  # a crash mid-prune
