"""PPO/GRPO maths on a rollout batch, with verl's core_algos doing the estimators and losses.

Every rank holds the whole (small) batch tensors: log-probs are computed for the rank's slice and gathered, so
advantages and mini-batch token counts are the same on every rank without extra collectives.
"""

import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from verlflow.core.testing import faults
from verlflow.core.ml import packing
from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import NonFiniteError
from verlflow.core.ml.rollout import rank_slice

log = logging.getLogger("verlflow.ppo")


def sequences(batch: dict) -> dict:
    """input_ids, attention_mask, position_ids for prompt + response; P = prompt width, R = response width."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def _forward(model, seq: dict, idx, device, P: int, R: int, temperature: float, critic: bool = False):
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    inputs = {k: v[idx].to(device) for k, v in seq.items()}
    if critic:
        return model(**inputs).logits[:, P - 1:P - 1 + R].float().squeeze(-1), None
    if _fused(model):
        return model(**inputs, use_cache=False, ppo_keep=slice(P - 1, P - 1 + R),
                     ppo_labels=inputs["input_ids"][:, P:P + R], ppo_temperature=temperature or 1.0)
    # Only the R positions that predict response tokens: the last R + 1 logits, minus the final one.
    logits = model(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    labels = inputs["input_ids"][:, P:P + R]
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def _forward_packed(model, batch: dict, idx, device, R: int, temperature: float, critic: bool = False):
    """_forward over one padding-free row; returns the same [len(idx), R] layout (zeros on response padding)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    pk = packing.pack(batch, idx).to(device)
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
    logp, ent = logprobs_from_logits(logits[None], pk.labels[None])[0], entropy_from_logits(logits)
    return pk.unpack(logp, len(idx), R), pk.unpack(ent, len(idx), R)


def _fused(model) -> bool:
    """The policy carries core/fusedhead's forward (algorithm.use_fused_kernels)."""
    return getattr(model, "_verlflow_fused", False)  # FSDP1's wrapper forwards unknown attributes to the module


def micro_batches(bp: Blueprint, batch: dict, ids, rank: int, world: int, *, forward_only: bool = False
                  ) -> list[list[int]]:
    """This rank's micro-batches of the samples `ids`: fixed counts of ppo_micro_batch_size_per_gpu, or, packed,
    token budgets balanced across ranks (the same number of micro-batches on every rank)."""
    ids = [int(i) for i in ids]
    a = bp.algorithm
    if not a.use_remove_padding:
        mine = ids[rank_slice(len(ids), rank, world)]
        mb = a.ppo_micro_batch_size_per_gpu
        return [mine[i:i + mb] for i in range(0, len(mine), mb)]
    sizes = packing.lengths(batch)
    budget, field = a.ppo_max_token_len_per_gpu or a.ppo_micro_batch_size_per_gpu * int(sizes.max()), \
        "algorithm.ppo_max_token_len_per_gpu"
    if forward_only:
        budget, field = a.log_prob_max_token_len_per_gpu or 2 * budget, "algorithm.log_prob_max_token_len_per_gpu"
    return packing.plan(ids, {i: int(sizes[i]) for i in ids}, world, rank, budget, field)


def _micro_forward(model, batch: dict, seq: dict, idx, bp: Blueprint, device, P: int, R: int, critic: bool = False):
    t = 1.0 if critic else bp.rollout.temperature
    if bp.algorithm.use_remove_padding:
        return _forward_packed(model, batch, idx, device, R, t, critic)
    return _forward(model, seq, idx, device, P, R, t, critic)


