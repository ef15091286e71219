"""One iteration's agent rollout (rollout.mode=agent): this rank's share of prompts x n trajectories, each a
conversation of model turns and environment observations (core/agent/loop.py), served by the hf or static engine.

The twin of core/ml/rollout.py's generate_share: the same sample dicts, plus each trajectory's `loss_mask` (1 on
the model's tokens), `turn_rewards` ((response position, reward) per turn) and `agent` counts; `score` is the sum
of the turn rewards, `logprobs` the engine's on model tokens and 0 on observation tokens.
"""

import logging
import tempfile
import time
from pathlib import Path

import torch

from verlflow.core import faults
from verlflow.core.agent.loop import AgentLoop, Limits, Trajectory, TurnSource
from verlflow.core.blueprint.sections import RewardSpec, RolloutSpec
from verlflow.core.ml.data import Prompts
from verlflow.core.ml.generate import eos_ids, hf_generator, left_pad, records_logprobs, response_lengths
from verlflow.core.ml.placement import Placement
from verlflow.core.ml.rollout import sample_seed

log = logging.getLogger("verlflow.agent")

AGENT_COUNTS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "truncated", "failed", "env_s")


def generate_agent_share(model, tok, rollout: RolloutSpec, reward: RewardSpec, prompts: Prompts, iteration: int,
                         at: Placement, *, max_prompt_len: int, seed: int, progress=None, attempt: int = 0
                         ) -> list[dict]:
    """Trajectories j = p * n + k of the iteration's `prompts` (prompt p, sample k) that fall to this rank."""
    n = rollout.n
    mine = range(len(prompts) * n)[at.share(len(prompts) * n)]
    p_idx = [j // n for j in mine]
    trajs, stats = run_trajectories(model, tok, rollout, reward, prompts, p_idx, at, max_prompt_len=max_prompt_len,
                                    seed=sample_seed(seed, iteration, attempt) + mine.start, progress=progress)
    faults.kill_point("rollout", at.rank)  # test hook: VERLFLOW_FAULT=kill_rank<N>_in_rollout
    return [_sample(tok, j, p, prompts, t, stats) for j, p, t in zip(mine, p_idx, trajs)]


def run_trajectories(model, tok, rollout: RolloutSpec, reward: RewardSpec, prompts: Prompts, p_idx: list[int],
                     at: Placement, *, max_prompt_len: int, seed: int, progress=None) -> tuple[list[Trajectory], dict]:
    """One trajectory of each prompt in `p_idx` (a prompt listed k times: k trajectories), and the timings: the
    rollout's and the evaluation's agent loop."""
    from verlflow.core.agent.env import EnvContext
    from verlflow.core.agent.registry import load_environment

    agent = rollout.agent
    env_cls = load_environment(agent.environment, agent.module)
    limits = Limits(agent.max_turns, agent.max_total_tokens, rollout.max_new_tokens, agent.tool_timeout_s)
    with tempfile.TemporaryDirectory(prefix="verlflow-agent-") as scratch:
        context = EnvContext(tool_timeout_s=agent.tool_timeout_s, reward_fn=_reward_fn(reward), scratch=Path(scratch),
                             tool_config=Path(agent.tool_config) if agent.tool_config else None)
        t0 = time.perf_counter()
        loop = AgentLoop(tok, lambda: env_cls(agent.config, context), [env_row(prompts, p) for p in p_idx], limits,
                         ordered=rollout.engine == "hf", max_prompt_len=max_prompt_len,
                         names=[prompts.rows[p] for p in p_idx])
        timings = {"setup_s": 0.0}
        engine = serve(model, tok, loop, rollout, at.device, seed, progress, timings,
                       max_context=agent.max_total_tokens)
        wall = time.perf_counter() - t0 - timings["setup_s"]
        loop.shutdown(timeout=agent.tool_timeout_s)
    return loop.records(), {"gen_s": wall, "setup_s": timings["setup_s"], "env_wait_s": loop.wait_s,
                            "agent_rank": at.rank, "engine_turns": engine.get("turns", 0),
                            "turns_resumed": engine.get("resumed", 0)}


def env_row(prompts: Prompts, p: int) -> dict:
    """Prompt p's dataset columns as an environment's reset(row) reads them (verl's schema, and every other top-level
    column of the row: verl's agent_name, say)."""
    return {**(prompts.columns[p] if prompts.columns else {}), "prompt": prompts.messages[p],
            "data_source": prompts.data_source[p],
            "reward_model": {"ground_truth": prompts.ground_truth[p]}, "extra_info": prompts.extra_info[p],
            "index": prompts.rows[p]}


def _reward_fn(reward: RewardSpec):
    """The blueprint's reward.function, for environments that score a final answer with it (None without one)."""
    from verlflow.core.ml.rewards import load_reward

    return load_reward(reward.function, reward.module) if reward.uses_function else None


def _sample(tok, j: int, p: int, prompts: Prompts, t: Trajectory, stats: dict) -> dict:
    return {"sample": j, "group": p, "row": prompts.rows[p], "prompt_ids": t.prompt_ids,
            "response_ids": t.response_ids, "logprobs": t.logprobs,
            "response": trajectory_text(tok, t),
            "ground_truth": prompts.ground_truth[p], "score": t.score, "overlong_penalty": 0.0,
            "loss_mask": t.loss_mask, "turn_rewards": t.turn_rewards,
            "agent": {k: getattr(t, k) for k in AGENT_COUNTS}, **stats}


def trajectory_text(tok, t: Trajectory) -> str:
    """A trajectory as samples.parquet and the evaluation's report show it: special tokens kept, so the chat
    template's role markers show where each tool result starts and where the model's next turn begins."""
    return tok.decode(t.response_ids, skip_special_tokens=False)


def check_failures(samples: list[dict], max_failed_fraction: float) -> None:
    """Fail the stage when more than `max_failed_fraction` of the trajectories' environments raised (each one's
    traceback is in the log of the rank that ran it)."""
    failed = sum(s["agent"]["failed"] for s in samples)
    if failed > max_failed_fraction * len(samples):
        raise RuntimeError(f"agent rollout: the environment raised in {failed} of {len(samples)} trajectories, "
                           f"more than rollout.agent.max_failed_fraction={max_failed_fraction}; the tracebacks are "
                           "in the stage log")


def serve(model, tok, source: TurnSource, rollout: RolloutSpec, device, seed: int, progress=None,
          timings: dict | None = None, *, max_context: int) -> dict:
    """Generate every turn `source` hands out, on the blueprint's engine; `max_context`: the longest context a
    turn may have (rollout.agent.max_total_tokens). Returns the static engine's stats ({} on hf)."""
    if rollout.engine == "static":
        from verlflow.core.ml.fastgen import sample_turns

        return sample_turns(model, tok, source, rollout, device, seed, max_context, timings=timings,
                            progress=progress)
    serve_hf(model, tok, source, rollout, device, seed, progress)
    return {}


@torch.no_grad()
def serve_hf(model, tok, source: TurnSource, rollout: RolloutSpec, device, seed: int, progress=None) -> None:
    """HF generate over micro-batches of the ready turns, left-padded; each row cut at its EOS or its budget.
    Micro-batch b draws from seed + b, so with an ordered source a rerun samples the same tokens."""
    model.eval()
    generate = hf_generator(model, tok, rollout, device, records_logprobs(rollout))
    ends, batches, made = eos_ids(tok), 0, 0
    while source.wait():
        turns = source.ready(rollout.micro_batch_size)
        if not turns:
            continue
        ids, mask = left_pad([t.context for t in turns], tok.pad_token_id)
        torch.manual_seed(seed + batches)
        batches += 1
        gen, logp = generate(ids, mask, max(t.budget for t in turns))
        gen = gen.cpu()
        logp = logp.float().cpu() if logp is not None else None
        for i, (turn, n) in enumerate(zip(turns, response_lengths(gen, ends).tolist())):
            n = min(n, turn.budget)
            source.done(turn, gen[i, :n].tolist(), logp[i, :n].tolist() if logp is not None else None)
            made += n
        if progress:
            progress(f"agent: {batches} micro-batches, {made} model tokens")


def agent_stats(samples: list[dict]) -> dict:
    """The rollout's agent metrics (rollout/agent/...; core/metrics.py AGENT_KEYS): turns per trajectory, tool
    calls and errors per trajectory, timeouts, the truncated share, failed trajectories, the share with a tool
    call that returned a result (a timed-out call's step is not counted in tool_calls), the environment's time
    (summed over trajectories, and the engine's wait for it) against generation's, and the share of the model's
    turns that went on in their trajectory's KV cache (the static engine's turn cache; 0 on hf)."""
    a = [s["agent"] for s in samples]
    n = len(a)
    ranks = {s["agent_rank"]: s for s in samples}.values()  # a rank's engine counts are on each of its samples
    resumed = sum(s["turns_resumed"] for s in ranks) / max(sum(s["engine_turns"] for s in ranks), 1)

    def mean(k):
        return round(sum(x[k] for x in a) / n, 6)

    return {"agent/turns_mean": mean("turns"), "agent/turns_max": max(x["turns"] for x in a),
            "agent/tool_calls_mean": mean("tool_calls"), "agent/tool_errors_mean": mean("tool_errors"),
            "agent/tool_timeouts": sum(x["tool_timeouts"] for x in a),
            "agent/truncated_frac": mean("truncated"), "agent/failed": sum(x["failed"] for x in a),
            "agent/tool_success_frac": round(sum(x["tool_calls"] > x["tool_errors"] for x in a) / n, 6),
            "agent/env_s": round(sum(x["env_s"] for x in a), 4),
            "agent/env_wait_s": round(max(s["env_wait_s"] for s in samples), 4),
            "agent/gen_s": round(max(s["gen_s"] - s["env_wait_s"] for s in samples), 4),
            "agent/turns_resumed_frac": round(resumed, 6)}
