"""What every stage worker shares: the job file, process group, logging with ranks, inputs, and the commit.

A stage module is `main = stage_main(run)` where `run(ctx) -> metrics`. The worker writes its outputs into
`ctx.out`; after every rank is done, rank 0 commits the manifest (so a crash commits nothing).
"""

import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import NO_SPACE_FIX, StoreError, is_no_space
from verlflow.core.job import InputRecord, JobSpec
from verlflow.core.ml import compiletime
from verlflow.core.ml.placement import Placement
from verlflow.core.orchestrate import memplan
from verlflow.core.stages import modelcache
from verlflow.core.stages import committer as committers
from verlflow.core.agree import any_rank
from verlflow.core.store import retention
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.store.digests import digest_files
from verlflow.core.testing import faults

log = logging.getLogger("verlflow.stage")


@dataclass
class StageContext:
    job: JobSpec
    bp: Blueprint
    store: ArtifactStore
    rank: int
    world: int
    local_rank: int
    device: torch.device
    out: Path
    timings: dict = field(default_factory=dict)
    committer: "committers.Committer | None" = None  # a warm pool's background commits (resources.async_checkpoint)

    @property
    def iteration(self):
        return self.job.iteration

    def input(self, name: str) -> Path:
        """Local folder of a committed input stage, checksums verified (once per node). An input still committing
        in this pool's background: in a local store, its folder once its files are written (this pool wrote them,
        and its commit digests them); in a remote one, after its commit."""
        key = self.job.inputs[name]
        if name in self.job.pending_inputs:
            folder = self.store.local_path(key)
            self.committer.wait(key, written=folder is not None)
            if folder is not None:
                return folder
        manifest = self.store.read_manifest(key)  # on every rank: each raises, none waits in the barrier below
        if manifest is not None and (gone := retention.needed_pruned(self.job.stage, name, manifest)):
            raise self.store.pruned_error(key, gone)
        cache = Path(self.job.scratch) / "inputs" / name
        path = None
        if self.local_rank == 0:
            path = self.store.materialize(key, cache)
        if self.world > 1:
            dist.barrier()
        return path if path is not None else self.store.local_path(key) or cache

    def identity(self, name: str | None = None) -> tuple:
        """Which committed checkpoint an input (or, with no name, this stage's output) is, plus the blueprint
        sections that shape its modules: the key of verlflow.core.stages.modelcache."""
        shape = self.bp.section_hash("model", "fsdp", "algorithm.use_remove_padding", "algorithm.adv_estimator")
        if name is None:
            return self.job.output, self.job.manifest.key, shape
        return self.job.inputs[name], self.job.input_manifests[name].key, shape

    def input_manifest(self, name: str) -> InputRecord:
        return self.job.input_manifests[name]

    def background(self):
        """The pool's committer when this stage may write its checkpoint in the background, else None."""
        return self.committer if self.bp.resources.async_checkpoint else None

    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def placement(self) -> Placement:
        return Placement(self.rank, self.world, self.device)

    def timed(self, name: str):
        return _Timer(self.timings, name)


class _Timer:
    def __init__(self, into: dict, name: str):
        self.into, self.name = into, name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.into[self.name] = round(self.into.get(self.name, 0.0) + time.perf_counter() - self.t0, 4)


def setup_logging(rank: int) -> None:
    import warnings

    # DCP's single-process load (the inference copy, the HF export) warns on every call; it is intended here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    # verl calls logging.basicConfig on import; force our format. The rank is not in it: the launcher prefixes
    # every line of a rank with `[rankN]` already (core/orchestrate/launcher.py), and core/orchestrate/logsink.py reads this format.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True, stream=sys.stdout)


def env_summary() -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "host": platform.node(), "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    try:
        from importlib.metadata import version

        info["verl"] = version("verl")
    except Exception:  # verl metadata missing is reported by validate, not here
        info["verl"] = None
    return info


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


def _commit(ctx: StageContext, metrics: dict, t_start: float, group=None) -> dict | None:
    """Digest (and upload, for remote stores) what this node wrote; rank 0 writes the manifest last."""
    local_store = ctx.store.local_path(ctx.job.output) is not None
    files: dict = {}
    writer = ctx.rank == 0 if local_store else ctx.local_rank == 0
    if writer:
        rels = sorted(p.relative_to(ctx.out).as_posix() for p in ctx.out.rglob("*") if p.is_file())
        files = digest_files(ctx.out, rels, stamp=local_store)
        if not local_store:
            ctx.store.upload_dir(ctx.out, ctx.job.output)
    if ctx.world > 1:
        gathered = [None] * ctx.world
        dist.all_gather_object(gathered, files, group=group)
        files = {k: v for part in gathered if part for k, v in part.items()}
    if ctx.rank == 0:
        manifest = ctx.job.manifest.model_dump()
        manifest.update(
            metrics=metrics,
            timings={"stage_s": round(time.time() - t_start, 3), **ctx.timings},
            env=env_summary(),
            world_size=ctx.world,
        )
        manifest = ctx.store.commit(ctx.job.output, manifest, files)
        log.info("committed %s (%d files)", ctx.store.uri(ctx.job.output), len(files))
        return manifest
    return None