@torch.no_grad()
def score_all(model, batch: dict, bp: Blueprint, rank: int, world: int, device, critic: bool = False) -> torch.Tensor:
    """Per-token log-probs (or values) of every sample: each rank does its slice, then all ranks share."""
    model.eval()
    seq = sequences(batch)
    N, R = batch["responses"].shape
    P = batch["prompts"].shape[1]
    micro = micro_batches(bp, batch, range(N), rank, world, forward_only=True)
    if bp.algorithm.use_remove_padding:  # token-balanced: rows are not a contiguous slice, so sum disjoint rows
        full = torch.zeros(N, R, device=device)
        for idx in micro:
            full[idx] = _micro_forward(model, batch, seq, idx, bp, device, P, R, critic)[0]
        if world > 1:
            dist.all_reduce(full)
        return full.cpu()
    local = torch.cat([_micro_forward(model, batch, seq, idx, bp, device, P, R, critic)[0] for idx in micro]).to(device)
    if world == 1:
        return local.cpu()
    full = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(full, local)
    return torch.cat(full).cpu()


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
    if a.adv_estimator == "gae":
        adv, ret = fn(token_level_rewards=rewards, values=values, response_mask=mask, gamma=a.gamma, lam=a.lam)
    else:
        index = batch["group"].numpy()
        adv, ret = fn(token_level_rewards=rewards, response_mask=mask, index=index, config=cfg,
                      norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo)
    return adv, ret, metrics


def actor_config(bp: Blueprint):
    from verl.workers.config import ActorConfig

    a = bp.algorithm
    return ActorConfig(strategy="fsdp", rollout_n=bp.rollout.n, ppo_mini_batch_size=a.ppo_mini_batch_size,
                       ppo_micro_batch_size_per_gpu=a.ppo_micro_batch_size_per_gpu, ppo_epochs=a.ppo_epochs,
                       clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                       clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_dynamic_bsz=False,
                       ppo_max_token_len_per_gpu=1 << 30)


def _grad_sync(model, bp: Blueprint, world: int, *, last: bool) -> None:
    """fsdp.defer_grad_sync: only the last micro-batch's backward reduce-scatters (FSDP2; FSDP1 has no per-call
    switch outside its no_sync context, so it always syncs)."""
    if bp.fsdp.defer_grad_sync and world > 1 and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


def _clip(model, max_norm: float) -> torch.Tensor:
    if type(model).__name__ == "FullyShardedDataParallel":
        norm = model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float().cpu()


