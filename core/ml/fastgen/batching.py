"""The two ways of filling the engine's rows: ``micro_batch`` starts up to B prompts together and runs them until the
last one ends; ``continuous`` hands each finished row the next waiting prompt. Both drive the engine through its
hooks (``prepare``, ``_start_rows``, ``_kv_len``, ``_decode``) and read its decode state; each returns its stats
(``FastGen.last_stats``) with its results."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from verlflow.core.ml.fastgen.graphs import sync
from verlflow.core.ml.fastgen.sampling import SamplingConfig

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
    st, dev = eng.state, eng.device
    n, B = len(prompts), st.B
    check_prompts(st.max_prompt, [len(p) for p in prompts])
    budgets = [st.max_new] * n if limits is None else [max(1, min(int(x), st.max_new)) for x in limits]
    refill_min = max(1, B // 32 if refill_min is None else int(refill_min))
    setup_s = eng.prepare(eos_ids, pad_id, cfg, min((len(p) for p in prompts), default=1), every_slot=True)
    st.reset()
    st.unfinished.fill_(False)
    st.out.fill_(int(pad_id))
    owner = [-1] * B  # the prompt each row is generating, -1: free
    waiting = list(range(n))[::-1]  # popped from the end: prompts in order
    responses: list = [None] * n
    logprobs: list = [None] * n
    prefill_s = decode_s = 0.0
    steps = refills = 0
    bound = 0  # an upper bound of every row's slot (the bucketed paths attend over slots [0, bound])
    ended = told = 0
    shapes: set = set()  # the refills' (rows, width)
    t_start = time.perf_counter()
    while True:
        free = [r for r in range(B) if owner[r] < 0]
        if waiting and free and (len(free) >= min(refill_min, len(waiting)) or len(free) == B):
            t0 = time.perf_counter()
            # Few distinct prefill shapes: per-shape work (an attention plan, say) is paid once a shape, 4 s of
            # the H200's first call. So a multiple of refill_min rows while more prompts wait than rows are
            # free (the rest at the next check), and the width rounded up to REFILL_WIDTH slots.
            k = min(len(free), len(waiting))
            if k < len(waiting):
                k = max(1, k // refill_min) * refill_min
            take = free[:k]
            idx = [waiting.pop() for _ in take]
            width = refill_width(st.max_prompt, max(len(prompts[i]) for i in idx))
            shapes.add((len(take), width))
            ids = torch.full((len(idx), width), int(pad_id), dtype=torch.long)
            for j, i in enumerate(idx):
                ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            pad = torch.tensor([width - len(prompts[i]) for i in idx], dtype=torch.long, device=dev)
            eng._start_rows(torch.tensor(take, device=dev), ids.to(dev), pad,
                            torch.tensor([budgets[i] for i in idx], device=dev), cfg)
            for r, i in zip(take, idx):
                owner[r] = i
            bound = max(bound, width)
            refills += 1
            sync(dev)
            prefill_s += time.perf_counter() - t0
        if all(o < 0 for o in owner):
            break
        t0 = time.perf_counter()
        for _ in range(eng.options.check_every):
            eng._decode(eng._kv_len(min(bound, st.T - 1)), cfg)
            bound += 1
            steps += 1
        done = (~st.unfinished).tolist()  # syncs
        decode_s += time.perf_counter() - t0
        rows = [r for r in range(B) if owner[r] >= 0 and done[r]]
        if rows:
            ix = torch.tensor(rows, device=dev)
            cols, out, logp = st.col[ix].tolist(), st.out[ix].cpu(), st.out_logp[ix].cpu()
            for j, r in enumerate(rows):
                responses[owner[r]] = out[j, :cols[j]].tolist()
                logprobs[owner[r]] = logp[j, :cols[j]].tolist()
                owner[r] = -1
            ended += len(rows)
            if progress and (ended - told >= B or ended == n):
                told = ended
                dt = time.perf_counter() - t_start
                tokens = sum(len(responses[i]) for i in range(n) if responses[i] is not None)
                progress(f"generated {ended}/{n} sequences, {tokens} tokens, {tokens / max(dt, 1e-9):.0f} tok/s")
        bound = int(st.slot.max())
    tokens = sum(len(r) for r in responses)
    stats = {"setup_s": setup_s, "prefill_s": prefill_s, "decode_s": decode_s, "steps": steps,
             "decode_ms_per_step": 1e3 * decode_s / max(steps, 1), "batch": B, "refills": refills,
             "refill_shapes": len(shapes), "tokens": tokens, "occupancy": tokens / max(steps * B, 1)}
    return responses, logprobs, stats
