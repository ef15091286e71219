"""Held-out evaluation: eval.files' prompts, this rank's share of prompts x eval.n samples generated and scored, and
what the evaluate stage reports of them: per data source and over all, mean reward, accuracy (reward >=
eval.threshold), pass@k (the unbiased estimator), mean response length.

Torch-free at import (the blueprint's preflight reads the eval files through here); generation imports the
sampler when called.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from verlflow.core.blueprint.sections import EvalSpec, RewardSpec, RolloutSpec
from verlflow.core.errors import InputError, VerlflowError
from verlflow.core.ml.data import Prompts, load_prompts, missing_file_problems

if TYPE_CHECKING:  # it imports torch
    from verlflow.core.ml.placement import Placement

SAMPLE_COLUMNS = ("data_source", "file", "row", "sample", "response", "ground_truth", "reward", "correct",
                  "response_len")


@dataclass
class HeldOut:
    """The evaluated prompts of every eval file, in file order; `rows` are their rows in their own file."""
    prompts: Prompts
    file: list[int]  # each prompt's index in eval.files

    def __len__(self) -> int:
        return len(self.prompts)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c correct of n samples: 1 - C(n-c, k) / C(n, k), as the product
    prod_{i=n-c+1..n} (1 - k / i), which neither overflows nor loses precision for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ----------------------------------------------------------------------------------------------------- the files


def _load_files(ev: EvalSpec) -> tuple[list[Prompts], list[str]]:
    """Each eval file's first eval.max_prompts prompts, and every problem of every file (all at once)."""
    problems = missing_file_problems(ev.files, "eval.files")
    sets = []
    for i, f in enumerate(ev.files):
        if not Path(f).is_file():
            continue
        try:
            prompts = load_prompts([f], ev.prompt_key, f"eval.files[{i}]")
        except VerlflowError as e:
            problems.append(str(e))
            continue
        sets.append(prompts.take(range(min(len(prompts), ev.max_prompts or len(prompts)))))
    return sets, problems


def held_out_problems(ev: EvalSpec) -> list[str]:
    """What makes eval.files unusable (a missing file, a missing column, no rows), each naming its file."""
    return _load_files(ev)[1]


def load_held_out(ev: EvalSpec) -> HeldOut:
    sets, problems = _load_files(ev)
    if problems:
        raise InputError(" ".join(problems))
    cols = [[x for p in sets for x in getattr(p, name)] for name in ("messages", "data_source", "ground_truth",
                                                                      "extra_info", "rows")]
    others = [x for p in sets for x in (p.columns or [{}] * len(p))]
    return HeldOut(Prompts(*cols, columns=others), [i for i, p in enumerate(sets) for _ in range(len(p))])


def source_counts(held: HeldOut) -> dict[str, int]:
    """Prompts per data source, in order of first appearance."""
    counts: dict[str, int] = {}
    for s in held.prompts.data_source:
        counts[s] = counts.get(s, 0) + 1
    return counts


# ------------------------------------------------------------------------------------------------ generation


def sampling(ev: EvalSpec, rollout: RolloutSpec) -> RolloutSpec:
    """The rollout's engine settings with the eval's sampling: eval.n samples at eval.temperature / eval.top_p
    (no top-k), at most eval.max_new_tokens (else rollout.max_new_tokens); the model's own weights and cache (not
    rollout.weights/kv_cache=fp8: the evaluation measures the policy)."""
    return rollout.model_copy(update={"n": ev.n, "temperature": ev.temperature, "top_p": ev.top_p, "top_k": 0,
                                      "weights": "model", "kv_cache": "model",
                                      "max_new_tokens": ev.max_new_tokens or rollout.max_new_tokens})


def eval_seed(seed: int, iteration: int) -> int:
    """Apart from the rollout's seed of the same iteration (verlflow.core.ml.rollout.sample_seed)."""
    return int(hashlib.sha256(f"{seed}/eval/{iteration}".encode()).hexdigest()[:12], 16)


def reward_of(ev: EvalSpec, reward: RewardSpec):
    """eval.reward, else reward.function (reward.module imported first)."""
    from verlflow.core.ml.rewards import load_reward

    if ev.reward:
        return load_reward(ev.reward, reward.module, field="eval.reward")
    return load_reward(reward.function, reward.module)


