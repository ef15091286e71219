"""Models a stage leaves behind in a warm pool, for the next stage that would load the same checkpoint. Private to
verlflow.core.stages.runtime.models, which decides when an entry is used and agrees that across the ranks.

Only inside a warm pool (VERLFLOW_WARM_POOL=1, set by verlflow.core.orchestrate.pool). An entry is keyed by the
committed stage it equals (store path and key) and the blueprint sections that shape the module. A failed stage
ends the pool and its memory, so an entry never outlives the process that committed it. Every rank holds its own
shards.
"""

import os

_ENTRIES: dict[str, tuple[tuple, object]] = {}


def enabled() -> bool:
    return os.environ.get("VERLFLOW_WARM_POOL") == "1"


def get(role: str, identity: tuple):
    """This rank's entry for `role` if it equals `identity`, else None."""
    entry = _ENTRIES.get(role)
    return entry[1] if enabled() and entry is not None and entry[0] == identity else None


def put(role: str, identity: tuple, value) -> None:
    if enabled():
        _ENTRIES[role] = (identity, value)  # one per role: the previous iteration's models are freed
