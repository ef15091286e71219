"""The learning-rate schedule, by verl's own functions: the lr of optimizer step `step` (0-based over the run).

Stateless: the position is the step count the policy checkpoint holds, so a rerun, a warm pool and a world-size
change all land on the same lr (a LambdaLR's state would have to travel with the optimizer's instead).
"""

import torch

from verlflow.core.blueprint.sections import OptimSpec


def warmup_steps(opt: OptimSpec, total_steps: int) -> int:
    if opt.lr_warmup_steps >= 0:
        return opt.lr_warmup_steps
    return int(opt.lr_warmup_steps_ratio * total_steps)


def lr_factor(opt: OptimSpec, total_steps: int, step: int) -> float:
    """verl's multiplier of opt.lr at 0-based optimizer step `step` of `total_steps` (its LambdaLR is stepped after
    each optimizer step, so step 0 runs at lambda(0))."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # only the lambda is read
    if opt.lr_scheduler_type == "cosine":
        sched = get_cosine_schedule_with_warmup(dummy, warmup_steps(opt, total_steps), total_steps,
                                                min_lr_ratio=opt.min_lr_ratio, num_cycles=opt.num_cycles)
    else:
        sched = get_constant_schedule_with_warmup(dummy, warmup_steps(opt, total_steps))
    return float(sched.lr_lambdas[0](step))


def set_lr(optimizer: torch.optim.Optimizer, opt: OptimSpec, total_steps: int, step: int) -> float:
    lr = opt.lr * lr_factor(opt, total_steps, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
