"""PPO/GRPO maths on a rollout batch, with verl's core_algos doing the estimators and losses.

Every rank holds the whole (small) batch tensors: log-probs are computed for the rank's slice and gathered, so
advantages and mini-batch token counts are the same on every rank without extra collectives.
"""

import inspect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from verlflow.core import algos
from verlflow.core.blueprint.sections import AlgorithmSpec
from verlflow.core.ml import packing, schedule, trainstep
from verlflow.core.ml.forward import Rows, forward
from verlflow.core.ml.placement import Placement
from verlflow.core.ml.trainstep import Trainee
from verlflow.core import faults

log = logging.getLogger("verlflow.ppo")


@dataclass(frozen=True)
class PPOSpec:
    """What the PPO maths reads of a blueprint (the update stage picks it: ppo_spec)."""
    algorithm: AlgorithmSpec
    group_size: int  # rollout.n: samples per prompt
    temperature: float  # rollout.temperature: the log-probs are those of the distribution sampled
    defer_grad_sync: bool  # fsdp.defer_grad_sync
    seed: int  # orders each epoch's mini-batches
    total_steps: int  # policy optimizer steps of the run: the length the learning-rate schedule spans


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


def trained(batch: dict) -> torch.Tensor:
    """The response tokens the update trains on, [N, R] float: an agent batch's `loss_mask` (the model's own
    tokens, not the observations between its turns), else every response token. The forward keeps
    `response_mask` for attention and positions."""
    return batch.get("loss_mask", batch["response_mask"]).float()


def token_rewards(batch: dict, mask: torch.Tensor) -> torch.Tensor:
    """Each response token's reward, [N, R]: an agent batch's per-turn rewards, else the score on the last
    response token. Either way a sample's rewards sum to its score, which grpo, rloo, ... compare."""
    if "token_rewards" in batch:
        return batch["token_rewards"].float().clone()
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(last)), last] = batch["scores"]
    return rewards


def micro_batches(a: AlgorithmSpec, batch: dict, ids, at: Placement, *, forward_only: bool = False
                  ) -> list[list[int]]:
    """This rank's micro-batches of the samples `ids`: fixed counts of ppo_micro_batch_size_per_gpu, or, packed,
    token budgets balanced across ranks (the same number of micro-batches on every rank)."""
    ids = [int(i) for i in ids]
    if not a.use_remove_padding:
        return trainstep.micro_batches(ids, at, a.ppo_micro_batch_size_per_gpu)
    sizes = packing.lengths(batch)
    budget, field = a.ppo_max_token_len_per_gpu or a.ppo_micro_batch_size_per_gpu * int(sizes.max()), \
        "algorithm.ppo_max_token_len_per_gpu"
    if forward_only:
        budget, field = a.log_prob_max_token_len_per_gpu or 2 * budget, "algorithm.log_prob_max_token_len_per_gpu"
    return packing.plan(ids, {i: int(sizes[i]) for i in ids}, at.world, at.rank, budget, field)


def _forward(model, rows: Rows, idx, spec: PPOSpec, device, critic: bool = False, pi2: bool = False):
    return forward(model, rows, idx, device, temperature=spec.temperature,
                   packed=spec.algorithm.use_remove_padding, critic=critic, pi2=pi2)


@torch.no_grad()
def score_all(model, batch: dict, spec: PPOSpec, at: Placement, critic: bool = False, pi2: bool = False):
    """Per-token log-probs (or values) of every sample: each rank does its slice, then all ranks share. With `pi2`,
    also each token's sum of squared probabilities (same forward): a pair of [N, R] tensors."""
    model.eval()
    rows = Rows.of(batch)
    N = len(batch["responses"])
    micro = micro_batches(spec.algorithm, batch, range(N), at, forward_only=True)
    parts = 2 if pi2 else 1
    if spec.algorithm.use_remove_padding:  # token-balanced: rows are not a contiguous slice, so sum disjoint rows
        full = torch.zeros(parts, N, rows.R, device=at.device)
        for idx in micro:
            out = _forward(model, rows, idx, spec, at.device, critic, pi2)
            for k in range(parts):
                full[k, idx] = out[k]
        if at.world > 1:
            dist.all_reduce(full)
    else:
        outs = [_forward(model, rows, idx, spec, at.device, critic, pi2) for idx in micro]
        local = torch.stack([torch.cat([o[k] for o in outs]) for k in range(parts)]).to(at.device)
        if at.world > 1:
            gathered = [torch.empty_like(local) for _ in range(at.world)]
            dist.all_gather(gathered, local)
            local = torch.cat(gathered, dim=1)
        full = local
    full = full.cpu()
    return (full[0], full[1]) if pi2 else full[0]


