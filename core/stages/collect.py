"""One iteration's samples, on every rank: sampling rounds, DAPO's group filter, remax's greedy baseline.

Runs in every rank of the rollout (and monolithic) job. Each round samples `data.batch_size` prompts and gathers
the samples on every rank, so the decisions below (keep a group, sample another round) are taken from the same
gathered scores everywhere: no rank can leave the loop while another waits in the next round's gather.
"""

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verlflow.core.ml.data import Prompts, select
from verlflow.core.ml.rollout import generate_share
from verlflow.core.ml.agent_rollout import check_failures, generate_agent_share
from verlflow.core.stages.common import StageContext

log = logging.getLogger("verlflow.rollout")


def gather(ctx: StageContext, mine: list[dict]) -> list[dict]:
    """Every rank's samples, on every rank: one collective after generation, none during it (ranks that finish
    early simply wait here)."""
    if ctx.world == 1:
        return mine
    parts = [None] * ctx.world
    dist.all_gather_object(parts, mine)
    return [s for p in parts for s in p]


@dataclass
class Collected:
    samples: list[dict]
    prompts_consumed: int  # how far the data cursor moves: every round's prompts count, kept or not
    metrics: dict = field(default_factory=dict)


def gather_samples(ctx: StageContext, model, tok, rollout, prompts: Prompts, iteration: int, **kw) -> list[dict]:
    """Every rank's samples of `prompts`, on every rank: one response each (rollout.mode single) or an agent's
    trajectory; an agent rollout whose environments failed too often fails here, on every rank alike."""
    agent = rollout.mode == "agent"
    share = generate_agent_share if agent else generate_share
    samples = gather(ctx, share(model, tok, rollout, ctx.bp.reward, prompts, iteration, ctx.placement,
                                max_prompt_len=ctx.bp.data.max_prompt_length, seed=ctx.bp.seed, **kw))
    if agent:
        check_failures(samples, rollout.agent.max_failed_fraction)
    return samples


def _groups(samples: list[dict]) -> list[list[dict]]:
    by: dict[int, list[dict]] = {}
    for s in sorted(samples, key=lambda s: s["sample"]):
        by.setdefault(s["group"], []).append(s)
    return [by[g] for g in sorted(by)]


def _renumber(groups: list[list[dict]], n: int) -> list[dict]:
    """Groups -> samples numbered as one batch: group p, sample p * n + k (the layout save_batch expects)."""
    return [{**s, "group": p, "sample": p * n + k} for p, g in enumerate(groups) for k, s in enumerate(g)]


def collect(ctx: StageContext, model, tok, data: Prompts, cursor: int, iteration: int, progress=None,
            data_seed: int | None = None) -> Collected:
    """Iteration `iteration`'s samples of `data` from prompt `cursor` on, in the prompt order of `data_seed` (the
    policy's state.json: a chain's order, verlflow.core.store.chain; None, a policy built before it: seed)."""
    rollout, fp8 = engine_weights(ctx, model)
    got = _collect(ctx, rollout, model, tok, data, cursor, iteration, progress, data_seed)
    if fp8 is not None:
        got.metrics["weights_fp8"] = int(fp8)
    return got


def engine_weights(ctx: StageContext, model):
    """(the rollout spec the engine gets, whether rollout.weights=auto chose fp8: None if not auto). fp8 only if
    every rank's timed check found it faster (core/ml/fastgen/weightcheck.py): all ranks sample one model."""
    r = ctx.bp.rollout
    if r.weights != "auto":
        return r, None
    from verlflow.core.ml.fastgen.weightcheck import fp8_pays

    rows = min(r.micro_batch_size, max(1, ctx.bp.data.batch_size * r.n // ctx.world))  # the engine's rows
    fp8, record = fp8_pays(model.config, next(model.parameters()).dtype, rows, ctx.device)
    if ctx.world > 1:
        flag = torch.tensor([int(fp8)], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fp8 = bool(flag.item())
    if ctx.is_main():
        log.info("rollout.weights=auto: %s projections (%s at %d rows)", "fp8" if fp8 else "the model's",
                 record.get("reason") or f"{record['fp8_us']} us fp8 against {record['model_us']} us a layer", rows)
    return r.model_copy(update={"weights": "fp8" if fp8 else "model"}), fp8


def _collect(ctx: StageContext, rollout, model, tok, data: Prompts, cursor: int, iteration: int, progress,
             data_seed: int | None) -> Collected:
    bp, it = ctx.bp, iteration
    order_seed = bp.seed if data_seed is None else data_seed
    B, n, fg = bp.data.batch_size, bp.rollout.n, bp.algorithm.filter_groups
    rounds = fg.max_num_gen_batches if fg.enable else 1
    informative: list[list[dict]] = []
    uniform: list[list[dict]] = []
    sampled = 0
    for r in range(rounds):
        rows = select(len(data), cursor + r * B, B, order_seed, bp.data.shuffle).tolist()
        samples = gather_samples(ctx, model, tok, rollout, data.take(rows), it, progress=progress, attempt=r)
        sampled += len(samples)
        if not fg.enable:
            return _with_baseline(ctx, rollout, it, model, tok, data, Collected(samples, B))
        for g in _groups(samples):
            (informative if len({s["score"] for s in g}) > 1 else uniform).append(g)
        if len(informative) >= B:
            break
    chosen = informative[:B]
    filled = B - len(chosen)  # rounds ran out: uniform groups (zero advantage) keep the batch's shape
    chosen += uniform[:filled]
    metrics = {"filter_groups/rounds": r + 1, "filter_groups/prompts_sampled": (r + 1) * B,
               "filter_groups/informative_groups": len(informative),
               "filter_groups/uniform_groups": len(uniform), "filter_groups/filled_with_uniform": filled,
               "filter_groups/samples_sampled": sampled}
    return _with_baseline(ctx, rollout, it, model, tok, data, Collected(_renumber(chosen, n), (r + 1) * B, metrics))


def _with_baseline(ctx: StageContext, rollout, it: int, model, tok, data: Prompts, got: Collected) -> Collected:
    """remax: each prompt's greedy response, scored; its reward is the baseline of the prompt's samples."""
    bp = ctx.bp
    if not bp.algorithm.greedy_baseline:
        return got
    groups = _groups(got.samples)
    prompts = data.take([g[0]["row"] for g in groups])
    one_greedy = rollout.model_copy(update={"n": 1, "temperature": 0.0})
    greedy = gather_samples(ctx, model, tok, one_greedy, prompts, it)
    baseline = {s["group"]: s["score"] for s in greedy}  # group p of `prompts` is group p of the batch
    samples = [{**s, "reward_baseline": baseline[p]} for p, g in enumerate(groups) for s in g]
    got.metrics["remax/baseline_reward_mean"] = round(sum(baseline.values()) / len(baseline), 6)
    return Collected(samples, got.prompts_consumed, got.metrics)
