"""PPO/GRPO maths on a rollout batch, with verl's core_algos doing the estimators and losses.

Every rank holds the whole (small) batch tensors: log-probs are computed for the rank's slice and gathered, so
advantages and mini-batch token counts are the same on every rank without extra collectives.
"""

import inspect
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from verlflow.core import algos
from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import NonFiniteError
from verlflow.core.ml import packing, schedule
from verlflow.core.ml.placement import Placement
from verlflow.core.testing import faults

log = logging.getLogger("verlflow.ppo")


@dataclass(frozen=True)
class Trainee:
    """A model being trained and its optimizer."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


@dataclass
class Models:
    """What an update trains: the policy, the critic (gae only), and the optimizer steps taken so far, which
    `train` advances."""
    policy: Trainee
    critic: Trainee | None = None
    step: int = 0


@dataclass(frozen=True)
class PPOBatch:
    """Iteration `iteration`'s rollout batch (prompts, responses, their masks, scores, group) and its per-token
    [N, R] tensors: log-probs under the sampling policy and the reference, advantages, returns, critic values."""
    tensors: dict
    iteration: int
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    adv: torch.Tensor
    ret: torch.Tensor
    values: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # algorithm.rollout_correction: each token's truncated IS weight


def sequences(batch: dict) -> dict:
    """input_ids, attention_mask, position_ids for prompt + response."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


@dataclass(frozen=True)
class Rows:
    """A batch as the model reads it: padded `inputs` (sequences()), or packed from `batch`; P = prompt width,
    R = response width."""
    batch: dict
    inputs: dict
    P: int
    R: int

    @classmethod
    def of(cls, batch: dict) -> "Rows":
        return cls(batch, sequences(batch), batch["prompts"].shape[1], batch["responses"].shape[1])


def _sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """Per token, sum over the vocabulary of p^2 (verl's optimal-token-baseline estimators read it)."""
    return torch.softmax(logits, dim=-1).square().sum(-1)


