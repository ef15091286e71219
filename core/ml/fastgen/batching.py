"""The two ways of filling the engine's rows: ``micro_batch`` starts up to B prompts together and runs them until the
last one ends; ``continuous`` hands each finished row the next waiting prompt (``continuous_turns``, the loop it
runs, the next ready turn of a TurnSource: multi-turn agent rollouts). Both drive the engine through its
hooks (``prepare``, ``_start_rows``, ``_kv_len``, ``_decode``) and read its decode state; each returns its stats
(``FastGen.last_stats``) with its results."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from verlflow.core.ml.fastgen.graphs import sync
from verlflow.core.ml.fastgen.sampling import SamplingConfig
from verlflow.core.ml.fastgen.turncache import TurnCache

if TYPE_CHECKING:
    from verlflow.core.ml.fastgen.engine import FastGen

REFILL_WIDTH = 16  # a refill's prompts are left-padded to a multiple of this many slots


def check_prompts(max_prompt: int, lens: list[int]):
    if lens and max(lens) > max_prompt:
        raise ValueError(f"fastgen: prompt width {max(lens)} > engine max_prompt_len {max_prompt}")
    if lens and min(lens) < 1:
        raise ValueError("fastgen: an empty prompt (every prompt needs at least one token)")


def refill_width(max_prompt: int, longest: int) -> int:
    return min(max_prompt, -(-longest // REFILL_WIDTH) * REFILL_WIDTH)


@torch.no_grad()
def micro_batch(eng: FastGen, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg: SamplingConfig, eos_ids,
                pad_id: int, limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(responses (b, max_new_tokens), their log-probs, stats) for left-padded prompts (b, P), as
    ``FastGen.generate`` says."""
    st, dev = eng.state, eng.device
    b, P = input_ids.shape
    if b > st.B:
        raise ValueError(f"fastgen: batch {b} > engine batch {st.B}")
    check_prompts(st.max_prompt, [P])
    mask = attention_mask.to(dev).bool()
    lens = mask.sum(1)
    if (lens == 0).any() or not torch.equal(mask, torch.arange(P, device=dev).unsqueeze(0) >= (P - lens).unsqueeze(1)):
        raise ValueError("fastgen: prompts must be left-padded (mask = zeros then ones) and non-empty")
    setup_s = eng.prepare(eos_ids, pad_id, cfg, P)
    t1 = time.perf_counter()
    ids = torch.full((st.B, P), int(pad_id), dtype=torch.long, device=dev)
    ids[:b] = input_ids.to(dev)
    pad = torch.full((st.B,), P - 1, dtype=torch.long, device=dev)  # dummy rows: 1 token
    pad[:b] = P - lens
    budget = torch.full((st.B,), st.max_new, dtype=torch.long, device=dev)
    if limits is not None:
        budget[:b] = limits.to(dev).clamp(1, st.max_new)
    eng._start_rows(torch.arange(st.B, device=dev), ids, pad, budget, cfg)
    st.unfinished[b:] = False
    sync(dev)
    t2 = time.perf_counter()
    steps = 1
    for t in range(1, st.max_new):
        if (t == 1 or t % eng.options.check_every == 0) and not bool(st.unfinished.any()):
            break
        eng._decode(eng._kv_len(P + t - 1), cfg)
        steps += 1
    sync(dev)
    t3 = time.perf_counter()
    tokens = int(st.col[:b].sum())
    stats = {"setup_s": setup_s, "prefill_s": t2 - t1, "decode_s": t3 - t2, "steps": steps,
             "decode_ms_per_step": 1e3 * (t3 - t2) / max(steps - 1, 1), "batch": b, "prompt": P,
             "tokens": tokens, "occupancy": tokens / (steps * st.B)}
    logprobs = st.out_logp[:b].clone()
    return st.out[:b].clone(), logprobs, stats


class _Prompt(NamedTuple):  # a TurnSource's turn (core/agent/loop.py's Turn has these fields)
    key: int
    context: list[int]
    budget: int


class _PromptList:
    """Fixed prompts as a turn source: each prompt is one turn, ready from the start; responses kept in order."""

    def __init__(self, prompts: list[list[int]], budgets: list[int]):
        self.waiting = [_Prompt(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))][::-1]  # popped from the end
        self.responses: list = [None] * len(prompts)
        self.logprobs: list = [None] * len(prompts)
        self._ended: list[int] = []

    def ready(self, limit: int) -> list[_Prompt]:
        return [self.waiting.pop() for _ in range(min(limit, len(self.waiting)))]

    def done(self, turn: _Prompt, tokens: list[int], logprobs: list[float]):
        self.responses[turn.key], self.logprobs[turn.key] = tokens, logprobs
        self._ended.append(turn.key)

    def ended(self) -> list[int]:
        """Every prompt is a trajectory of one turn: those done have ended."""
        keys, self._ended = self._ended, []
        return keys

    def wait(self, timeout: float | None = None) -> bool:
        return False  # asked only once every prompt was handed out: nothing more will come


