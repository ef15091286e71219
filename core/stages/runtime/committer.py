"""Background commits in a warm pool (resources.async_checkpoint): a stage's checkpoint is written, digested and
committed while the pool runs the next stages.

Per rank, one thread takes commits in the order the stages ran: it first runs the stage's background writes (a
dcp.save of the CPU copy that save() made), then the stage's ordinary commit (digest, upload, manifest written
last). A commit never
overtakes an earlier one, so a stage's manifest is never visible before its inputs' are; a crash before a commit
leaves that stage (and every later one) uncommitted, as a crash in a fresh job would. After a failed commit the
queue stops: the pool's next job, or its close, raises it.

The background collectives (DCP's save plan, the commit's gather) use their own gloo group, so they never
interleave with the running stage's collectives on the default group.

What the committer's thread logs starts with `[background <stage>[<iteration>]]`: the driver
(verlflow.core.orchestrate.pool) shows those lines in that stage's log, not in the log of the stage running
meanwhile. A stage never sees the committer: it hands its writes to ctx.write (verlflow.core.stages.runtime.commit).
"""

import logging
import queue
import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from verlflow.core.errors import NO_SPACE_FIX, StoreError, is_no_space
from verlflow.core.ml import dcpio

log = logging.getLogger("verlflow.committer")


class CommitFailed(RuntimeError):
    pass


class Committer:
    def __init__(self, timeout: timedelta):
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._queue: queue.Queue = queue.Queue()
        self._done: dict[str, threading.Event] = {}
        self._written: dict[str, threading.Event] = {}  # its files are all on disk (its commit may still be queued)
        self._staged: dict[str, dcpio.CpuCopy] = {}  # role -> its CPU copy, refilled by each save after the 1st
        self._reserved: dict[str, Future] = {}  # role -> a slab made ahead of its first save (reserve())
        self._writes: list[Callable[[], object]] = []  # this stage's writes, handed to its commit
        self.error: BaseException | None = None
        self._failed_stage: str | None = None
        self._current: str | None = None  # the stage whose commit the thread is running
        thread = threading.Thread(target=self._serve, name="verlflow-committer", daemon=True)
        thread.start()
        _tag_records(thread, lambda: self._current)

    def reserve(self, role: str, nbytes: int) -> None:
        """Start making `role`'s slab now, in a thread, ahead of its first save, which then only fills it (a warm
        pool's build reserves the first update's: the page-locking, 1.7 s for 19.5 GB, runs beside the first
        rollout instead of inside the update)."""
        if role not in self._staged and role not in self._reserved:
            self._reserved[role] = _in_thread(lambda: dcpio.make_slab(nbytes, pin=torch.cuda.is_available()))

    def save(self, state_dict: dict, checkpoint_id: str, role: str) -> str:
        """Copy `state_dict` into this role's CPU copy now; the next submit()'s commit writes it with DCP first.
        Returns how the copy came: "refilled" (the role's earlier one), "reserved" (made from the slab reserve()
        started), or "made" (here, on the role's first save).

        The copy lives in one slab of CPU memory kept for the pool's life (pinned on CUDA; verlflow.core.ml.dcpio.
        CpuCopy); the write is a multi-threaded dcp.save of that copy on the committer's thread and group. (DCP's
        async_save stager failed on its second call with FSDP2 DTensors on torch 2.11.) Making a copy costs less
        than writing the state inline (19.5 GB on an H200 host: 1.8 s to make, 0.35 s to fill, against 5.7 s to
        write to a RAM disk and 12 s to a local disk), so even a role's first save is written in the background."""
        self.drain()  # earlier writes are done with the CPU copies
        copy, how = self._staged.get(role), "refilled"
        if copy is not None and not copy.fits(state_dict):
            del self._staged[role]  # the old slab is freed before a new one is made
            copy = None
        if copy is None and role in self._reserved:
            copy, how = self._from_reserved(role, state_dict), "reserved"
        if copy is None:
            copy, how = dcpio.CpuCopy(state_dict, pin=torch.cuda.is_available()), "made"
        self._staged[role] = copy
        staged = copy.copy_from(state_dict)
        self._writes.append(lambda: dcpio.save(staged, checkpoint_id, process_group=self.group, device=copy.device))
        return how

    def cpu_copy(self, role: str) -> dcpio.CpuCopy | None:
        """This role's CPU copy (None before the role's first save)."""
        return self._staged.get(role)

    def _from_reserved(self, role: str, state_dict: dict) -> dcpio.CpuCopy | None:
        slab = self._reserved.pop(role).result()  # a failed pinning raises here, as making the copy would
        need = dcpio.copy_bytes(state_dict)
        if slab.numel() < need:
            log.info("the %.2f GB reserved for %s's copy is short of its %.2f GB: made anew", slab.numel() / 1e9,
                     role, need / 1e9)
            return None
        return dcpio.CpuCopy(state_dict, pin=torch.cuda.is_available(), slab=slab)

    def add_write(self, write: Callable[[], object]) -> None:
        """A write of the running stage's own (e.g. an HF export of a CPU copy the stage made): the stage's commit
        runs it first, on the committer's thread, after the writes save() queued. The committer lets go of `write`
        once it ran, so what it holds (a model-sized copy) is freed then, not at the next commit."""
        held = [write]
        self._writes.append(lambda: held.pop()())

    def submit(self, output: str, name: str, commit: Callable[[], None], where: str,
               written: threading.Event | None = None) -> None:
        """Queue a stage's commit behind the earlier ones; it runs once the stage's writes are done (`written` is
        set then). `name` (`update[3]`) tags its log lines; it and `where` (the place it writes) name it in errors."""
        self.check()
        writes, self._writes = self._writes, []
        self._done[output], self._written[output] = threading.Event(), written or threading.Event()
        if not writes:
            self._written[output].set()
        self._queue.put((output, name, writes, commit, where))

    def pending(self) -> bool:
        """Whether a write or an earlier commit is still in the making (a new commit then queues behind it)."""
        return bool(self._writes) or any(not e.is_set() for e in self._done.values())

    def wait(self, output: str, *, written: bool = False) -> None:
        """Until `output`'s commit (submitted earlier on this rank) is done, or with `written` only its files;
        raises if the queue failed."""
        event = (self._written if written else self._done).get(output)
        while event is not None and not event.wait(0.05):
            self.check()
        self.check()

    def drain(self) -> None:
        for output in list(self._done):
            self.wait(output)

    def check(self) -> None:
        if self.error is not None and is_no_space(self.error):
            raise StoreError(f"no space left on device: the background commit of {self._failed_stage} could not "
                             f"write its files to {self._failed_where}; {NO_SPACE_FIX}") from self.error
        if self.error is not None:
            raise CommitFailed(f"the background commit of {self._failed_stage} failed: "
                               f"{type(self.error).__name__}: {self.error}") from self.error

    def _serve(self) -> None:
        while True:
            output, name, writes, commit, where = self._queue.get()
            self._current = name
            if self.error is None:
                try:
                    for write in writes:
                        write()
                    self._written[output].set()
                    commit()
                except BaseException as e:  # noqa: BLE001 - raised in the pool's main thread by check()
                    self.error, self._failed_stage, self._failed_where = e, name, where
            if self.error is None:
                self._done[output].set()