def old_logprobs(policy, batch: dict, spec: PPOSpec, at: Placement) -> torch.Tensor:
    """The PPO ratio's old log-probs: the rollout's own (algorithm.old_logprobs=rollout: the sampling logits' fp32
    log-probs; the policy the rollout sampled from is the one the update starts from) or a forward pass of the
    policy. The optimal-token-baseline estimators also take each token's sum of squared probabilities from that
    pass: it lands in batch["sum_pi_squared"]."""
    a = spec.algorithm
    if a.old_logprobs == "recompute":
        if a.adv_estimator in algos.SUM_PI_SQUARED:
            logp, batch["sum_pi_squared"] = score_all(policy, batch, spec, at, pi2=True)
            return logp
        return score_all(policy, batch, spec, at)
    if "rollout_logp" not in batch:
        raise ValueError("algorithm.old_logprobs=rollout: the rollout batch has no rollout_logp (an older verlflow "
                         "made it); rerun its rollout or set algorithm.old_logprobs=recompute")
    return batch["rollout_logp"] * trained(batch)


def advantages(a: AlgorithmSpec, batch: dict, old_logp, ref_logp, values=None
               ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token-level rewards (score on the last response token, minus KL when in reward) -> verl estimator."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    mask = trained(batch)
    rewards = token_rewards(batch, mask)
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


def prepare(a: AlgorithmSpec, batch: dict, old_logp, ref_logp, values=None, *, iteration: int
            ) -> tuple[PPOBatch, dict]:
    """The batch `train` takes: the rollout batch with its log-probs, values and advantages; plus the metrics of
    the advantage computation."""
    adv, ret, metrics = advantages(a, batch, old_logp, ref_logp, values)
    if values is not None:
        metrics["vf_explained_var"] = explained_variance(values, ret, trained(batch))
    weights = None
    if a.rollout_correction:
        weights, gap = rollout_correction(a, batch, old_logp)
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


def rollout_correction(a: AlgorithmSpec, batch: dict, old_logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """algorithm.rollout_correction: verl's truncated importance weights of the recomputed old log-probs against the
    rollout's own (per token or per sequence, padding 0), and its mismatch metrics under verl's flat names
    (rollout_corr/kl, ...: KL, perplexities, the weights' spread). Every rank holds the whole batch and its gathered
    old log-probs: every rank computes the same."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if "rollout_logp" not in batch:
        raise ValueError("algorithm.rollout_correction: the rollout batch has no rollout_logp (an older verlflow, or "
                         "a sampler that could not record them, made it); rerun its rollout or set "
                         "algorithm.rollout_correction=false")
    mask = trained(batch)
    proto, _, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_logp.float(), rollout_log_prob=batch["rollout_logp"].float(), response_mask=mask,
        rollout_is=a.rollout_is, rollout_is_threshold=a.rollout_is_band)
    return proto.batch["rollout_is_weights"], {k: float(v) for k, v in metrics.items()}  # "rollout_corr/<name>"


def actor_config(a: AlgorithmSpec, group_size: int):
    """verl's ActorConfig as its policy losses read it: clip ranges, aggregation, and each loss's own knobs."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    correction = RolloutCorrectionConfig(rollout_is=a.rollout_is, rollout_is_threshold=a.rollout_is_band,
                                         bypass_mode=a.policy_loss == "bypass_mode", loss_type=a.bypass_loss_type)
    loss = PolicyLossConfig(loss_mode=a.policy_loss, clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb,
                            clip_cov_ub=a.clip_cov_ub, kl_cov_ratio=a.kl_cov_ratio, ppo_kl_coef=a.ppo_kl_coef,
                            dro_beta=a.dro_beta, rollout_correction=correction)
    return ActorConfig(strategy="fsdp", rollout_n=group_size, ppo_mini_batch_size=a.ppo_mini_batch_size,
                       ppo_micro_batch_size_per_gpu=a.ppo_micro_batch_size_per_gpu, ppo_epochs=a.ppo_epochs,
                       clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                       clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_dynamic_bsz=False,
                       ppo_max_token_len_per_gpu=1 << 30, policy_loss=loss, tau_pos=a.tau_pos, tau_neg=a.tau_neg)


def _alloc_retries(device) -> int | None:
    """How often the CUDA caching allocator had to free its cache and retry a malloc (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def train(spec: PPOSpec, models: Models, data: PPOBatch, at: Placement, progress=None) -> list[dict]:
    """ppo_epochs x mini-batches x micro-batches; advances `models.step`; returns per-mini-batch metrics."""
    a = spec.algorithm
    update = _Update(spec, data, at)
    N = len(update.mask)
    mini = a.ppo_mini_batch_size * spec.group_size
    history, minis = [], -(-N // mini)
    for epoch in range(a.ppo_epochs):
        order = torch.from_numpy(np.random.default_rng([spec.seed, data.iteration, epoch]).permutation(N))
        for m0 in range(0, N, mini):
            row = update.mini_batch(models, order[m0:m0 + mini], epoch, m0 // mini)
            history.append(row)
            if progress:  # counted from 1, of their totals, as a training log reads
                progress(f"epoch {epoch + 1}/{a.ppo_epochs} mini-batch {m0 // mini + 1}/{minis}: "
                         f"pg_loss {row['pg_loss']:.4f} "
                         f"kl {row['kl_loss']:.4f} grad_norm {row['grad_norm']:.4f} {row['tokens_per_s']:.0f} tok/s"
                         + (f", {row['alloc_retries']} allocator retries" if row.get("alloc_retries") else ""))
    return history


class _Update:
    """One PPO batch's optimizer steps: what every mini-batch of it shares."""

    def __init__(self, spec: PPOSpec, data: PPOBatch, at: Placement):
        from verl.trainer.ppo import core_algos

        self.spec, self.a, self.optim, self.data, self.at = spec, spec.algorithm, spec.algorithm.optim, data, at
        self.rows = Rows.of(data.tensors)
        self.mask = trained(data.tensors)
        self.cfg = actor_config(self.a, spec.group_size)
        self.loss_fn = core_algos.get_policy_loss_fn(self.a.policy_loss)
        self.inject_nan = faults.requested("nan_loss")  # a fault point (reliability suite)

    def mini_batch(self, models: Models, ids, epoch: int, index: int) -> dict:
        """One optimizer step of the policy (and critic) on the samples `ids`; its metrics, averaged over ranks."""
        t0, retries = time.perf_counter(), _alloc_retries(self.at.device)
        micro = micro_batches(self.a, self.data.tensors, ids, self.at)
        info = {"dp_size": self.at.world, "batch_num_tokens": int(self.mask[ids].sum().item()),
                "global_batch_size": len(ids)}
        self.cfg.global_batch_info.update(info)
        policy = models.policy
        acc = self._policy_grads(policy, micro, info)
        grad_norm = trainstep.clip(policy.model, self.optim.grad_clip)
        trainstep.check_finite(lambda: (
            f"update[{self.data.iteration}]: policy grad norm is {grad_norm.item()} at epoch {epoch}, mini-batch "
            f"{index} (pg_loss={float(acc['pg_loss'])}); nothing was committed. Lower algorithm.lr or check rewards."
        ), grad_norm)
        lr = schedule.set_lr(policy.optimizer, self.optim, self.spec.total_steps, models.step)
        policy.optimizer.step()
        models.step += 1
        faults.kill_point("update", self.at.rank)  # test hook: VERLFLOW_FAULT=kill_rank<N>_in_update
        if models.critic is not None:
            schedule.set_lr(models.critic.optimizer, self.a.critic_optim, self.spec.total_steps, models.step - 1)
            acc.update(self._critic_step(models.critic, micro, info))
        # every entry was pre-divided by world: the sum is the mean over ranks
        row = {k: round(v, 6) for k, v in trainstep.sum_over_ranks(acc, self.at).items()}
        dt = time.perf_counter() - t0
        row.update(epoch=epoch, mini_batch=index, step=models.step, grad_norm=round(float(grad_norm), 6),
                   lr=lr,
                   tokens_per_s=round(info["batch_num_tokens"] / max(dt, 1e-9), 1))
        if retries is not None:  # a slow mini-batch with retries was short of GPU memory, not of compute
            row["alloc_retries"] = _alloc_retries(self.at.device) - retries
        trainstep.check_finite(lambda: f"update[{self.data.iteration}]: loss is {row['pg_loss']}; nothing was "
                               "committed.", row["pg_loss"])
        return row

    def _policy_grads(self, policy: Trainee, micro: list[list[int]], info: dict) -> dict:
        """Backward over the micro-batches; the loss terms summed as device tensors, each pre-divided by world."""
        world, n_micro = self.at.world, len(micro)
        acc = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl_loss": 0.0, "entropy": 0.0}

        def loss_of(idx):
            logp, ent = _forward(policy.model, self.rows, idx, self.spec, self.at.device)
            loss, terms = self._policy_loss(logp, ent, idx, info)
            # Device tensors, read once per mini-batch: a .item() here would stall the host every micro-batch.
            for k in ("pg_loss", "entropy", "kl_loss"):
                if k in terms:
                    acc[k] += terms[k] / world
            acc["pg_clipfrac"] += terms["pg_clipfrac"] / n_micro / world
            acc["ppo_kl"] += terms["ppo_kl"] / n_micro / world
            return loss

        trainstep.backward(policy, micro, loss_of, defer_sync=self.spec.defer_grad_sync, world=world)
        return acc

    def _policy_loss(self, logp, ent, idx, info: dict) -> tuple[torch.Tensor, dict]:
        """verl's policy loss (+ entropy bonus, + KL loss) of one micro-batch, and its terms (detached)."""
        from verl.trainer.ppo import core_algos

        a, dev, d = self.a, self.at.device, self.data
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

        a, dev, d, world = self.a, self.at.device, self.data, self.at.world
        n_micro = len(micro)
        acc = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0}

        def loss_of(idx):
            vpreds, _ = _forward(critic.model, self.rows, idx, self.spec, dev, critic=True)
            m = self.mask[idx].to(dev)
            vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                vpreds=vpreds, returns=d.ret[idx].to(dev), values=d.values[idx].to(dev), response_mask=m,
                cliprange_value=a.cliprange_value, loss_agg_mode=a.loss_agg_mode, **info)
            acc["vf_loss"] += vf_loss.detach() / world
            acc["vf_clipfrac"] += float(vf_clipfrac) / n_micro / world
            # the mini-batch's token mean over all ranks (the ranks' parts add up: not divided by world)
            acc["vpred_mean"] += (vpreds.detach() * m).sum() / info["batch_num_tokens"]
            return a.vf_coef * vf_loss

        trainstep.backward(critic, micro, loss_of, defer_sync=self.spec.defer_grad_sync, world=world)
        norm = trainstep.clip(critic.model, a.critic_optim.grad_clip)
        trainstep.check_finite(lambda: f"critic grad norm is {norm.item()}; nothing was committed. Lower "
                               "algorithm.critic_lr.", norm)
        critic.optimizer.step()
        return {**acc, "critic_grad_norm": float(norm) / world}
