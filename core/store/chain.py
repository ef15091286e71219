"""The chain of a recurring fine-tune (schedule.init_from: previous): where its runs are in the prompts.

Each run of the chain continues the data where the chain left off, whichever policy it warm-starts from (the
promoted one may be several runs back) and across epochs: one pointer document per blueprint name,
`pointers/blueprints/<name>/chain.json`, moved in one conditional write (ArtifactStore.update_pointer):

- `data_seed`: the seed of the chain's prompt order (verlflow.core.ml.data.select), its first run's, so the epochs
  of the chain are one order whatever each run's own seed;
- `data_cursor`: prompts the chain has consumed; each committed export of a run moves it forward (never back);
- `runs`: where each run joined (its position and start cursor), the last RUNS of them: a rerun of a run, its
  build forced included, starts where it first did.

It names runs by id, never a stage key: retention pins nothing for it.
"""

from __future__ import annotations

from verlflow.core.store.artifacts import ArtifactStore

RUNS = 50  # runs remembered: the document stays one small object


def chain_pointer(name: str) -> str:
    return f"blueprints/{name}/chain"


def join(store: ArtifactStore, name: str, run_id: str, *, cursor: int, data_seed: int) -> dict:
    """Run `run_id`'s place in blueprint `name`'s chain: {position, data_cursor, data_seed}. The place it recorded
    first, else the next one (at the chain's cursor; a new chain starts at `cursor` with `data_seed`)."""
    found: list[dict] = []

    def change(current: dict | None) -> dict | None:
        found.clear()
        current = current or {"data_seed": data_seed, "data_cursor": cursor, "joined": 0, "runs": []}
        mine = [r for r in current["runs"] if r["run_id"] == run_id]
        entry = mine[0] if mine else {"run_id": run_id, "position": current["joined"],
                                      "data_cursor": current["data_cursor"]}
        found.append({"position": entry["position"], "data_cursor": entry["data_cursor"],
                      "data_seed": current["data_seed"]})
        if mine:
            return None
        return {**current, "joined": current["joined"] + 1, "runs": (current["runs"] + [entry])[-RUNS:]}

    store.update_pointer(chain_pointer(name), change)
    return found[0]


def advance(store: ArtifactStore, name: str, cursor: int) -> None:
    """A run of the chain committed an export whose policy has consumed the prompts up to `cursor`: the chain's
    next run starts there, unless the chain is further on already (a resumed earlier run)."""
    def change(current: dict | None) -> dict | None:
        return None if current is None or current["data_cursor"] >= cursor else {**current, "data_cursor": cursor}

    store.update_pointer(chain_pointer(name), change)
