"""A stage's writes and its commit: now, or (a warm pool) behind the pool's earlier commits on its committer thread.

`ctx.write` (Writes) takes a stage's file writes: run at once, or, in a warm pool with resources.async_checkpoint,
queued for the stage's commit, which runs them before the manifest (verlflow.core.stages.runtime.committer). After
`run(ctx)` returns, `finish` commits: every rank digests (and, for a remote store, uploads) what its node wrote,
rank 0 writes the manifest last, then the stage's after_commit runs. The commit goes to the background when a write
or an earlier commit is still running on some rank; the driver is then told the manifest to come.
"""

import logging
import platform
import shutil
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from verlflow.core import faults
from verlflow.core.agree import any_rank
from verlflow.core.errors import NO_SPACE_FIX, StoreError, is_no_space
from verlflow.core.ml import dcpio
from verlflow.core.stages.runtime.committer import Committer
from verlflow.core.store.digests import digest_files

if TYPE_CHECKING:
    from verlflow.core.stages.runtime.context import StageContext

log = logging.getLogger("verlflow.stage")


class Writes:
    """ctx.write: `ctx.write(fn)` runs the write `fn` now, or hands it to the stage's background commit (which runs
    it before the manifest); `checkpoint.save(..., ctx.write)` writes a state dict now, or copies it to CPU memory
    for that commit to write. The choice is the runtime's, the same for every write of a job."""

    def __init__(self, committer: Committer | None, background: bool):
        self.committer = committer  # a warm pool's commit queue (None in a job of its own)
        self._committer = committer if background else None  # where the writes go (resources.async_checkpoint)
        self.written = threading.Event()  # every write of the stage ran: a model one reads may be refilled
        if self._committer is None:
            self.written.set()  # each ran when it was handed over, before a later stage could start

    def __call__(self, write: Callable[[], object]) -> None:
        if self._committer is None:
            write()
        else:
            self._committer.add_write(write)

    def save(self, state_dict: dict, checkpoint_id: str, role: str) -> str:
        """A DCP state dict: "inline", or how its CPU copy came ("made", "reserved", "refilled": Committer.save)."""
        if self._committer is None:
            dcpio.save(state_dict, checkpoint_id)
            return "inline"
        return self._committer.save(state_dict, checkpoint_id, role)

    def reserve(self, role: str, nbytes: Callable[[], int]) -> None:
        """Start making the CPU copy of `role`'s first background save now (nothing when writes run inline)."""
        if self._committer is not None:
            self._committer.reserve(role, nbytes())


def finish(ctx: "StageContext", metrics: dict, t_start: float,
           after_commit: Callable[["StageContext", dict], None] | None) -> dict | None:
    """Commit the stage. Returns None once it is committed, or, when the commit went to the pool's background,
    what the driver is told: {"pending": True, "manifest": the manifest to come (key, metrics, timings)}."""
    committer = ctx.write.committer
    ctx.timings["started_at"] = round(t_start, 3)  # wall clock: which stages overlapped (rollout.async's lanes)
    # Whether a commit is still running is a per-rank fact (one rank's committer thread may lag under load); the
    # path taken decides which group's collectives follow, so every rank must take the same one.
    if committer is None or not any_rank(committer.pending()):
        ctx.write.written.set()  # none was queued
        with no_space_named(ctx):
            _commit_and_after(ctx, metrics, t_start, after_commit)
        return None
    t_end = time.time()
    ctx.timings.update(stage_s=round(t_end - t_start, 3))

    def commit() -> None:
        faults.kill_point("commit", ctx.rank)  # a crash while a commit is in flight
        # how long the writes (and earlier commits) ran on after the stage returned
        ctx.timings["background_s"] = round(time.time() - t_end, 3)
        _commit_and_after(ctx, metrics, t_start, after_commit, committer.group)
        if ctx.local_rank == 0:
            shutil.rmtree(ctx.job.scratch, ignore_errors=True)  # the runner left it to us (its remote out/)

    committer.submit(ctx.job.output, ctx.job.name, commit, where=where(ctx), written=ctx.write.written)
    return {"pending": True, "manifest": {**ctx.job.manifest.model_dump(), "metrics": metrics,
                                          "timings": ctx.timings, "world_size": ctx.world}}


def _commit_and_after(ctx: "StageContext", metrics: dict, t_start: float, after_commit, group=None) -> None:
    """Once every rank's files are written: the commit, then (rank 0) after_commit, then every rank past it. In
    the main thread on the default group, or on the committer's thread and group."""
    if ctx.world > 1:
        dist.barrier(group=group)
    manifest = _commit(ctx, metrics, t_start, group=group)
    if after_commit is not None and ctx.rank == 0:
        after_commit(ctx, manifest)
    if ctx.world > 1:
        dist.barrier(group=group)


def _commit(ctx: "StageContext", metrics: dict, t_start: float, group=None) -> dict | None:
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


def where(ctx: "StageContext") -> str:
    return ctx.store.uri(ctx.job.output) if ctx.store.local_path(ctx.job.output) else f"scratch {ctx.out}"


@contextmanager
def no_space_named(ctx: "StageContext"):
    """A full filesystem is the user's to fix: say so with the stage and the place, not a writer's traceback (the
    runner removes the partial output)."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not is_no_space(e):
            raise
        raise StoreError(f"no space left on device: {ctx.job.name} could not write its "
                         f"files to {where(ctx)}; {NO_SPACE_FIX}") from e


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
