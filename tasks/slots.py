"""Device slots: one Prefect global concurrency limit per device kind, so two runs never share devices.

`verlflow-cpu-slots` / `verlflow-cuda-slots` are created on first use with one slot per core / GPU of this
host (or $VERLFLOW_SLOTS); a stage job occupies one slot per local rank for as long as its torchrun runs.
"""

import os
import shutil
import subprocess
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from core.errors import VerlflowError


def limit_name(device: str) -> str:
    return f"verlflow-{device}-slots"


def default_slots(device: str) -> int:
    if os.environ.get("VERLFLOW_SLOTS"):
        return int(os.environ["VERLFLOW_SLOTS"])
    if device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return len([d for d in visible.split(",") if d.strip()])
        if shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
            return max(1, sum(line.startswith("GPU ") for line in out.splitlines()))
        return 1
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


@contextmanager
def device_slots(device: str, n: int):
    """Hold `n` slots of this host's device pool while the body runs (waits while other runs hold them)."""
    ensure_limit(device, n)
    with concurrency(limit_name(device), occupy=n, strict=True):
        yield