def stage_main(run: Callable[[StageContext], dict],
               after_commit: Callable[[StageContext, dict], None] | None = None) -> Callable[[], None]:
    """The torchrun entry point of a stage module: one job (sys.argv[1]) in a fresh process group."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from verlflow.core.orchestrate.launcher import run_and_exit, worker_guard

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

    main.run, main.after_commit = run, after_commit  # what the warm pool (verlflow.core.stages.pool) calls per job
    return main


def run_job(job_file: Path, run: Callable[[StageContext], dict],
            after_commit: Callable[[StageContext, dict], None] | None = None,
            in_pool: bool = False, pool_ready_at: float | None = None) -> dict | None:
    """One stage job on every rank: its outputs, then (rank 0) the manifest. The process group is made on the
    first job and kept, so a warm pool runs job after job in the same processes.

    In a warm pool the commit goes to the background when the stage left writes running or earlier commits are
    still queued (commits keep their order); the return value then says so, with the manifest to come. The pool's
    first job gets `pool_ready_at` (when its ranks had started and imported), so the pool's start-up is its own
    timing, not the stage's."""
    t_start = time.time()
    job = JobSpec.read(job_file)
    rank, world, local_rank, device = _init_process_group(job.blueprint)
    bp = memplan.resolved(job.blueprint, device)  # its `auto` settings, by the memory plan for this card
    committer = committers.for_pool(collective_timeout(bp)) if in_pool else None
    setup_logging(rank)
    _seed(bp, job.iteration, rank)
    store = ArtifactStore(bp.storage.uri, endpoint_url=bp.storage.endpoint_url, region=bp.storage.region)
    out = store.local_path(job.output)
    if out is None:  # remote store: write on local disk, upload at commit
        out = Path(job.scratch) / "out"
        if local_rank == 0:
            shutil.rmtree(out, ignore_errors=True)
    if world > 1:
        dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(job, bp, store, rank, world, local_rank, device, out, committer=committer,
                       timings=_launch_timings(job, t_start, pool_ready_at))
    faults.hang_point(job.stage, rank)  # test hook: VERLFLOW_FAULT=hang_in_<stage>, barrier_hang_in_<stage>
    modelcache.begin_job()
    compiles = compiletime.Meter()
    with _no_space_named(ctx), memplan.watched(ctx) as memory:  # an OOM names the stage, peak, card and setting
        metrics = run(ctx) or {}
    metrics.update(memory.metrics)
    n, seconds, parts = compiles.read()
    if n:  # a first iteration's excess: how much of it was torch.compile (its other timings include it)
        ctx.timings["compile_s"] = round(seconds, 3)
        metrics["compiles"] = n
        log.info("%s: %d torch.compile runs took %.1f s (%s)", job.name, n, seconds, parts)
    if hits := modelcache.hits():
        metrics["warm_cache_hits"] = hits
    # Whether a commit is still running is a per-rank fact (one rank's committer thread may lag under load); the
    # path taken decides which group's collectives follow, so every rank must take the same one.
    if committer is not None and any_rank(committer.pending()):
        t_end = time.time()
        ctx.timings.update(stage_s=round(t_end - t_start, 3))

        def commit() -> None:
            faults.kill_point("commit", ctx.rank)  # test hook: a crash while a commit is in flight
            # how long the writes (and earlier commits) ran on after the stage returned
            ctx.timings["background_s"] = round(time.time() - t_end, 3)
            _commit_and_after(ctx, metrics, t_start, after_commit, committer.group)
            if ctx.local_rank == 0:
                shutil.rmtree(job.scratch, ignore_errors=True)  # the runner left it to us (its remote out/)

        committer.submit(job.output, job.name, commit, where=_where(ctx))
        return {"pending": True, "manifest": {**job.manifest.model_dump(), "metrics": metrics, "timings": ctx.timings,
                                              "world_size": world}}
    with _no_space_named(ctx):
        _commit_and_after(ctx, metrics, t_start, after_commit)
    return None


def _where(ctx: StageContext) -> str:
    return ctx.store.uri(ctx.job.output) if ctx.store.local_path(ctx.job.output) else f"scratch {ctx.out}"


@contextmanager
def _no_space_named(ctx: StageContext):
    """A full filesystem is the user's to fix: say so with the stage and the place, not a writer's traceback (the
    runner removes the partial output)."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not is_no_space(e):
            raise
        raise StoreError(f"no space left on device: {ctx.job.name} could not write its "
                         f"files to {_where(ctx)}; {NO_SPACE_FIX}") from e


def _launch_timings(job: JobSpec, t_start: float, pool_ready_at: float | None) -> dict:
    """From the runner's launch to this worker's start: a fresh job's spawn and imports, a warm job's hand-over;
    a pool's first job has the pool's own start-up apart."""
    launched = job.launched_at
    if pool_ready_at is None:
        return {"launch_to_worker_s": round(t_start - launched, 3)}
    return {"pool_start_s": round(max(0.0, pool_ready_at - launched), 3),
            "launch_to_worker_s": round(t_start - max(pool_ready_at, launched), 3)}


def _commit_and_after(ctx: StageContext, metrics: dict, t_start: float, after_commit, group=None) -> None:
    """Once every rank's files are written: the commit, then (rank 0) after_commit, then every rank past it. In
    the main thread on the default group, or on the committer's thread and group."""
    if ctx.world > 1:
        dist.barrier(group=group)
    manifest = _commit(ctx, metrics, t_start, group=group)
    if after_commit is not None and ctx.rank == 0:
        after_commit(ctx, manifest)
    if ctx.world > 1:
        dist.barrier(group=group)


def retention_pass(ctx: StageContext, manifest: dict | None = None) -> None:
    """Prune what the run no longer keeps, now that this stage is committed (an after_commit: store operations
    only, it may run on a warm pool's committer thread)."""
    head = ctx.iteration if isinstance(ctx.iteration, int) else None  # a phase's epoch is no rl iteration
    retention.retain(ctx.store, ctx.bp, ctx.job.run_id, head=head, reads=ctx.job.checkpoint_reads,
                     between=lambda: faults.kill_point("prune", ctx.rank))  # test hook: a crash mid-prune


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="verlflow-"))
