"""The FSDP training step that the update (ppo.py) and the supervised phases (supervised.py) share; each keeps its
own loss and metrics.

One optimizer step: this rank's micro-batches of the step's samples, fresh gradients from their backward passes
(with fsdp.defer_grad_sync only the last reduce-scatters), the norm clipped (a DTensor norm made whole), a
non-finite norm or metric refused before the optimizer steps, and the step's metrics summed over ranks in one read.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from verlflow.core.errors import NonFiniteError
from verlflow.core.ml.placement import Placement


@dataclass(frozen=True)
class Trainee:
    """A model being trained and its optimizer."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def micro_batches(ids: list[int], at: Placement, size: int) -> list[list[int]]:
    """This rank's contiguous share of `ids`, in micro-batches of `size`."""
    mine = ids[at.share(len(ids))]
    return [mine[i:i + size] for i in range(0, len(mine), size)]


def backward(trainee: Trainee, micro: list[list[int]], loss_of: Callable[[list[int]], torch.Tensor], *,
             defer_sync: bool, world: int) -> None:
    """The gradients of the summed losses of the micro-batches, from zero: loss_of(idx).backward() for each."""
    trainee.model.train()
    trainee.optimizer.zero_grad(set_to_none=True)
    for j, idx in enumerate(micro):
        _grad_sync(trainee.model, defer_sync and world > 1, last=j == len(micro) - 1)
        loss_of(idx).backward()


def _grad_sync(model, defer: bool, *, last: bool) -> None:
    """fsdp.defer_grad_sync: only the last micro-batch's backward reduce-scatters (FSDP2; FSDP1 has no per-call
    switch outside its no_sync context, so it always syncs)."""
    if defer and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


def clip(model, max_norm: float) -> torch.Tensor:
    """Clip the gradients to `max_norm`; their norm before the clip, a CPU float tensor."""
    if type(model).__name__ == "FullyShardedDataParallel":
        norm = model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float().cpu()


def check_finite(message: Callable[[], str], *values) -> None:
    """A non-finite grad norm or metric fails the stage before anything is committed; `message` says where (built
    only then: it may read device tensors)."""
    if not all(math.isfinite(float(v)) for v in values):
        raise NonFiniteError(message())


def sum_over_ranks(values: dict, at: Placement) -> dict[str, float]:
    """Each value (a device tensor or a float) summed over the ranks, in float64, with one device-to-host read."""
    keys = sorted(values)
    local = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=at.device) for k in keys])
    if at.world > 1:
        dist.all_reduce(local)
    return dict(zip(keys, local.cpu().tolist()))
