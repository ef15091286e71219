"""A run's lease: at most one runner per run id at a time, recorded in the artifact store itself (so it holds across
machines and needs nothing but the store).

`leases/<run_id>.json` names its holder (host, pid and the process's start time, since, renewed, the Prefect flow
run if any, a random token). Taking it is one conditional write (verlflow.core.store.artifacts: create_exclusive / replace_if), so of
two runners exactly one wins. A lease is taken over when its holder is gone: on this host, a pid that is not
running any more, or runs another process (start time differs: the pid was reused); on another host, a lease not
renewed for VERLFLOW_LEASE_STALE_S seconds (the holder renews it every VERLFLOW_LEASE_RENEW_S from a thread); or
the same Prefect flow run (a Retry in the UI runs the same flow run again, after the previous attempt ended).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import psutil

from verlflow.core.errors import VerlflowError
from verlflow.core.store.artifacts import ArtifactStore, safe_run_id

log = logging.getLogger("verlflow.lease")


class RunBusyError(VerlflowError):
    """Another live runner holds the run's lease."""


def _seconds(var: str, default: float) -> float:
    return float(os.environ.get(var) or default)


@dataclass
class Holder:
    host: str
    pid: int
    started: float  # the process's create time (psutil): tells a reused pid from the holder
    since: float
    renewed: float
    token: str
    flow_run_id: str | None = None

    @classmethod
    def me(cls, flow_run_id: str | None) -> "Holder":
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), now, now, uuid.uuid4().hex,
                   flow_run_id)

    def describe(self) -> str:
        since = dt.datetime.fromtimestamp(self.since, dt.timezone.utc).isoformat(timespec="seconds")
        flow = f", Prefect flow run {self.flow_run_id}" if self.flow_run_id else ""
        return f"pid {self.pid} on host {self.host} since {since}{flow}"

    def gone_because(self, me: "Holder") -> str | None:
        """Why this holder no longer runs the run (so `me` may take the lease over), or None if it may."""
        if self.flow_run_id and self.flow_run_id == me.flow_run_id:
            return "it is an earlier attempt of the same Prefect flow run (a Retry)"
        if self.host == me.host:
            try:
                proc = psutil.Process(self.pid)
                alive = abs(proc.create_time() - self.started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            return None if alive else "its process is no longer running"
        idle = time.time() - self.renewed
        if idle > _seconds("VERLFLOW_LEASE_STALE_S", 120):
            return f"it was not renewed for {idle:.0f} s"
        return None


class Lease:
    def __init__(self, store: ArtifactStore, run_id: str, flow_run_id: str | None = None,
                 say: Callable[[str], None] = print):
        self.store, self.run_id, self.say = store, safe_run_id(run_id), say
        self.key = f"leases/{run_id}.json"
        self.me = Holder.me(flow_run_id)
        self.version: str | None = None

    def _bytes(self) -> bytes:
        return json.dumps(asdict(self.me), sort_keys=True).encode()

    def acquire(self) -> None:
        for _ in range(5):  # each round loses only to a runner that changed the lease meanwhile
            self.version = self.store.create_exclusive(self.key, self._bytes())
            if self.version:
                return
            current = self.store.read_versioned(self.key)
            if current is None:
                continue  # released meanwhile
            holder, version = _parse(current[0]), current[1]
            if holder is not None and holder.token == self.me.token:  # our own create, retried by the client
                self.version = version
                return
            why = "its lease file is unreadable" if holder is None else holder.gone_because(self.me)
            if why is None:
                raise RunBusyError(self._busy_message(holder))
            self.version = self.store.replace_if(self.key, self._bytes(), version)
            if self.version:
                who = "an earlier runner" if holder is None else holder.describe()
                self.say(f"[verlflow] run {self.run_id}: took over the lease of {who}: {why}")
                return
        raise RunBusyError(f"Run {self.run_id}: other runners keep taking its lease ({self.store.uri(self.key)}); "
                           "start one runner per run id.")

    def _busy_message(self, holder: Holder) -> str:
        stale = _seconds("VERLFLOW_LEASE_STALE_S", 120)
        return (f"Run {self.run_id} is already being run by {holder.describe()} (lease {self.store.uri(self.key)}); "
                "a second runner would overwrite its stages. Wait until it ends (`verlflow ls --run "
                f"{self.run_id}` shows its stages), stop it (Ctrl-C, `kill {holder.pid}` on {holder.host}, or Cancel "
                "its flow run), or start this one under another run id. A lease whose holder died is taken over "
                f"by the next runner (from another host, once it has not been renewed for {stale:.0f} s).")

    def renew(self) -> None:
        self.me.renewed = time.time()
        version = self.store.replace_if(self.key, self._bytes(), self.version)
        if version is None:
            current = self.store.read_versioned(self.key)
            other = _parse(current[0]) if current else None
            raise RunBusyError(f"run {self.run_id}: lost its lease to "
                               f"{other.describe() if other else 'nobody (it was deleted)'}")
        self.version = version

    def release(self) -> None:
        # Read first: an S3-compatible server that ignores If-Match on DELETE must not delete another's lease.
        current = self.store.read_versioned(self.key) if self.version else None
        ours = current is not None and current[1] == self.version
        if self.version and not (ours and self.store.delete_if(self.key, self.version)):
            log.warning("run %s: the lease was no longer ours at release", self.run_id)
        self.version = None


def holder_of(store: ArtifactStore, run_id: str) -> Holder | None:
    """Who holds the run's lease now (it may be stale), or None."""
    current = store.read_versioned(f"leases/{safe_run_id(run_id)}.json")
    return _parse(current[0]) if current else None


def _parse(raw: bytes) -> Holder | None:
    try:
        return Holder(**json.loads(raw))
    except (ValueError, TypeError):
        return None


@contextmanager
def run_lease(store: ArtifactStore, run_id: str, flow_run_id: str | None = None,
              say: Callable[[str], None] = print) -> Iterator[Lease]:
    """Hold the run's lease for the block (renewed from a thread), or raise RunBusyError naming its holder.
    Released at the end, also on an exception or Ctrl-C."""
    lease = Lease(store, run_id, flow_run_id, say)
    lease.acquire()
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(_seconds("VERLFLOW_LEASE_RENEW_S", 15)):
            try:
                lease.renew()
            except RunBusyError as e:  # the run goes on; its stages' keys keep reruns consistent
                say(f"[verlflow] warning: {e}")
                return
            except Exception as e:  # noqa: BLE001 - the store may blip; the next renewal tries again
                log.warning("run %s: renewing the lease failed (%s)", run_id, e)

    renewer = threading.Thread(target=keep, name=f"verlflow-lease-{run_id[:20]}", daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        lease.release()