def _in_thread(make: Callable[[], object]) -> Future:
    """`make()`'s result as a Future, made on a thread of its own; its exception is raised by the Future's
    result()."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(make())
        except BaseException as e:  # noqa: BLE001 - raised by whoever takes the result
            done.set_exception(e)

    threading.Thread(target=run, name="verlflow-cpu-slab", daemon=True).start()
    return done


def _tag_records(thread: threading.Thread, current: Callable[[], str | None]) -> None:
    """Log records made on `thread` start with the tag of the stage it commits."""
    make = logging.getLogRecordFactory()

    def tagged(*args, **kwargs):
        record = make(*args, **kwargs)
        name = current() if record.thread == thread.ident else None
        if name is not None and isinstance(record.msg, str):
            record.msg = f"[background {name}] {record.msg}"
        return record

    logging.setLogRecordFactory(tagged)


_POOL_COMMITTER: Committer | None = None


def for_pool(timeout: timedelta) -> Committer:
    """The pool's committer, made by every rank at the same point (its first job, after the process group)."""
    global _POOL_COMMITTER
    if _POOL_COMMITTER is None:
        _POOL_COMMITTER = Committer(timeout)
    return _POOL_COMMITTER


def drain_pool() -> None:
    """At the pool's stop: every queued commit done, or its error raised."""
    if _POOL_COMMITTER is not None:
        _POOL_COMMITTER.drain()