def _forward(model, rows: Rows, idx, device, temperature: float, critic: bool = False, pi2: bool = False):
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    P, R = rows.P, rows.R
    inputs = {k: v[idx].to(device) for k, v in rows.inputs.items()}
    if critic:
        return model(**inputs).logits[:, P - 1:P - 1 + R].float().squeeze(-1), None
    if _fused(model):
        return model(**inputs, use_cache=False, ppo_keep=slice(P - 1, P - 1 + R),
                     ppo_labels=inputs["input_ids"][:, P:P + R], ppo_temperature=temperature or 1.0)
    # Only the R positions that predict response tokens: the last R + 1 logits, minus the final one.
    logits = model(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    labels = inputs["input_ids"][:, P:P + R]
    return logprobs_from_logits(logits, labels), _sum_pi_squared(logits) if pi2 else entropy_from_logits(logits)


def _forward_packed(model, rows: Rows, idx, device, temperature: float, critic: bool = False, pi2: bool = False):
    """_forward over one padding-free row; returns the same [len(idx), R] layout (zeros on response padding)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    R = rows.R
    pk = packing.pack(rows.batch, idx).to(device)
    if critic:
        values = model(**pk.model_kwargs()).logits[0, pk.logit_idx, 0].float()
        return pk.unpack(values, len(idx), R), None
    if _fused(model):
        logp, ent = model(**pk.model_kwargs(), use_cache=False, ppo_keep=pk.logit_idx, ppo_labels=pk.labels,
                          ppo_temperature=temperature or 1.0)
        return pk.unpack(logp, len(idx), R), pk.unpack(ent, len(idx), R)
    logits = model(**pk.model_kwargs(), use_cache=False, logits_to_keep=pk.logit_idx).logits[0].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    # [1, K, V]: verl's fp32 log-prob loops over the leading dimension, which must not be the K tokens.
    logp = logprobs_from_logits(logits[None], pk.labels[None])[0]
    second = _sum_pi_squared(logits) if pi2 else entropy_from_logits(logits)
    return pk.unpack(logp, len(idx), R), pk.unpack(second, len(idx), R)


def _fused(model) -> bool:
    """The policy carries core/fusedhead's forward (algorithm.use_fused_kernels)."""
    return getattr(model, "_verlflow_fused", False)  # FSDP1's wrapper forwards unknown attributes to the module


def micro_batches(bp: Blueprint, batch: dict, ids, at: Placement, *, forward_only: bool = False) -> list[list[int]]:
    """This rank's micro-batches of the samples `ids`: fixed counts of ppo_micro_batch_size_per_gpu, or, packed,
    token budgets balanced across ranks (the same number of micro-batches on every rank)."""
    ids = [int(i) for i in ids]
    a = bp.algorithm
    if not a.use_remove_padding:
        mine = ids[at.share(len(ids))]
        mb = a.ppo_micro_batch_size_per_gpu
        return [mine[i:i + mb] for i in range(0, len(mine), mb)]
    sizes = packing.lengths(batch)
    budget, field = a.ppo_max_token_len_per_gpu or a.ppo_micro_batch_size_per_gpu * int(sizes.max()), \
        "algorithm.ppo_max_token_len_per_gpu"
    if forward_only:
        budget, field = a.log_prob_max_token_len_per_gpu or 2 * budget, "algorithm.log_prob_max_token_len_per_gpu"
    return packing.plan(ids, {i: int(sizes[i]) for i in ids}, at.world, at.rank, budget, field)


def _micro_forward(model, rows: Rows, idx, bp: Blueprint, device, critic: bool = False, pi2: bool = False):
    from verlflow.core.orchestrate import memplan

    # an out-of-memory error names the micro-batch (core/orchestrate/memplan.py Watch)
    memplan.note(micro_batch_tokens=int(rows.inputs["attention_mask"][idx].sum()), samples=len(idx))
    t = 1.0 if critic else bp.rollout.temperature
    if bp.algorithm.use_remove_padding:
        return _forward_packed(model, rows, idx, device, t, critic, pi2)
    return _forward(model, rows, idx, device, t, critic, pi2)


@torch.no_grad()
def score_all(model, batch: dict, bp: Blueprint, at: Placement, critic: bool = False, pi2: bool = False):
    """Per-token log-probs (or values) of every sample: each rank does its slice, then all ranks share. With `pi2`,
    also each token's sum of squared probabilities (same forward): a pair of [N, R] tensors."""
    model.eval()
    rows = Rows.of(batch)
    N = len(batch["responses"])
    micro = micro_batches(bp, batch, range(N), at, forward_only=True)
    parts = 2 if pi2 else 1
    if bp.algorithm.use_remove_padding:  # token-balanced: rows are not a contiguous slice, so sum disjoint rows
        full = torch.zeros(parts, N, rows.R, device=at.device)
        for idx in micro:
            out = _micro_forward(model, rows, idx, bp, at.device, critic, pi2)
            for k in range(parts):
                full[k, idx] = out[k]
        if at.world > 1:
            dist.all_reduce(full)
    else:
        outs = [_micro_forward(model, rows, idx, bp, at.device, critic, pi2) for idx in micro]
        local = torch.stack([torch.cat([o[k] for o in outs]) for k in range(parts)]).to(at.device)
        if at.world > 1:
            gathered = [torch.empty_like(local) for _ in range(at.world)]
            dist.all_gather(gathered, local)
            local = torch.cat(gathered, dim=1)
        full = local
    full = full.cpu()
    return (full[0], full[1]) if pi2 else full[0]


def old_logprobs(policy, batch: dict, bp: Blueprint, at: Placement) -> torch.Tensor:
    """The PPO ratio's old log-probs: the rollout's own (algorithm.old_logprobs=rollout: the sampling logits' fp32
    log-probs; the policy the rollout sampled from is the one the update starts from) or a forward pass of the
    policy. The optimal-token-baseline estimators also take each token's sum of squared probabilities from that
    pass: it lands in batch["sum_pi_squared"]."""
    if bp.algorithm.old_logprobs == "recompute":
        if bp.algorithm.adv_estimator in algos.SUM_PI_SQUARED:
            logp, batch["sum_pi_squared"] = score_all(policy, batch, bp, at, pi2=True)
            return logp
        return score_all(policy, batch, bp, at)
    if "rollout_logp" not in batch:
        raise ValueError("algorithm.old_logprobs=rollout: the rollout batch has no rollout_logp (an older verlflow "
                         "made it); rerun its rollout or set algorithm.old_logprobs=recompute")
    return batch["rollout_logp"] * batch["response_mask"]


def advantages(bp: Blueprint, batch: dict, old_logp, ref_logp, values=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token-level rewards (score on the last response token, minus KL when in reward) -> verl estimator."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    a = bp.algorithm
    mask = batch["response_mask"].float()
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(last)), last] = batch["scores"]
    metrics = {}
    if a.use_kl_in_reward:
        kl = core_algos.kl_penalty(old_logp, ref_logp, a.kl_penalty) * mask
        rewards = rewards - a.kl_coef * kl
        metrics["kl_in_reward"] = float((kl.sum() / mask.sum()).item())
    fn = core_algos.get_adv_estimator_fn(a.adv_estimator)
    cfg = AlgoConfig(gamma=a.gamma, lam=a.lam, adv_estimator=a.adv_estimator,
                     norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo)
    offered = {"token_level_rewards": rewards, "response_mask": mask, "index": batch["group"].numpy(),
               "config": cfg, "norm_adv_by_std_in_grpo": a.norm_adv_by_std_in_grpo, "gamma": a.gamma, "lam": a.lam,
               "values": values, "old_log_probs": old_logp, "sum_pi_squared": batch.get("sum_pi_squared"),
               "reward_baselines": batch.get("reward_baselines")}
    adv, ret = fn(**_accepted(fn, offered))
    return adv, ret, metrics


