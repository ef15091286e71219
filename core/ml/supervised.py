"""One epoch of a supervised phase (sft, dpo) on the FSDP policy: the rl update's forward, packing, gradient sync
and clipping, with the phase's loss.

A mini-batch is `mini_batch_size` units (sft: conversations; dpo: pairs, each a chosen and a rejected row), split
into equal contiguous shares across ranks, then into micro-batches of `micro_batch_size_per_gpu` units. Every
micro-batch's loss is pre-scaled so that, with FSDP averaging gradients over ranks, one optimizer step sees the
mini-batch's mean (sft: over its trained tokens; dpo: over its pairs). Every rank runs the same number of
micro-batches (equal shares), so the collectives inside FSDP's forward and backward always pair up.
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import InputError, NonFiniteError
from verlflow.core.ml import ppo
from verlflow.core.ml.placement import Placement
from verlflow.core.testing import faults

log = logging.getLogger("verlflow.supervised")

# (policy model, this micro-batch's units, the whole mini-batch's units) -> (its loss, pre-scaled as the module doc
# says; metrics summed over its units)
MicroLoss = Callable[[torch.nn.Module, list[int], list[int]], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class Epoch:
    """Which units each optimizer step of an epoch trains on (the same on every rank: seeded by the blueprint)."""
    number: int  # 1-based
    steps: list[list[int]]

    @classmethod
    def of(cls, bp: Blueprint, n_units: int, epoch: int, field: str) -> "Epoch":
        ph = bp.phase
        mini = ph.algorithm.mini_batch_size
        if n_units < mini:
            raise InputError(f"{field}: {n_units} rows, fewer than phase '{ph.label}' algorithm.mini_batch_size="
                             f"{mini}; lower the mini-batch or add rows.")
        order = np.arange(n_units)
        if ph.data.shuffle:
            order = np.random.default_rng([bp.seed, epoch]).permutation(n_units)
        # the last partial mini-batch is left out (a different one each shuffled epoch): every step is full-size
        return cls(epoch, [order[i:i + mini].tolist() for i in range(0, n_units - mini + 1, mini)])


def micro_batches(units: list[int], at: Placement, micro: int) -> list[list[int]]:
    """This rank's share of a mini-batch's units, in micro-batches."""
    mine = units[at.share(len(units))]
    return [mine[i:i + micro] for i in range(0, len(mine), micro)]


def train_epoch(bp: Blueprint, policy: ppo.Trainee, epoch: Epoch, micro_loss: MicroLoss, at: Placement,
                step0: int, progress=None) -> list[dict]:
    """One optimizer step per mini-batch; returns each step's metrics (means over the mini-batch, all ranks)."""
    history = []
    a = bp.phase.algorithm
    for index, units in enumerate(epoch.steps):
        t0 = time.perf_counter()
        policy.model.train()
        policy.optimizer.zero_grad(set_to_none=True)
        micro = micro_batches(units, at, a.micro_batch_size_per_gpu)
        sums: dict[str, torch.Tensor] = {}
        for j, idx in enumerate(micro):
            ppo._grad_sync(policy.model, bp, at.world, last=j == len(micro) - 1)
            loss, metrics = micro_loss(policy.model, idx, units)
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.detach().double()
        grad_norm = ppo._clip(policy.model, a.grad_clip)
        row = _mean_over_ranks(sums, len(units), at)
        if not torch.isfinite(grad_norm) or not all(math.isfinite(v) for v in row.values()):
            raise NonFiniteError(f"{bp.phase.kind}[{bp.phase.label}]: grad norm {float(grad_norm)} / metrics {row} at "
                                 f"step {index}; nothing was committed. Lower {bp.phase.label}'s algorithm.lr.")
        policy.optimizer.step()
        faults.kill_point(f"{bp.phase.kind}_epoch{epoch.number}", at.rank)  # test hook: kill_rank1_in_dpo_epoch2
        row.update(step=step0 + index + 1, grad_norm=round(float(grad_norm), 6),
                   seconds=round(time.perf_counter() - t0, 3))
        history.append(row)
        if progress:
            progress(f"step {row['step']}: " + " ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                         if k not in ("step", "seconds")))
    return history


def _mean_over_ranks(sums: dict, n_units: int, at: Placement) -> dict:
    """Metrics summed over this rank's units -> means over the mini-batch (sums over every rank / its units);
    a metric named `*_tokens` is a total, and a `*_per_token` pair (`x_nll_sum`, `x_tokens`) becomes x's mean."""
    keys = sorted(sums)
    local = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys]).to(at.device)
    if at.world > 1:
        dist.all_reduce(local)
    total = dict(zip(keys, local.cpu().tolist()))
    out = {}
    for k, v in total.items():
        if k.endswith("_nll_sum"):
            name = k.removesuffix("_nll_sum")
            tokens = total.get(f"{name}_tokens", 0.0)
            out[f"{name}_loss"] = v / tokens if tokens else 0.0
        elif k.endswith("_tokens"):
            out[k] = v
        else:
            out[k] = v / n_units
    return out


@torch.no_grad()
def score_rows(model, batch: dict, bp: Blueprint, at: Placement) -> torch.Tensor:
    """Per-token log-probs [N, R] of every row under `model`, on every rank. The rows are split into equal shares
    (the last padded with row 0) so every rank runs as many forwards as the others: FSDP's gathers pair up."""
    model.eval()
    rows = ppo.Rows.of(batch)
    n = len(batch["responses"])
    per = -(-n // at.world)
    ids = (list(range(n)) + [0] * (per * at.world - n))[at.rank * per:(at.rank + 1) * per]
    mb = bp.phase.algorithm.micro_batch_size_per_gpu
    local = torch.cat([rows_forward(model, rows, ids[i:i + mb], bp, at.device) for i in range(0, per, mb)])
    if at.world > 1:
        parts = [torch.empty_like(local) for _ in range(at.world)]
        dist.all_gather(parts, local.contiguous())
        local = torch.cat(parts)
    return local[:n].cpu()


def rows_forward(model, rows: ppo.Rows, idx: list[int], bp: Blueprint, device) -> torch.Tensor:
    """Per-token log-probs [len(idx), R] with gradient: the update's forward (packed when the phase's
    algorithm.use_remove_padding). A phase's blueprint samples at temperature 1, so these are the model's own."""
    return ppo._micro_forward(model, rows, idx, bp, device)[0]