def share(total: int, at: Placement) -> range:
    """This rank's contiguous share of `total` samples; unlike a rollout's, the count need not divide by the
    ranks (a rank may get one more)."""
    return range(at.rank * total // at.world, (at.rank + 1) * total // at.world)


def generate_share(model, tok, ev: EvalSpec, rollout: RolloutSpec, reward: RewardSpec, held: HeldOut,
                   iteration: int, at: Placement, *, max_prompt_len: int, seed: int, progress=None) -> list[dict]:
    """Samples j = p * n + k (prompt p, sample k) that fall to this rank, scored; no collective."""
    from verlflow.core.ml.generate import encode_prompts

    cfg, prompts = sampling(ev, rollout), held.prompts
    n = cfg.n
    mine = share(len(prompts) * n, at)
    if not mine:  # more ranks than samples
        return []
    p_idx = [j // n for j in mine]
    if rollout.mode == "agent":
        return _agent_share(model, tok, cfg, ev, reward, held, mine, p_idx, at, max_prompt_len=max_prompt_len,
                            seed=eval_seed(seed, iteration) + mine.start, progress=progress)
    enc = encode_prompts(tok, [prompts.messages[p] for p in p_idx], max_prompt_len, [prompts.rows[p] for p in p_idx])
    if rollout.engine == "static":
        from verlflow.core.ml.fastgen import sample as sampler
    else:
        from verlflow.core.ml.generate import sample as sampler
    responses = sampler(model, tok, enc, cfg, at.device, eval_seed(seed, iteration) + mine.start, progress,
                        timings={"setup_s": 0.0})
    score_of, threshold = reward_of(ev, reward), ev.threshold
    out = []
    for j, p, resp in zip(mine, p_idx, responses):
        text = tok.decode(resp, skip_special_tokens=True)
        score = score_of(prompts.data_source[p], text, prompts.ground_truth[p], prompts.extra_info[p])
        out.append(_scored(held, j, p, n, text, score, threshold, len(resp)))
    return out


def _scored(held: HeldOut, j: int, p: int, n: int, text: str, score: float, threshold: float, length: int) -> dict:
    prompts = held.prompts
    return {"index": j, "prompt": p, "data_source": prompts.data_source[p], "file": held.file[p],
            "row": prompts.rows[p], "sample": j % n, "response": text, "ground_truth": prompts.ground_truth[p],
            "reward": score, "correct": score >= threshold, "response_len": length}


def _agent_share(model, tok, cfg: RolloutSpec, ev: EvalSpec, reward: RewardSpec, held: HeldOut, mine: range,
                 p_idx: list[int], at: Placement, *, max_prompt_len: int, seed: int, progress=None) -> list[dict]:
    """rollout.mode=agent: a trajectory per sample, scored by its environment (a trajectory's reward: the sum of its
    turns'); eval.reward, when set, is the reward function an environment that scores with one (verl_tools) gets.
    The response shown is the whole trajectory, observations included."""
    from verlflow.core.ml.agent_rollout import run_trajectories, trajectory_text

    if ev.reward:
        reward = reward.model_copy(update={"function": ev.reward})
    trajs, _ = run_trajectories(model, tok, cfg, reward, held.prompts, p_idx, at, max_prompt_len=max_prompt_len,
                                seed=seed, progress=progress)
    return [_scored(held, j, p, cfg.n, trajectory_text(tok, t), t.score, ev.threshold, len(t.response_ids))
            for j, p, t in zip(mine, p_idx, trajs)]


# --------------------------------------------------------------------------------------------------- reports


def _stats(samples: list[dict], pass_k: list[int]) -> dict:
    by_prompt: dict[int, list[bool]] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt"], []).append(s["correct"])
    out = {"reward_mean": sum(s["reward"] for s in samples) / len(samples),
           "accuracy": sum(s["correct"] for s in samples) / len(samples)}
    for k in pass_k:
        out[f"pass@{k}"] = sum(pass_at_k(len(c), sum(c), k) for c in by_prompt.values()) / len(by_prompt)
    out["response_len_mean"] = sum(s["response_len"] for s in samples) / len(samples)
    out = {k: round(v, 6) for k, v in out.items()}
    out["samples"] = len(samples)
    return out


def metrics(samples: list[dict], ev: EvalSpec) -> dict:
    """`<source>/<metric>` for each data source, then the same metrics over all of them (core/metrics.py)."""
    out = {}
    for source in sorted({s["data_source"] for s in samples}):
        mine = [s for s in samples if s["data_source"] == source]
        out.update({f"{source}/{k}": v for k, v in _stats(mine, ev.pass_k).items()})
    out.update(_stats(samples, ev.pass_k))
    return out


def shown(samples: list[dict], held: HeldOut, count: int) -> dict[str, list[dict]]:
    """The first `count` samples of each data source, with their prompt's last message, for people to read."""
    out: dict[str, list[dict]] = {}
    for s in sorted(samples, key=lambda s: s["index"]):
        some = out.setdefault(s["data_source"], [])
        if len(some) < count:
            some.append({"prompt": held.prompts.messages[s["prompt"]][-1]["content"],
                         **{k: s[k] for k in ("file", "row", "sample", "response", "ground_truth", "reward",
                                              "correct")}})
    return out


def save_samples(samples: list[dict], folder: Path) -> None:
    samples = sorted(samples, key=lambda s: s["index"])
    pq.write_table(pa.table({c: [s[c] for s in samples] for c in SAMPLE_COLUMNS}), folder / "samples.parquet")