def _accepted(fn, offered: dict) -> dict:
    """The arguments of `offered` that verl's estimator names (nothing reaches its **kwargs)."""
    params = inspect.signature(fn).parameters
    named = {k: v for k, v in offered.items() if k in params and v is not None}
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind is not inspect.Parameter.VAR_KEYWORD and named.get(k) is None]
    if missing:  # the blueprint validators refuse these combinations; reaching here is a verlflow bug
        raise RuntimeError(f"verl's {fn.__name__} needs {missing}, which this batch lacks")
    return named


def prepare(bp: Blueprint, batch: dict, old_logp, ref_logp, values=None, *, iteration: int
            ) -> tuple[PPOBatch, dict]:
    """The batch `train` takes: the rollout batch with its log-probs, values and advantages; plus the metrics of
    the advantage computation."""
    adv, ret, metrics = advantages(bp, batch, old_logp, ref_logp, values)
    if values is not None:
        metrics["vf_explained_var"] = explained_variance(values, ret, batch["response_mask"])
    weights = None
    if bp.algorithm.rollout_correction:
        weights, gap = rollout_correction(bp, batch, old_logp)
        metrics.update(gap)
    return PPOBatch(batch, iteration, old_logp, ref_logp, adv, ret, values, weights), metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the returns' variance the critic's values (before this update) explain, over the response
    tokens: verl's critic/vf_explained_var (metric_utils.compute_data_metrics), 1 = perfect, <= 0 = no better than
    their mean."""
    keep = mask.bool()
    ret, val = returns[keep].double(), values[keep].double()
    if ret.numel() < 2:
        return float("nan")
    return float(1.0 - torch.var(ret - val) / (torch.var(ret) + 1e-5))


def update_metrics(history: list[dict]) -> dict:
    """The update stage's loss metrics: the last mini-batch's policy terms and, with a critic, its value terms
    (core/metrics.py names both)."""
    from verlflow.core.metrics import CRITIC_KEYS, UPDATE_KEYS

    last = history[-1]
    return {k: last[k] for k in (*UPDATE_KEYS, *CRITIC_KEYS) if k in last}


def rollout_correction(bp: Blueprint, batch: dict, old_logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """algorithm.rollout_correction: verl's truncated importance weights of the recomputed old log-probs against the
    rollout's own (per token or per sequence, padding 0), and its mismatch metrics under verl's flat names
    (rollout_corr/kl, ...: KL, perplexities, the weights' spread). Every rank holds the whole batch and its gathered
    old log-probs: every rank computes the same."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if "rollout_logp" not in batch:
        raise ValueError("algorithm.rollout_correction: the rollout batch has no rollout_logp (an older verlflow, or "
                         "a sampler that could not record them, made it); rerun its rollout or set "
                         "algorithm.rollout_correction=false")
    a = bp.algorithm
    mask = batch["response_mask"].float()
    proto, _, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_logp.float(), rollout_log_prob=batch["rollout_logp"].float(), response_mask=mask,
        rollout_is=a.rollout_is, rollout_is_threshold=a.rollout_is_band)
    return proto.batch["rollout_is_weights"], {k: float(v) for k, v in metrics.items()}  # "rollout_corr/<name>"


