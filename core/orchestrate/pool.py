"""Warm worker pools (resources.warm_workers): one torchrun job per (node, ranks, device) kept alive across the
stages of a pipeline, so a stage costs its work, not a spawn plus torch/transformers/verl imports.

Stages still run one at a time, each still commits its own artifact with a manifest, and a failed stage still
fails exactly as a fresh job would: any exception ends the pool (torchrun's diagnosis reaches the caller) and
the next stage starts a new one. A cancel or a stage timeout kills the pool's whole process tree.

A stage whose commit goes on in the pool's background (resources.async_checkpoint) is `Committing` here, and only
here: its manifest to come, which a later stage's job waits for (or, in the same pool, its job does), and which
`resolve()` reads once the pools have closed.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from verlflow.core.orchestrate.launcher import FailureKind, LaunchSpec, StageFailure, launch
from verlflow.core.stagespec import POOL
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.wait import wait_until

_BACKGROUND = re.compile(r"\[background (\S+)\] ")  # verlflow.core.stages.runtime.committer's tag


@dataclass(frozen=True)
class Committing:
    """A stage job's commit as the driver follows it: where it commits, and, once the job returned while the pool
    goes on committing it, the manifest to come (its key and metrics are known; it says `pending`) and the pool."""
    name: str  # `update[3]`: what the committer's lines for it start with
    out: str  # its store path
    store: ArtifactStore
    scratch: Path  # its job's folder (a remote store's output is staged there)
    on_line: Callable[[str], None]  # its own log: the lines of its commit go there
    manifest: dict | None = None
    pool: "WarmPool | None" = None

    def landed(self) -> bool:
        return (self.store.read_manifest(self.out) or {}).get("key") == self.manifest["key"]

    def wait(self, reader: str, on_line: Callable[[str], None], cancel: threading.Event | None) -> None:
        """Until it landed, for the input `reader` of a job in another pool; fails if its pool exits first."""
        uri = self.store.uri(self.out)
        on_line(f"[verlflow] waiting for {uri} ({reader}) to be committed by the warm pool")

        def landed() -> bool:
            if self.landed():
                return True
            if not self.pool.alive:
                raise StageFailure(FailureKind.UNKNOWN, f"input '{reader}' ({uri}) was never committed: the warm "
                                   f"worker pool committing it exited ({self.pool.error})")
            return False

        def cancelled():
            raise StageFailure(FailureKind.CANCELLED, f"cancelled while waiting for {uri}")

        wait_until(landed, interval_s=0.2, cancel=cancel, on_cancel=cancelled)

    def resolve(self) -> dict:
        """The committed manifest, once the pools have closed (then every commit landed, or warm_pools raised)."""
        return self.store.read_manifest(self.out)

    def discard(self) -> None:
        """After the pool: its scratch folder, and what it left in the store if its commit did not land."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        if not self.landed():
            try:
                self.store.rm(self.out)  # a failed stage leaves nothing behind (a full disk: its partial files)
            except Exception:  # noqa: BLE001 - e.g. S3 down: it has no manifest, nothing reads it, a rerun replaces it
                pass


