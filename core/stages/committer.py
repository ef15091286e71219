"""Background commits in a warm pool (resources.async_checkpoint): a stage's checkpoint is written, digested and
committed while the pool runs the next stages.

Per rank, one thread takes commits in the order the stages ran: it waits for the stage's background writes (DCP
async saves), then runs the stage's ordinary commit (digest, upload, manifest written last). A commit never
overtakes an earlier one, so a stage's manifest is never visible before its inputs' are; a crash before a commit
leaves that stage (and every later one) uncommitted, as a crash in a fresh job would. After a failed commit the
queue stops: the pool's next job, or its close, raises it.

The background collectives (DCP's save plan, the commit's gather) use their own gloo group, so they never
interleave with the running stage's collectives on the default group.
"""

import queue
import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


class CommitFailed(RuntimeError):
    pass


class Committer:
    def __init__(self, timeout_s: float):
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._queue: queue.Queue = queue.Queue()
        self._done: dict[str, threading.Event] = {}
        self._stagers: dict[str, object] = {}
        self._inflight: list[Future] = []  # this stage's DCP writes, not yet handed to a commit
        self.error: BaseException | None = None
        self._failed_stage: str | None = None
        threading.Thread(target=self._serve, name="verlflow-committer", daemon=True).start()

    def save(self, state_dict: dict, checkpoint_id: str, role: str) -> None:
        """DCP async_save: copies `state_dict` to CPU before returning, writes it in a DCP thread. The next
        submit()'s commit waits for the write."""
        import torch.distributed.checkpoint as dcp

        # One background collective at a time on self.group, and one save per role in flight (its staging
        # buffers are reused): wait for every earlier write and commit first.
        self.drain()
        self._inflight.append(dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.group,
                                             async_stager=self._stager(role)))

    def _stager(self, role: str):
        """One staging area per checkpointed role, kept for the pool's life: its (pinned, on CUDA) CPU buffers are
        reused by the next save instead of allocated again."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if role not in self._stagers:
            cuda = torch.cuda.is_available()
            self._stagers[role] = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                               use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stagers[role]

    def submit(self, output: str, name: str, commit: Callable[[], None]) -> None:
        """Queue a stage's commit behind the earlier ones; it runs once the stage's writes are done."""
        self.check()
        writes, self._inflight = self._inflight, []
        self._done[output] = threading.Event()
        self._queue.put((output, name, writes, commit))

    def pending(self) -> bool:
        """Whether a write or an earlier commit is still running (a new commit must then queue behind it)."""
        return bool(self._inflight) or any(not e.is_set() for e in self._done.values())

    def wait(self, output: str) -> None:
        """Until `output`'s commit (submitted earlier on this rank) is done; raises if the queue failed."""
        event = self._done.get(output)
        while event is not None and not event.wait(0.05):
            self.check()
        self.check()

    def drain(self) -> None:
        for f in self._inflight:
            f.result()
        for output in list(self._done):
            self.wait(output)

    def check(self) -> None:
        if self.error is not None:
            raise CommitFailed(f"the background commit of {self._failed_stage} failed: "
                               f"{type(self.error).__name__}: {self.error}") from self.error

    def _serve(self) -> None:
        while True:
            output, name, writes, commit = self._queue.get()
            if self.error is None:
                try:
                    for f in writes:
                        f.result()
                    commit()
                except BaseException as e:  # noqa: BLE001 - raised in the pool's main thread by check()
                    self.error, self._failed_stage = e, name
            if self.error is None:
                self._done[output].set()


_POOL_COMMITTER: Committer | None = None


def for_pool(timeout_s: float) -> Committer:
    """The pool's committer, made by every rank at the same point (its first job, after the process group)."""
    global _POOL_COMMITTER
    if _POOL_COMMITTER is None:
        _POOL_COMMITTER = Committer(timeout_s)
    return _POOL_COMMITTER


def drain_pool() -> None:
    """At the pool's stop: every queued commit done, or its error raised."""
    if _POOL_COMMITTER is not None:
        _POOL_COMMITTER.drain()
