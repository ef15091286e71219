"""Models a stage leaves behind in a warm pool, for the next stage that would load the same checkpoint.

Only inside a warm pool (VERLFLOW_WARM_POOL=1, set by verlflow.core.orchestrate.pool): an update keeps its FSDP policy and optimizer
(and the frozen reference, and the critic) in memory after committing them, and the next rollout, checkpoint and
update use those instead of reading the checkpoint back; the build leaves its policy (and critic) the same way for the
first rollout and update. An entry is keyed by the committed stage it equals (store
path and key) and the blueprint sections that shape the module. A failed stage ends the pool and its memory, so
an entry never outlives the process that committed it. Every rank holds its own shards; whether an entry is used
is agreed across the ranks (a rank that alone missed would load, and wait in collectives the others skip).
"""

import os

_ENTRIES: dict[str, tuple[tuple, object]] = {}
_HITS: list[str] = []  # roles found since the pool's last job began (reported in the stage's metrics)


def enabled() -> bool:
    return os.environ.get("VERLFLOW_WARM_POOL") == "1"


def get(role: str, identity: tuple):
    """The entry, on every rank or on none: a hit skips a load whose collectives the other ranks would enter."""
    from verlflow.core.agree import every_rank

    entry = _ENTRIES.get(role)
    if not enabled() or not every_rank(entry is not None and entry[0] == identity):
        return None
    _HITS.append(role)
    return entry[1]


def local(role: str, identity: tuple, usable=lambda value: True):
    """The entry on this rank alone, if `usable(value)`, with no agreement: only for what a single rank uses and no
    collective depends on (rank 0's CPU copy of the export)."""
    entry = _ENTRIES.get(role)
    if not enabled() or entry is None or entry[0] != identity or not usable(entry[1]):
        return None
    _HITS.append(role)
    return entry[1]


def begin_job() -> None:
    """A stage starts: forget the roles the previous one found."""
    _HITS.clear()


def hits() -> list[str]:
    """The roles found since `begin_job`, each once."""
    return sorted(set(_HITS))


def put(role: str, identity: tuple, value) -> None:
    if enabled():
        _ENTRIES[role] = (identity, value)  # one per role: the previous iteration's models are freed


def drop(role: str) -> None:
    _ENTRIES.pop(role, None)
