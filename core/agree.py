"""Decisions that lead to a collective, made the same way on every rank (runs in a rank).

A rank that decides alone (is a commit still pending here? is this model in my cache?) can take a branch whose
collectives the other ranks never enter: on a loaded machine, one rank's background thread lags and the ranks
deadlock. These helpers turn a per-rank fact into one answer that every rank gets, with one small all-reduce on
the default group (a CPU tensor: gloo carries it, also under "cpu:gloo,cuda:nccl").
"""

import torch
import torch.distributed as dist


def _reduce(flag: bool, op) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=op)
    return bool(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on at least one."""
    return _reduce(flag, dist.ReduceOp.MAX)


def every_rank(flag: bool) -> bool:
    """True on every rank only when it is true on all of them."""
    return _reduce(flag, dist.ReduceOp.MIN)
