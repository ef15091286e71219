"""Device slots: a Prefect global concurrency limit per device pool, so two runs never share devices.

`verlflow-cpu-slots` / `verlflow-cuda-slots` are created on first use with one slot per core / GPU of this
host (or $VERLFLOW_SLOTS); a stage job occupies one slot per local rank for as long as its torchrun runs.
"""

import os
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.context import TaskRunContext
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from verlflow.core.errors import VerlflowError
from verlflow.core.orchestrate.devices import visible_devices
from verlflow.core.wait import wait_until

LEASE_S = 120.0


def limit_name(device: str) -> str:
    """`verlflow-cuda-slots`; set VERLFLOW_SLOT_POOL (e.g. the host name) on each worker when several hosts
    share one Prefect server, so each host gets its own pool."""
    return f"verlflow-{os.environ.get('VERLFLOW_SLOT_POOL', device)}-slots"


def default_slots(device: str) -> int:
    if os.environ.get("VERLFLOW_SLOTS"):
        return int(os.environ["VERLFLOW_SLOTS"])
    if device == "cuda":
        return max(1, len(visible_devices()))
    return os.cpu_count() or 1


def ensure_limit(device: str, needed: int) -> int:
    """The limit's slot count, creating the limit if missing; refuse a job that could never get its slots."""
    name = limit_name(device)
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            limit = max(default_slots(device), needed)
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
            except ObjectAlreadyExists:
                limit = client.read_global_concurrency_limit_by_name(name).limit
    if needed > limit:
        raise VerlflowError(f"this stage needs {needed} {device} slots but the concurrency limit '{name}' has "
                            f"{limit}; raise it (`prefect gcl update {name} --limit {needed}`) or lower "
                            "resources.nproc_per_node.")
    return limit


def await_task_run_recorded(timeout_s: float = 2.0) -> None:
    """Wait (~0.1 s) until the server has recorded this task run as Running. On a SQLite server a slot request
    that races that write fails with 'database is locked' (503), which the client retries only after 2 s:
    measured as 2 s lost on most stage starts, and on about 1 in 12 after this wait."""
    ctx = TaskRunContext.get()
    if ctx is None:
        return
    with get_client(sync_client=True) as client:
        def running() -> bool:
            try:
                state = client.read_task_run(ctx.task_run.id).state
            except ObjectNotFound:
                return False
            return state is not None and state.is_running()

        wait_until(running, interval_s=0.05, timeout_s=timeout_s)


@contextmanager
def device_slots(device: str, n: int):
    """Hold `n` slots of this host's device pool while the body runs (waits while other runs hold them)."""
    await_task_run_recorded()
    ensure_limit(device, n)
    # Renewed every 90 s; slots of a hard-killed run come back after 120 s. A renewal that fails (server blip)
    # only warns: it must not kill a long stage.
    with concurrency(limit_name(device), occupy=n, strict=True, lease_duration=LEASE_S,
                     raise_on_lease_renewal_failure=False):
        yield
