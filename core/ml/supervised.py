"""One epoch of a supervised phase (sft, dpo) on the FSDP policy: the shared forward (core/ml/forward.py) and
training step (core/ml/trainstep.py), with the phase's loss.

A mini-batch is `mini_batch_size` units (sft: conversations; dpo: pairs, each a chosen and a rejected row), split
into equal contiguous shares across ranks, then into micro-batches of `micro_batch_size_per_gpu` units. Every
micro-batch's loss is pre-scaled so that, with FSDP averaging gradients over ranks, one optimizer step sees the
mini-batch's mean (sft: over its trained tokens; dpo: over its pairs). Every rank runs the same number of
micro-batches (equal shares), so the collectives inside FSDP's forward and backward always pair up.
"""

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from verlflow.core.blueprint.sections import PhaseSpec, SupervisedSpec
from verlflow.core.errors import InputError
from verlflow.core.ml import trainstep
from verlflow.core.ml.forward import Rows, forward
from verlflow.core.ml.placement import Placement
from verlflow.core.ml.trainstep import Trainee
from verlflow.core import faults

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
    def of(cls, ph: PhaseSpec, seed: int, n_units: int, epoch: int, field: str) -> "Epoch":
        mini = ph.algorithm.mini_batch_size
        if n_units < mini:
            raise InputError(f"{field}: {n_units} rows, fewer than phase '{ph.label}' algorithm.mini_batch_size="
                             f"{mini}; lower the mini-batch or add rows.")
        order = np.arange(n_units)
        if ph.data.shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(n_units)
        # the last partial mini-batch is left out (a different one each shuffled epoch): every step is full-size
        return cls(epoch, [order[i:i + mini].tolist() for i in range(0, n_units - mini + 1, mini)])


def train_epoch(ph: PhaseSpec, policy: Trainee, epoch: Epoch, micro_loss: MicroLoss, at: Placement, step0: int, *,
                defer_grad_sync: bool, progress=None) -> list[dict]:
    """One optimizer step per mini-batch, with the phase's optimizer; returns each step's metrics (means over the
    mini-batch, all ranks)."""
    history = []
    a, opt = ph.algorithm, ph.algorithm.optim
    for index, units in enumerate(epoch.steps):
        t0 = time.perf_counter()
        micro = trainstep.micro_batches(units, at, a.micro_batch_size_per_gpu)
        sums: dict[str, torch.Tensor] = {}

        def loss_of(idx):
            loss, metrics = micro_loss(policy.model, idx, units)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.detach().double()
            return loss

        trainstep.backward(policy, micro, loss_of, defer_sync=defer_grad_sync, world=at.world)
        grad_norm = trainstep.clip(policy.model, opt.grad_clip)
        row = _means(trainstep.sum_over_ranks(sums, at), len(units))
        trainstep.check_finite(lambda: f"{ph.kind}[{ph.label}]: grad norm {float(grad_norm)} / metrics {row} at step "
                               f"{index}; nothing was committed. Lower {ph.label}'s algorithm.lr.",
                               grad_norm, *row.values())
        policy.optimizer.step()
        faults.kill_point(f"{ph.kind}_epoch{epoch.number}", at.rank)  # test hook: kill_rank1_in_dpo_epoch2
        row.update(step=step0 + index + 1, grad_norm=round(float(grad_norm), 6),
                   seconds=round(time.perf_counter() - t0, 3))
        history.append(row)
        if progress:
            progress(f"step {row['step']}: " + " ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                         if k not in ("step", "seconds")))
    return history


def _means(total: dict, n_units: int) -> dict:
    """Metrics summed over every rank's units -> means over the mini-batch (the sums / its units); a metric named
    `*_tokens` is a total, and a `*_per_token` pair (`x_nll_sum`, `x_tokens`) becomes x's mean."""
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
def score_rows(model, batch: dict, a: SupervisedSpec, at: Placement) -> torch.Tensor:
    """Per-token log-probs [N, R] of every row under `model`, on every rank. The rows are split into equal shares
    (the last padded with row 0) so every rank runs as many forwards as the others: FSDP's gathers pair up."""
    model.eval()
    rows = Rows.of(batch)
    n = len(batch["responses"])
    per = -(-n // at.world)
    ids = (list(range(n)) + [0] * (per * at.world - n))[at.rank * per:(at.rank + 1) * per]
    mb = a.micro_batch_size_per_gpu
    local = torch.cat([rows_forward(model, rows, ids[i:i + mb], a, at.device) for i in range(0, per, mb)])
    if at.world > 1:
        parts = [torch.empty_like(local) for _ in range(at.world)]
        dist.all_gather(parts, local.contiguous())
        local = torch.cat(parts)
    return local[:n].cpu()


def rows_forward(model, rows: Rows, idx: list[int], a: SupervisedSpec, device) -> torch.Tensor:
    """Per-token log-probs [len(idx), R] with gradient: the model's own (temperature 1), packed when the phase's
    algorithm.use_remove_padding."""
    return forward(model, rows, idx, device, packed=a.use_remove_padding)[0]