def train(bp: Blueprint, batch: dict, old_logp, ref_logp, adv, ret, policy, popt, rank: int, world: int, device,
          iteration: int, step: int, critic=None, copt=None, values=None, progress=None) -> tuple[list[dict], int]:
    """ppo_epochs x mini-batches x micro-batches; returns per-mini-batch metrics and the new step count."""
    from verl.trainer.ppo import core_algos

    a = bp.algorithm
    seq = sequences(batch)
    N, R = batch["responses"].shape
    P = batch["prompts"].shape[1]
    mask = batch["response_mask"].float()
    mini = a.ppo_mini_batch_size * bp.rollout.n
    cfg = actor_config(bp)
    loss_fn = core_algos.get_policy_loss_fn(a.policy_loss)
    history = []
    inject_nan = os.environ.get("VERLFLOW_FAULT") == "nan_loss"  # test hook (reliability suite)
    for epoch in range(a.ppo_epochs):
        order = torch.from_numpy(np.random.default_rng([bp.seed, iteration, epoch]).permutation(N))
        for m0 in range(0, N, mini):
            t0 = time.perf_counter()
            ids = order[m0:m0 + mini]
            micro = micro_batches(bp, batch, ids, rank, world)
            info = {"dp_size": world, "batch_num_tokens": int(mask[ids].sum().item()), "global_batch_size": len(ids)}
            cfg.global_batch_info.update(info)
            policy.train()
            popt.zero_grad(set_to_none=True)
            acc = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl_loss": 0.0, "entropy": 0.0}
            n_micro = len(micro)
            for j, idx in enumerate(micro):
                _grad_sync(policy, bp, world, last=j == n_micro - 1)
                logp, ent = _micro_forward(policy, batch, seq, idx, bp, device, P, R)
                m = mask[idx].to(device)
                pg_loss, pg_metrics = loss_fn(old_log_prob=old_logp[idx].to(device), log_prob=logp,
                                              advantages=adv[idx].to(device), response_mask=m,
                                              loss_agg_mode=a.loss_agg_mode, config=cfg)
                loss = pg_loss
                ent_loss = core_algos.agg_loss(ent, m, a.loss_agg_mode, **info)
                if a.entropy_coeff:
                    loss = loss - a.entropy_coeff * ent_loss
                if a.use_kl_loss:
                    kld = core_algos.kl_penalty(logp, ref_logp[idx].to(device), a.kl_loss_type)
                    kl_loss = core_algos.agg_loss(kld, m, a.loss_agg_mode, **info)
                    loss = loss + a.kl_loss_coef * kl_loss
                    acc["kl_loss"] += kl_loss.detach() / world
                if inject_nan:
                    loss = loss * float("nan")
                loss.backward()
                # Device tensors, read once per mini-batch: a .item() here would stall the host every micro-batch.
                acc["pg_loss"] += pg_loss.detach() / world
                acc["entropy"] += ent_loss.detach() / world
                acc["pg_clipfrac"] += pg_metrics["actor/pg_clipfrac"] / n_micro / world
                acc["ppo_kl"] += pg_metrics["actor/ppo_kl"] / n_micro / world
            grad_norm = _clip(policy, a.grad_clip)
            if not torch.isfinite(grad_norm):
                raise NonFiniteError(
                    f"update[{iteration}]: policy grad norm is {grad_norm.item()} at epoch {epoch}, mini-batch "
                    f"{m0 // mini} (pg_loss={float(acc['pg_loss'])}); nothing was committed. Lower algorithm.lr or check rewards."
                )
            popt.step()
            step += 1
            faults.kill_point("update", rank)  # test hook: VERLFLOW_FAULT=kill_rank<N>_in_update
            if critic is not None:
                acc.update(_critic_step(bp, critic, copt, batch, seq, micro, mask, values, ret, info, device, P, R))
            # One device-to-host read for all of them (floats from verl's metrics join as device scalars).
            stats = torch.stack([torch.as_tensor(acc[k], dtype=torch.float64, device=device)
                                 for k in sorted(acc)]).cpu()
            if world > 1:
                dist.all_reduce(stats)  # every entry was pre-divided by world: the sum is the mean over ranks
            row = {k: round(float(v), 6) for k, v in zip(sorted(acc), stats)}
            dt = time.perf_counter() - t0
            row.update(epoch=epoch, mini_batch=m0 // mini, step=step, grad_norm=round(float(grad_norm), 6),
                       lr=popt.param_groups[0]["lr"],
                       tokens_per_s=round(info["batch_num_tokens"] / max(dt, 1e-9), 1))
            if not math.isfinite(row["pg_loss"]):
                raise NonFiniteError(f"update[{iteration}]: loss is {row['pg_loss']}; nothing was committed.")
            history.append(row)
            if progress:
                progress(f"epoch {epoch} mini-batch {m0 // mini}: pg_loss {row['pg_loss']:.4f} "
                         f"kl {row['kl_loss']:.4f} grad_norm {row['grad_norm']:.4f} {row['tokens_per_s']:.0f} tok/s")
    return history, step


def _critic_step(bp, critic, copt, batch, seq, micro, mask, values, ret, info, device, P, R) -> dict:
    world = info["dp_size"]
    from verl.trainer.ppo import core_algos

    a = bp.algorithm
    critic.train()
    copt.zero_grad(set_to_none=True)
    vf_loss_sum, clipfrac = 0.0, 0.0
    n_micro = len(micro)
    for j, idx in enumerate(micro):
        _grad_sync(critic, bp, world, last=j == n_micro - 1)
        vpreds, _ = _micro_forward(critic, batch, seq, idx, bp, device, P, R, critic=True)
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, returns=ret[idx].to(device), values=values[idx].to(device), response_mask=mask[idx].to(device),
            cliprange_value=a.cliprange_value, loss_agg_mode=a.loss_agg_mode, **info)
        (a.vf_coef * vf_loss).backward()
        vf_loss_sum += vf_loss.detach() / world
        clipfrac += float(vf_clipfrac) / n_micro / world
    norm = _clip(critic, a.grad_clip)
    if not torch.isfinite(norm):
        raise NonFiniteError(f"critic grad norm is {norm.item()}; nothing was committed. Lower algorithm.critic_lr.")
    copt.step()
    return {"vf_loss": vf_loss_sum, "vf_clipfrac": clipfrac, "critic_grad_norm": float(norm) / world}
