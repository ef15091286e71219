"""The learning-rate schedule, by verl's own functions: the lr of optimizer step `step` (0-based over the run).

Stateless: the position is the step count the policy checkpoint holds, so a rerun, a warm pool and a world-size
change all land on the same lr (a LambdaLR's state would have to travel with the optimizer's instead).
"""

import torch

from verlflow.core.blueprint import Blueprint


def warmup_steps(bp: Blueprint) -> int:
    a = bp.algorithm
    if a.lr_warmup_steps >= 0:
        return a.lr_warmup_steps
    return int(a.lr_warmup_steps_ratio * bp.optimizer_steps())


def lr_factor(bp: Blueprint, step: int) -> float:
    """verl's multiplier of algorithm.lr at 0-based optimizer step `step` (its LambdaLR is stepped after each
    optimizer step, so step 0 runs at lambda(0))."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    a = bp.algorithm
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # only the lambda is read
    if a.lr_scheduler_type == "cosine":
        sched = get_cosine_schedule_with_warmup(dummy, warmup_steps(bp), bp.optimizer_steps(),
                                                min_lr_ratio=a.min_lr_ratio, num_cycles=a.num_cycles)
    else:
        sched = get_constant_schedule_with_warmup(dummy, warmup_steps(bp))
    return float(sched.lr_lambdas[0](step))


def set_lr(optimizer: torch.optim.Optimizer, base_lr: float, bp: Blueprint, step: int) -> float:
    lr = base_lr * lr_factor(bp, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