def actor_config(bp: Blueprint):
    """verl's ActorConfig as its policy losses read it: clip ranges, aggregation, and each loss's own knobs."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    a = bp.algorithm
    correction = RolloutCorrectionConfig(rollout_is=a.rollout_is, rollout_is_threshold=a.rollout_is_band,
                                         bypass_mode=a.policy_loss == "bypass_mode", loss_type=a.bypass_loss_type)
    loss = PolicyLossConfig(loss_mode=a.policy_loss, clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb,
                            clip_cov_ub=a.clip_cov_ub, kl_cov_ratio=a.kl_cov_ratio, ppo_kl_coef=a.ppo_kl_coef,
                            dro_beta=a.dro_beta, rollout_correction=correction)
    return ActorConfig(strategy="fsdp", rollout_n=bp.rollout.n, ppo_mini_batch_size=a.ppo_mini_batch_size,
                       ppo_micro_batch_size_per_gpu=a.ppo_micro_batch_size_per_gpu, ppo_epochs=a.ppo_epochs,
                       clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                       clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_dynamic_bsz=False,
                       ppo_max_token_len_per_gpu=1 << 30, policy_loss=loss, tau_pos=a.tau_pos, tau_neg=a.tau_neg)


def _grad_sync(model, bp: Blueprint, world: int, *, last: bool) -> None:
    """fsdp.defer_grad_sync: only the last micro-batch's backward reduce-scatters (FSDP2; FSDP1 has no per-call
    switch outside its no_sync context, so it always syncs)."""
    if bp.fsdp.defer_grad_sync and world > 1 and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


def _alloc_retries(device) -> int | None:
    """How often the CUDA caching allocator had to free its cache and retry a malloc (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def _clip(model, max_norm: float) -> torch.Tensor:
    if type(model).__name__ == "FullyShardedDataParallel":
        norm = model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float().cpu()


def train(bp: Blueprint, models: Models, data: PPOBatch, at: Placement, progress=None) -> list[dict]:
    """ppo_epochs x mini-batches x micro-batches; advances `models.step`; returns per-mini-batch metrics."""
    update = _Update(bp, data, at)
    N = len(update.mask)
    mini = bp.algorithm.ppo_mini_batch_size * bp.rollout.n
    history, minis = [], -(-N // mini)
    for epoch in range(bp.algorithm.ppo_epochs):
        order = torch.from_numpy(np.random.default_rng([bp.seed, data.iteration, epoch]).permutation(N))
        for m0 in range(0, N, mini):
            row = update.mini_batch(models, order[m0:m0 + mini], epoch, m0 // mini)
            history.append(row)
            if progress:  # counted from 1, of their totals, as a training log reads
                progress(f"epoch {epoch + 1}/{bp.algorithm.ppo_epochs} mini-batch {m0 // mini + 1}/{minis}: "
                         f"pg_loss {row['pg_loss']:.4f} "
                         f"kl {row['kl_loss']:.4f} grad_norm {row['grad_norm']:.4f} {row['tokens_per_s']:.0f} tok/s"
                         + (f", {row['alloc_retries']} allocator retries" if row.get("alloc_retries") else ""))
    return history


class _Update:
    """One PPO batch's optimizer steps: what every mini-batch of it shares."""

    def __init__(self, bp: Blueprint, data: PPOBatch, at: Placement):
        from verl.trainer.ppo import core_algos

        self.bp, self.data, self.at = bp, data, at
        self.rows = Rows.of(data.tensors)
        self.mask = data.tensors["response_mask"].float()
        self.cfg = actor_config(bp)
        self.loss_fn = core_algos.get_policy_loss_fn(bp.algorithm.policy_loss)
        self.inject_nan = os.environ.get("VERLFLOW_FAULT") == "nan_loss"  # test hook (reliability suite)

    def mini_batch(self, models: Models, ids, epoch: int, index: int) -> dict:
        """One optimizer step of the policy (and critic) on the samples `ids`; its metrics, averaged over ranks."""
        t0, retries = time.perf_counter(), _alloc_retries(self.at.device)
        micro = micro_batches(self.bp, self.data.tensors, ids, self.at)
        info = {"dp_size": self.at.world, "batch_num_tokens": int(self.mask[ids].sum().item()),
                "global_batch_size": len(ids)}
        self.cfg.global_batch_info.update(info)
        policy = models.policy
        acc = self._policy_grads(policy, micro, info)
        grad_norm = _clip(policy.model, self.bp.algorithm.grad_clip)
        if not torch.isfinite(grad_norm):
            raise NonFiniteError(
                f"update[{self.data.iteration}]: policy grad norm is {grad_norm.item()} at epoch {epoch}, mini-batch "
                f"{index} (pg_loss={float(acc['pg_loss'])}); nothing was committed. Lower algorithm.lr or check rewards."
            )
        lr = schedule.set_lr(policy.optimizer, self.bp.algorithm.lr, self.bp, models.step)
        policy.optimizer.step()
        models.step += 1
        faults.kill_point("update", self.at.rank)  # test hook: VERLFLOW_FAULT=kill_rank<N>_in_update
        if models.critic is not None:
            schedule.set_lr(models.critic.optimizer, self.bp.algorithm.critic_lr, self.bp, models.step - 1)
            acc.update(self._critic_step(models.critic, micro, info))
        row = self._mean_over_ranks(acc)
        dt = time.perf_counter() - t0
        row.update(epoch=epoch, mini_batch=index, step=models.step, grad_norm=round(float(grad_norm), 6),
                   lr=lr,
                   tokens_per_s=round(info["batch_num_tokens"] / max(dt, 1e-9), 1))
        if retries is not None:  # a slow mini-batch with retries was short of GPU memory, not of compute
            row["alloc_retries"] = _alloc_retries(self.at.device) - retries
        if not math.isfinite(row["pg_loss"]):
            raise NonFiniteError(f"update[{self.data.iteration}]: loss is {row['pg_loss']}; nothing was committed.")
        return row

    def _policy_grads(self, policy: Trainee, micro: list[list[int]], info: dict) -> dict:
        """Backward over the micro-batches; the loss terms summed as device tensors, each pre-divided by world."""
        world = self.at.world
        policy.model.train()
        policy.optimizer.zero_grad(set_to_none=True)
        acc = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl_loss": 0.0, "entropy": 0.0}
        n_micro = len(micro)
        for j, idx in enumerate(micro):
            _grad_sync(policy.model, self.bp, world, last=j == n_micro - 1)
            logp, ent = _micro_forward(policy.model, self.rows, idx, self.bp, self.at.device)
            loss, terms = self._policy_loss(logp, ent, idx, info)
            loss.backward()
            # Device tensors, read once per mini-batch: a .item() here would stall the host every micro-batch.
            for k in ("pg_loss", "entropy", "kl_loss"):
                if k in terms:
                    acc[k] += terms[k] / world
            acc["pg_clipfrac"] += terms["pg_clipfrac"] / n_micro / world
            acc["ppo_kl"] += terms["ppo_kl"] / n_micro / world
        return acc

    def _policy_loss(self, logp, ent, idx, info: dict) -> tuple[torch.Tensor, dict]:
        """verl's policy loss (+ entropy bonus, + KL loss) of one micro-batch, and its terms (detached)."""
        from verl.trainer.ppo import core_algos

        a, dev, d = self.bp.algorithm, self.at.device, self.data
        m = self.mask[idx].to(dev)
        weights = None if d.is_weights is None else d.is_weights[idx].to(dev)
        pg_loss, pg_metrics = self.loss_fn(old_log_prob=d.old_logp[idx].to(dev), log_prob=logp,
                                           advantages=d.adv[idx].to(dev), response_mask=m,
                                           loss_agg_mode=a.loss_agg_mode, config=self.cfg, rollout_is_weights=weights)
        loss = pg_loss
        ent_loss = core_algos.agg_loss(ent, m, a.loss_agg_mode, **info)
        if a.entropy_coeff:
            loss = loss - a.entropy_coeff * ent_loss
        # Not every verl loss reports a clip fraction or a KL (gpg, dro...): 0 then.
        terms = {"pg_loss": pg_loss.detach(), "entropy": ent_loss.detach(),
                 "pg_clipfrac": pg_metrics.get("actor/pg_clipfrac", 0.0), "ppo_kl": pg_metrics.get("actor/ppo_kl", 0.0)}
        if a.use_kl_loss:
            kld = core_algos.kl_penalty(logp, d.ref_logp[idx].to(dev), a.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, m, a.loss_agg_mode, **info)
            loss = loss + a.kl_loss_coef * kl_loss
            terms["kl_loss"] = kl_loss.detach()
        if self.inject_nan:
            loss = loss * float("nan")
        return loss, terms

    def _critic_step(self, critic: Trainee, micro: list[list[int]], info: dict) -> dict:
        from verl.trainer.ppo import core_algos

        a, dev, d, world = self.bp.algorithm, self.at.device, self.data, self.at.world
        critic.model.train()
        critic.optimizer.zero_grad(set_to_none=True)
        vf_loss_sum, clipfrac, vpred_sum = 0.0, 0.0, 0.0
        n_micro = len(micro)
        for j, idx in enumerate(micro):
            _grad_sync(critic.model, self.bp, world, last=j == n_micro - 1)
            vpreds, _ = _micro_forward(critic.model, self.rows, idx, self.bp, dev, critic=True)
            m = self.mask[idx].to(dev)
            vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                vpreds=vpreds, returns=d.ret[idx].to(dev), values=d.values[idx].to(dev), response_mask=m,
                cliprange_value=a.cliprange_value, loss_agg_mode=a.loss_agg_mode, **info)
            (a.vf_coef * vf_loss).backward()
            vf_loss_sum += vf_loss.detach() / world
            clipfrac += float(vf_clipfrac) / n_micro / world
            # the mini-batch's token mean over all ranks (the ranks' parts add up: not divided by world)
            vpred_sum += (vpreds.detach() * m).sum() / info["batch_num_tokens"]
        norm = _clip(critic.model, a.grad_clip)
        if not torch.isfinite(norm):
            raise NonFiniteError(f"critic grad norm is {norm.item()}; nothing was committed. Lower algorithm.critic_lr.")
        critic.optimizer.step()
        return {"vf_loss": vf_loss_sum, "vf_clipfrac": clipfrac, "vpred_mean": vpred_sum,
                "critic_grad_norm": float(norm) / world}

    def _mean_over_ranks(self, acc: dict) -> dict:
        """One device-to-host read for all of them (floats from verl's metrics join as device scalars)."""
        keys = sorted(acc)
        stats = torch.stack([torch.as_tensor(acc[k], dtype=torch.float64, device=self.at.device) for k in keys]).cpu()
        if self.at.world > 1:
            dist.all_reduce(stats)  # every entry was pre-divided by world: the sum is the mean over ranks
        return {k: round(float(v), 6) for k, v in zip(keys, stats)}