def check_turn(max_prompt: int, turn):
    n = len(turn.context)
    if n > max_prompt:
        raise ValueError(f"fastgen: turn of trajectory {turn.key} has a context of {n} tokens > the engine's "
                         f"max_prompt_len {max_prompt} (a turn's context is its whole trajectory so far: build the "
                         f"engine with max_prompt_len >= the trajectories' max_total_tokens)")
    if n < 1:
        raise ValueError(f"fastgen: turn of trajectory {turn.key} has an empty context")


def _start_turns(eng: FastGen, rows: list[int], turns: list, pad_id: int, cfg: SamplingConfig) -> int:
    """Prefill the turns' contexts into rows ``rows``, left-padded to one refill width (returned), and sample their
    first tokens; each turn gets at most its budget of new tokens."""
    st, dev = eng.state, eng.device
    width = refill_width(st.max_prompt, max(len(t.context) for t in turns))
    ids = torch.full((len(turns), width), int(pad_id), dtype=torch.long)
    for j, t in enumerate(turns):
        ids[j, width - len(t.context):] = torch.tensor(t.context, dtype=torch.long)
    pad = torch.tensor([width - len(t.context) for t in turns], dtype=torch.long, device=dev)
    budgets = torch.tensor([max(1, min(int(t.budget), st.max_new)) for t in turns], device=dev)
    eng._start_rows(torch.tensor(rows, device=dev), ids.to(dev), pad, budgets, cfg)
    return width


@torch.no_grad()
def continuous(eng: FastGen, prompts: list[list[int]], cfg: SamplingConfig, eos_ids, pad_id: int,
               limits: list[int] | None = None, refill_min: int | None = None, progress=None):
    """Continuous batching: (responses, log-probs, stats), one list per prompt in order, each response's tokens up to
    and with its EOS (no padding). The engine's rows start with the first prompts; every ``check_every``
    steps the rows that finished hand their tokens back and, once ``refill_min`` rows (default 1/32 of the
    batch: 8 of 256 was 2x faster than 32 on the H200, infra/bench/ragged.py) are free, take the next waiting
    prompts (prefilled into those rows alone: the other rows' caches and positions stay). A long response no longer
    holds a whole batch of short ones.
    Seed torch before the call for reproducible samples (they depend on the seed and the batch size).
    ``progress(line)`` gets a line whenever another batch's worth of responses has ended."""
    check_prompts(eng.state.max_prompt, [len(p) for p in prompts])
    source = _PromptList(prompts, [eng.state.max_new] * len(prompts) if limits is None else limits)
    stats = continuous_turns(eng, source, cfg, eos_ids, pad_id, refill_min, progress,
                             first_width=min((len(p) for p in prompts), default=1), total=len(prompts))
    return source.responses, source.logprobs, stats


def _resume_turns(eng: FastGen, resumed: list, pad_id: int):
    """Resumed turns ((row, tokens to feed, turn) each) go on in their rows' caches."""
    st, dev = eng.state, eng.device
    forced = torch.full((len(resumed), st.force.shape[1]), int(pad_id), dtype=torch.long)
    for j, (_, new, _) in enumerate(resumed):
        forced[j, :len(new)] = torch.tensor(new, dtype=torch.long)
    lens = torch.tensor([len(new) for _, new, _ in resumed], dtype=torch.long)
    budgets = torch.tensor([max(1, min(int(t.budget), st.max_new)) for _, _, t in resumed], dtype=torch.long)
    st.resume(torch.tensor([r for r, _, _ in resumed], device=dev), forced.to(dev), lens.to(dev), budgets.to(dev))


def _prefill_cost(eng: FastGen, prefill_s: float, prefilled: int, decode_s: float, steps: int) -> float:
    """A prefilled cache slot's cost in row-steps (one row of one decode step): the engine's option, or measured so
    far (1 before both were)."""
    if eng.options.prefill_cost is not None:
        return eng.options.prefill_cost
    if not (prefilled and steps and decode_s > 0):
        return 1.0
    return (prefill_s / prefilled) / (decode_s / (steps * eng.state.B))