class WarmPool:
    """One pool: `run` a stage job in it (it must have been acquired from its WarmPools, and is free again after
    the job), `close` when the loop ends."""

    def __init__(self, nproc: int, env: dict, scratch: str | None, on_line: Callable[[str], None], *,
                 commit_timeout_s: float = 1800.0, held: contextlib.ExitStack | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="verlflow-pool-", dir=scratch))
        self.nproc, self.n = nproc, 0
        self.commit_timeout_s = commit_timeout_s  # how long close() waits for background commits (the stage timeout)
        self._busy = threading.Lock()
        self._sink = on_line
        self._kill = threading.Event()
        self._expire = threading.Event()  # a stage's timeout: the launch prints every rank's stack, then kills
        self._gone = threading.Event()
        self.error: BaseException | None = None
        self.started = False
        self._held = held or contextlib.ExitStack()  # GPU claims held for the pool's life
        # Stages whose commit runs in the pool's background (resources.async_checkpoint), by store path.
        self._committing: dict[str, Committing] = {}
        self.spec = LaunchSpec(module=POOL, args=[str(self.dir)], nproc_per_node=nproc, nnodes=1,
                               timeout_s=None, env={**env, "VERLFLOW_WARM_POOL": "1"}, log_dir=str(self.dir / "logs"))

    def start(self) -> "WarmPool":
        self.started = True
        threading.Thread(target=self._serve, name=f"verlflow-pool-{self.nproc}", daemon=True).start()
        return self

    def _serve(self) -> None:
        try:
            launch(self.spec, on_line=self._route, cancel=self._kill, expire=self._expire)
        except BaseException as e:  # noqa: BLE001 - handed to the stage that was running
            self.error = e
        finally:
            self._gone.set()

    def _route(self, line: str) -> None:
        """A background commit's line to the log of the stage it commits, any other to the running stage's."""
        m = _BACKGROUND.search(line)
        owner = next((c for c in self._committing.values() if c.name == m[1]), None) if m else None
        (owner.on_line if owner is not None else self._sink)(line)

    @property
    def alive(self) -> bool:
        return not self._gone.is_set()

    def run(self, stage: str, job_file: Path, commit: Committing, *, cancel: threading.Event | None,
            timeout_s: float | None) -> Committing | None:
        """Run one stage job in the pool, which is then free for the next; raises what a fresh launch would
        (StageFailure). Returns None once the stage is committed, or `commit` with its manifest to come while the
        pool goes on committing it."""
        try:
            done = self._run(stage, job_file, on_line=commit.on_line, cancel=cancel, timeout_s=timeout_s)
        finally:
            self._busy.release()
        if not done.get("pending"):
            return None
        later = replace(commit, manifest={**done["manifest"], "pending": True}, pool=self)
        self._committing[later.out] = later
        return later

    def _run(self, stage: str, job_file: Path, *, on_line: Callable[[str], None], cancel: threading.Event | None,
             timeout_s: float | None) -> dict:
        self._sink = on_line
        self.n += 1
        if self.n == 1:  # the wait for the ranks' start is otherwise a silent one
            on_line(f"[verlflow] starting {self.nproc} warm worker(s) for {stage} and the stages after it: each "
                    "imports torch, transformers and verl first (15-40 s on 2 CPU cores)...")
        self._send({"stage": stage, "job": str(job_file)})
        done = self.dir / f"done-{self.n}.json"

        def finished() -> bool:
            if done.exists():
                return True
            if not self._gone.is_set() or done.exists():
                return False
            if isinstance(self.error, StageFailure):
                raise self.error
            raise StageFailure(FailureKind.UNKNOWN, f"{stage}: the warm worker pool exited without finishing it"
                               + (f" ({self.error})" if self.error else ""))

        def cancelled():
            self.kill()
            raise StageFailure(FailureKind.CANCELLED, f"{stage} was cancelled; its warm worker pool was killed")

        def expired():
            self._expire.set()
            self._gone.wait(60)
            stacks = self.error.traceback if isinstance(self.error, StageFailure) else ""
            raise StageFailure(FailureKind.TIMEOUT, f"{stage} ran past its timeout of {timeout_s:g} s "
                               "(resources.stage_timeout_s); its warm worker pool was killed", traceback=stacks)

        try:
            wait_until(finished, interval_s=0.02, timeout_s=timeout_s, cancel=cancel, on_cancel=cancelled,
                       on_timeout=expired)
        except BaseException as e:
            if not isinstance(e, Exception):  # Prefect's SIGTERM on a Cancel: the ranks die first, at once
                self.kill()
            raise
        return json.loads(done.read_text())

    def committing(self, output: str) -> Committing | None:
        """`output`'s commit, while this live pool runs it in its background; else None."""
        return self._committing.get(output) if self.alive else None

    def _send(self, msg: dict) -> None:
        tmp = self.dir / f".job-{self.n}.json"
        tmp.write_text(json.dumps(msg))
        os.replace(tmp, self.dir / f"job-{self.n}.json")  # ranks see the whole message or none of it

    def kill(self) -> None:
        self._kill.set()
        self._gone.wait(60)

    def close(self, grace_s: float = 30.0) -> list[str]:
        """Stop the pool once its background commits are done (they may take a checkpoint's write time); returns
        the stages whose commit did not land (`error` says why)."""
        if self.started and self.alive:
            self.n += 1
            self._send({"stop": True})
            if not self._gone.wait(grace_s + (self.commit_timeout_s if self._committing else 0)):
                self.kill()
        self._held.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        lost = [out for out, c in self._committing.items() if not c.landed()]
        for c in self._committing.values():  # the pool is gone: no commit is still writing
            c.discard()
        return lost


