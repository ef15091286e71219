"""One iteration's rollout: this rank's share of prompts x n samples, generated and scored.

The batch is stored as safetensors (no pickle): prompts left-padded, responses right-padded to max_new_tokens, and
`rollout_logp`, each response token's fp32 log-prob under the sampling logits (algorithm.old_logprobs=rollout).
An agent batch (rollout.mode=agent, core/ml/agent_rollout.py) holds every token after the prompt in `responses`
(model turns and observations, right-padded to the longest trajectory) and two more [N, R] tensors: `loss_mask`
(1 on the model's tokens: what the update trains; 0 for a trajectory whose environment failed) and
`token_rewards` (each turn's reward on its last model token).
"""

import hashlib
import math
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from verlflow.core.blueprint.sections import RewardSpec, RolloutSpec
from verlflow.core.ml.data import Prompts
from verlflow.core.ml.generate import encode_prompts, left_pad, sample
from verlflow.core.ml.placement import Placement
from verlflow.core.ml import rewardmodel
from verlflow.core.ml.rewards import overlong_penalty, score_all


def sample_seed(seed: int, iteration: int, attempt: int = 0) -> int:
    """The seed of an iteration's sampling round `attempt` (dynamic sampling takes several; round 0's is the one
    every iteration had before there were rounds); `seed`: the blueprint's."""
    tag = f"{seed}/{iteration}" + (f"/{attempt}" if attempt else "")
    return int(hashlib.sha256(tag.encode()).hexdigest()[:12], 16)