@torch.no_grad()
def continuous_turns(eng: FastGen, source, cfg: SamplingConfig, eos_ids, pad_id: int, refill_min: int | None = None,
                     progress=None, first_width: int = 1, total: int | None = None) -> dict:
    """Continuous batching over a TurnSource (core/agent/loop.py; ``continuous``'s prompt list is one): free rows
    take the turns ``source.ready`` has (each turn's whole context prefilled into its row, at most ``turn.budget``
    new tokens), a finished row hands its tokens and log-probs to ``source.done``, and only when no row is
    generating and no turn is ready does the engine block in ``source.wait`` (it stops once that says False). So a
    trajectory waiting for its tool holds no row that another turn needs: the others keep decoding. With
    ``turn_cache`` (turncache.py) a finished turn's row is parked for its trajectory's next turn, which goes on in
    that cache; ``source.ended()`` names the trajectories that will have none. Returns the stats; ``first_width``
    (the narrowest context expected) bounds the set-up's captures, ``total`` (the turns, where known) the
    progress lines."""
    st, dev = eng.state, eng.device
    B = st.B
    refill_min = max(1, B // 32 if refill_min is None else int(refill_min))
    setup_s = eng.prepare(eos_ids, pad_id, cfg, first_width, every_slot=True)
    st.reset()
    st.unfinished.fill_(False)
    st.out.fill_(int(pad_id))
    owner: list = [None] * B  # the turn each row is generating, None: free or parked
    base = [0] * B  # each row's first cache slot (its left padding)
    cache = TurnCache(st.T, st.force.shape[1]) if eng.options.turn_cache else None
    # Turns taken from the source, not started yet. Holding up to B + refill_min of them, the refill rule below sees
    # the same as if it saw every waiting turn (so a prompt list refills as it always did).
    pending: list = []
    lookahead = B + refill_min
    prefill_s = decode_s = wait_s = 0.0
    steps = refills = waits = idle_row_steps = tokens = prefilled = 0
    bound = 0  # an upper bound of every row's slot (the bucketed paths attend over slots [0, bound])
    ended = told = 0
    shapes: set = set()  # the refills' (rows, width)
    t_start = time.perf_counter()
    while True:
        if cache is not None:
            cache.forget(source.ended())
        want = max(0, lookahead - len(pending)) + (len(cache) if cache is not None else 0)
        resumed = []
        ratio = _prefill_cost(eng, prefill_s, prefilled, decode_s, steps)
        for turn in source.ready(want) if want else []:
            check_turn(st.max_prompt, turn)
            took = cache.take(turn, ratio, busy=bool(pending)) if cache is not None else None
            if took is None:
                pending.append(turn)
            else:
                resumed.append((*took, turn))
                owner[took[0]] = turn
        if resumed:
            _resume_turns(eng, resumed, pad_id)
        free = [r for r in range(B) if owner[r] is None and not (cache is not None and cache.holds(r))]
        if cache is not None and len(free) < len(pending) and steps:
            free += cache.evictable(steps, ratio)
        if pending and free and (len(free) >= min(refill_min, len(pending)) or len(free) == B):
            t0 = time.perf_counter()
            # Few distinct prefill shapes: per-shape work (an attention plan, say) is paid once a shape, 4 s of
            # the H200's first call. So a multiple of refill_min rows while more turns wait than rows are
            # free (the rest at the next check), and the width rounded up to REFILL_WIDTH slots.
            k = min(len(free), len(pending))
            if k < len(pending):
                k = max(1, k // refill_min) * refill_min
            take, turns, pending = free[:k], pending[:k], pending[k:]
            if cache is not None:
                cache.evict(take)
            width = _start_turns(eng, take, turns, pad_id, cfg)
            shapes.add((len(take), width))
            for r, t in zip(take, turns):
                owner[r], base[r] = t, width - len(t.context)
            bound = max(bound, width)
            refills += 1
            prefilled += width * len(take)
            sync(dev)
            prefill_s += time.perf_counter() - t0
        if all(o is None for o in owner):
            t0 = time.perf_counter()
            more = source.wait()  # every trajectory is waiting for its tool (or all ended)
            wait_s += time.perf_counter() - t0
            if not more:
                break
            waits += 1
            continue
        if not pending:  # rows free with no turn to take (tools' latency, or the work's end), not held by the rule
            idle_row_steps += sum(o is None for o in owner) * eng.options.check_every
        t0 = time.perf_counter()
        for _ in range(eng.options.check_every):
            eng._decode(eng._kv_len(min(bound, st.T - 1)), cfg)
            bound += 1
            steps += 1
        done = (~st.unfinished).tolist()  # syncs
        decode_s += time.perf_counter() - t0
        rows = [r for r in range(B) if owner[r] is not None and done[r]]
        if rows:
            ix = torch.tensor(rows, device=dev)
            cols, out, logp = st.col[ix].tolist(), st.out[ix].cpu(), st.out_logp[ix].cpu()
            for j, r in enumerate(rows):
                turn, owner[r] = owner[r], None
                sampled = out[j, :cols[j]].tolist()
                source.done(turn, sampled, logp[j, :cols[j]].tolist())
                if cache is not None:  # its cache holds the context and what it sampled but the last token
                    cache.park(r, turn.key, turn.context + sampled[:-1], base[r], steps)
                tokens += cols[j]
            ended += len(rows)
            if progress and (ended - told >= B or ended == total):
                told = ended
                dt = time.perf_counter() - t_start
                what = f"{ended}/{total} sequences" if total is not None else f"{ended} turns"
                progress(f"generated {what}, {tokens} tokens, {tokens / max(dt, 1e-9):.0f} tok/s")
        bound = int(st.slot.max())
    return {"setup_s": setup_s, "prefill_s": prefill_s, "decode_s": decode_s, "steps": steps,
            "decode_ms_per_step": 1e3 * decode_s / max(steps, 1), "batch": B, "refills": refills,
            "refill_shapes": len(shapes), "tokens": tokens, "occupancy": tokens / max(steps * B, 1),
            "turns": ended, "wait_s": wait_s, "waits": waits, "idle_row_steps": idle_row_steps,
            "prefilled_slots": prefilled, **(cache.stats() if cache is not None else {})}
