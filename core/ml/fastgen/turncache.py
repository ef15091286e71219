"""Rows that keep a finished turn's KV cache for its trajectory's next turn (``EngineOptions.turn_cache``).

A multi-turn trajectory's next context is its last one, the tokens it sampled and the observation's tokens. Its row's
cache already holds all of that but the observation and the last sampled token (never fed back), so the next turn can
go on there, fed those few tokens through the decode step (``DecodeState.resume``), instead of prefilling its whole
context again into some free row. While its tool runs, the row is parked: it decodes nothing.

Both choices are priced in row-steps (one row of one decode step), a prefilled slot costing ``ratio`` of them
(``EngineOptions.prefill_cost``, or measured as the engine runs). A parked row is given to another turn only once it
has waited longer than prefilling its context again would take: the rent-or-buy rule, never more than twice the
better choice made knowing when the tool returns. While other turns wait for rows, a turn is resumed only if feeding
its new tokens costs no more than prefilling its context; with none waiting, feeding them costs nothing."""

from __future__ import annotations

from typing import NamedTuple


class Parked(NamedTuple):
    key: int  # the trajectory
    tokens: list[int]  # what the row's cache holds, from its first slot `base`
    base: int
    since: int  # the decode step it was parked at


class TurnCache:
    """The engine's parked rows, by row and by trajectory; ``slots``: the cache's slots a row, ``forced``: the most
    tokens a resumed turn may be fed."""

    def __init__(self, slots: int, forced: int):
        self.slots, self.forced = slots, forced
        self.rows: dict[int, Parked] = {}
        self.by_key: dict[int, int] = {}
        self.resumed = self.forced_tokens = self.evicted = 0

    def __len__(self) -> int:
        return len(self.rows)

    def holds(self, row: int) -> bool:
        return row in self.rows

    def park(self, row: int, key: int, tokens: list[int], base: int, step: int):
        self.drop(row)
        self.drop(self.by_key.get(key))
        self.rows[row] = Parked(key, tokens, base, step)
        self.by_key[key] = row

    def drop(self, row: int | None):
        parked = self.rows.pop(row, None) if row is not None else None
        if parked is not None:
            del self.by_key[parked.key]

    def forget(self, keys):
        """Trajectories that ended: their rows are free."""
        for key in keys:
            self.drop(self.by_key.get(key))

    def take(self, turn, ratio: float, busy: bool) -> tuple[int, list[int]] | None:
        """(row, tokens to feed) when ``turn`` can go on in its trajectory's parked row (its context extends what
        the cache holds, by at most ``forced`` tokens, the row has room for its budget and, when ``busy`` (other
        turns wait for rows), feeding is the cheaper); else None, and that row, if any, is free."""
        row = self.by_key.get(turn.key)
        if row is None:
            return None
        parked = self.rows[row]
        self.drop(row)
        n = len(parked.tokens)
        new = turn.context[n:]
        end = parked.base + len(turn.context)
        if (not 1 <= len(new) <= self.forced or end + turn.budget > self.slots or turn.context[:n] != parked.tokens
                or busy and len(new) > ratio * end):
            return None
        self.resumed += 1
        self.forced_tokens += len(new)
        return row, new

    def evictable(self, step: int, ratio: float) -> list[int]:
        """Parked rows, oldest first, that waited longer than prefilling their context again would take."""
        due = [(p.since, row) for row, p in self.rows.items() if step - p.since >= ratio * (p.base + len(p.tokens))]
        return [row for _, row in sorted(due)]

    def evict(self, rows):
        for row in rows:
            if row in self.rows:
                self.evicted += 1
                self.drop(row)

    def stats(self) -> dict:
        return {"resumed": self.resumed, "forced_tokens": self.forced_tokens, "evicted": self.evicted}