def generate_share(model, tok, rollout: RolloutSpec, reward: RewardSpec, prompts: Prompts, iteration: int,
                   at: Placement, *, max_prompt_len: int, seed: int, progress=None, attempt: int = 0) -> list[dict]:
    """Samples j = p * n + k of the iteration's `prompts` (prompt p, sample k) that fall to this rank, with
    rewards; prompts longer than `max_prompt_len` tokens are refused; `attempt` is the sampling round."""
    n = rollout.n
    mine = range(len(prompts) * n)[at.share(len(prompts) * n)]
    p_idx = [j // n for j in mine]
    enc = encode_prompts(tok, [prompts.messages[p] for p in p_idx], max_prompt_len,
                         [prompts.rows[p] for p in p_idx])
    sampler = sample
    if rollout.engine == "static":
        from verlflow.core.ml.fastgen import sample as sampler
    timings = {"setup_s": 0.0}  # the engine's own set-up (build, compile, graph capture), filled by the sampler
    logprobs: list[list[float]] = []  # always taken (cheap): algorithm.old_logprobs=rollout reads them
    t0 = time.perf_counter()
    responses = sampler(model, tok, enc, rollout, at.device, sample_seed(seed, iteration, attempt) + mine.start,
                        progress, timings=timings, logprobs=logprobs)
    if len(logprobs) != len(responses):  # a sampler that could not take them (HF generate with top_p/top_k)
        logprobs = [None] * len(responses)
    setup_s = timings["setup_s"]
    gen_s = time.perf_counter() - t0 - setup_s  # generation only: tokens_per_s must not pay for the set-up
    texts = [tok.decode(resp, skip_special_tokens=True) for resp in responses]
    scores = _scores(reward, rollout.micro_batch_size, prompts, p_idx, texts, at)
    ob = reward.overlong_buffer
    out = []
    for j, p, ids, resp, logp, text, score in zip(mine, p_idx, enc, responses, logprobs, texts, scores):
        penalty = 0.0
        if ob.enable:  # before any group filter: DAPO's dynamic sampling sees the shaped reward
            penalty = overlong_penalty(len(resp), rollout.max_new_tokens, ob.len, ob.penalty_factor)
            score += penalty
        out.append({"sample": j, "group": p, "row": prompts.rows[p], "prompt_ids": ids, "response_ids": resp,
                    "logprobs": logp,
                    "response": text, "ground_truth": prompts.ground_truth[p], "score": score, "gen_s": gen_s,
                    "overlong_penalty": penalty,
                    "setup_s": setup_s})
    return out


def _scores(r: RewardSpec, micro_batch_size: int, prompts: Prompts, p_idx: list[int], texts: list[str],
            at: Placement) -> list[float]:
    """Each sample's reward: combine.function x reward.function (a batched one `micro_batch_size` samples a call) +
    combine.model x reward.model."""
    total = [0.0] * len(texts)
    if r.uses_function:
        rule = score_all(r.function, r.module, r.batched, [prompts.data_source[p] for p in p_idx], texts,
                         [prompts.ground_truth[p] for p in p_idx], [prompts.extra_info[p] for p in p_idx],
                         micro_batch_size)
        total = [t + r.combine.function * v for t, v in zip(total, rule)]
    if r.uses_model:
        learned = rewardmodel.score(r.model, [prompts.messages[p] for p in p_idx], texts, at.device)
        total = [t + r.combine.model * v for t, v in zip(total, learned)]
    for j, v in enumerate(total):
        if not math.isfinite(v):
            raise ValueError(f"reward: sample {j} scored {v} (reward.function={r.function}, reward.model="
                             f"{r.model.path if r.model else None})")
    return total


def save_batch(samples: list[dict], folder: Path, pad_id: int, max_new_tokens: int,
               prompts_consumed: int | None = None) -> dict:
    """batch.safetensors and samples.parquet of `samples`, and their statistics; `prompts_consumed` (how far the
    data cursor moves, when sampling rounds took more prompts than the batch holds) is kept in the batch."""
    samples = sorted(samples, key=lambda s: s["sample"])
    agent, width = "loss_mask" in samples[0], max_new_tokens
    if agent:  # trajectories are as long as their turns and observations: the longest one sets the width
        from verlflow.core.ml.agent_rollout import AGENT_COUNTS, agent_stats  # it imports this module

        width = max(1, *(len(s["response_ids"]) for s in samples))
    prompts, prompt_mask = left_pad([s["prompt_ids"] for s in samples], pad_id)
    responses = torch.full((len(samples), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros_like(responses)
    rollout_logp = torch.zeros(responses.shape, dtype=torch.float32)  # the sampler's, 0 on padding
    for i, s in enumerate(samples):
        r = s["response_ids"]
        responses[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, :len(r)] = 1
        if s["logprobs"] is not None:
            rollout_logp[i, :len(r)] = torch.tensor(s["logprobs"], dtype=torch.float32)
    tensors = {
        "prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask,
        "scores": torch.tensor([s["score"] for s in samples], dtype=torch.float32),
        "group": torch.tensor([s["group"] for s in samples], dtype=torch.long),
    }
    if all(s["logprobs"] is not None for s in samples):
        tensors["rollout_logp"] = rollout_logp
    if all("reward_baseline" in s for s in samples):  # remax
        tensors["reward_baselines"] = torch.tensor([s["reward_baseline"] for s in samples], dtype=torch.float32)
    if prompts_consumed is not None:
        tensors["prompts_consumed"] = torch.tensor([prompts_consumed], dtype=torch.long)
    if agent:
        tensors.update(_agent_tensors(samples, width))
    save_file(tensors, str(folder / "batch.safetensors"))
    columns = {k: [s[k] for s in samples] for k in ("sample", "group", "row", "response", "ground_truth", "score")}
    if agent:
        columns.update({k: [s["agent"][k] for s in samples] for k in AGENT_COUNTS})
    pq.write_table(pa.table(columns), folder / "samples.parquet")
    scores = tensors["scores"]
    lens = response_mask.sum(1).float()
    made = torch.tensor([sum(s["loss_mask"]) for s in samples], dtype=torch.float) if agent else lens  # generated
    gen_s = max(s["gen_s"] for s in samples)  # the slowest rank's generation (set-up excluded)
    return {
        "reward_mean": round(scores.mean().item(), 6), "reward_std": round(scores.std().item(), 6),
        "reward_max": round(scores.max().item(), 6), "response_len_mean": round(lens.mean().item(), 3),
        "samples": len(samples), "tokens": int(made.sum().item()),
        "tokens_per_s": round(made.sum().item() / max(gen_s, 1e-9), 1), "sampling_s": round(gen_s, 4),
        "engine_setup_s": round(max(s.get("setup_s", 0.0) for s in samples), 4),
        **_overlong_stats(samples), **(agent_stats(samples) if agent else {}),
    }


def _agent_tensors(samples: list[dict], width: int) -> dict[str, torch.Tensor]:
    """loss_mask (model tokens; none of a failed trajectory: its environment, not the model, ended it) and
    token_rewards (each turn's reward on its last model token) of agent samples, [N, width]."""
    loss_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    token_rewards = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, s in enumerate(samples):
        if not s["agent"]["failed"]:
            loss_mask[i, :len(s["loss_mask"])] = torch.tensor(s["loss_mask"], dtype=torch.float32)
        for pos, value in s["turn_rewards"]:
            token_rewards[i, pos] += value
    return {"loss_mask": loss_mask, "token_rewards": token_rewards}


def _overlong_stats(samples: list[dict]) -> dict:
    """reward.overlong_buffer's effect: the share of samples it penalised and the mean penalty (0 when off)."""
    penalties = [s.get("overlong_penalty", 0.0) for s in samples]
    if not any(penalties):
        return {}
    return {"overlong/penalised_frac": round(sum(p < 0 for p in penalties) / len(penalties), 6),
            "overlong/penalty_mean": round(sum(penalties) / len(penalties), 6)}


def load_batch(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "batch.safetensors"))