class WarmPools:
    """The warm pools of one pipeline loop, one per (ranks, device, scratch) key, made by `warm_pools()`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pools: dict[tuple, WarmPool] = {}
        self._open = True

    def acquire(self, key: tuple, make: Callable[[], WarmPool]) -> WarmPool | None:
        """The live, idle pool for `key` (started with `make` if none), locked for one job (`WarmPool.run` frees
        it); None once the loop's block ended or while the pool is busy with another job (the caller then
        launches a fresh job).

        `make` may wait for GPUs: it runs outside the registry lock, so pools of other keys can be used and closed
        meanwhile (the pool whose GPUs it waits for may be one of them)."""
        with self._lock:
            if not self._open:
                return None
            pool = self._pools.get(key)
            dead = pool if pool is not None and not pool.alive else None
            if dead is not None:
                del self._pools[key]
            elif pool is not None:
                return pool if pool._busy.acquire(blocking=False) else None
        if dead is not None:
            dead.close()
        made = make()
        with self._lock:
            if self._open and key not in self._pools:
                self._pools[key] = made.start()
                made._busy.acquire()
                return made
        # The block ended, or another thread registered a pool for this key while we waited: ours never started.
        made.close()
        return None

    def committing(self, output: str) -> Committing | None:
        """`output`'s commit, while a live pool runs it in its background; else None."""
        with self._lock:
            return next((c for pool in self._pools.values() if (c := pool.committing(output)) is not None), None)

    def await_inputs(self, inputs: dict[str, str], pool: WarmPool | None, on_line: Callable[[str], None],
                     cancel: threading.Event | None) -> list[str]:
        """Wait until the inputs that another pool commits in its background have landed. Returns the names of
        those that `pool` (the job's own) still commits: its job waits for them where it reads their files."""
        own = []
        for name, skey in inputs.items():
            later = self.committing(skey)
            if later is None or later.landed():
                continue
            if later.pool is pool:
                own.append(name)
            else:
                later.wait(name, on_line, cancel)
        return own

    def close(self, abandon: bool) -> list[tuple[str, BaseException | None]]:
        """Close every pool (abandon: kill it first); the stages whose background commit did not land, each with
        its pool's error."""
        with self._lock:
            self._open, closing = False, list(self._pools.values())
            self._pools.clear()
        lost: list[tuple[str, BaseException | None]] = []
        for pool in closing:
            if abandon:  # no waiting for a stop message a hung pool would never read, nor for its commits
                pool.kill()
            lost += [(name, pool.error) for name in pool.close()]
        return lost


@contextlib.contextmanager
def warm_pools() -> Iterator[WarmPools]:
    """The pools that stages whose blueprint sets resources.warm_workers share within this block; all close at
    exit. A background commit that did not land fails the block (when nothing else did)."""
    pools = WarmPools()
    abandon = False
    try:
        yield pools
    except BaseException as e:
        abandon = _abandons(e)
        raise
    finally:
        lost = pools.close(abandon)
    if lost:
        raise _not_landed(lost)


def _not_landed(lost: list[tuple[str, BaseException | None]]) -> StageFailure:
    """The failure of a block whose stages all returned but some background commits did not land: of the kind
    the pool failed with (a full disk is the user's to fix, and no retry helps), its cause said once."""
    cause = next((e for _, e in lost if e is not None), None)
    known = isinstance(cause, StageFailure)
    why = f": {cause.summary if known else cause}" if cause is not None else ""
    return StageFailure(cause.kind if known else FailureKind.UNKNOWN,
                        f"the warm worker pool's background commit did not land for {', '.join(n for n, _ in lost)}"
                        f"{why}; those stages are not committed, and a rerun runs them again",
                        traceback=cause.traceback if known else "")


def _abandons(exc: BaseException) -> bool:
    """Whether the run is being stopped (Cancel, Ctrl-C, SIGTERM: Prefect raises a BaseException), not merely failed:
    then the pools die at once. The runner that sent SIGTERM kills this process 30 s later anyway (Prefect's
    grace), leaving the ranks to die only with it."""
    return not isinstance(exc, Exception) or (isinstance(exc, StageFailure) and exc.kind is FailureKind.CANCELLED)
