"""The optimizer of a role (policy or critic), built the same way by build and update so DCP states match."""

import torch

from verlflow.core.blueprint import Blueprint


def apply_hparams(opt: torch.optim.Optimizer, bp: Blueprint, *, critic: bool = False) -> None:
    """A loaded optimizer state carries the hyperparameters it was saved with; the blueprint wins, so changing
    algorithm.lr between iterations (or on a rerun) takes effect."""
    a = bp.algorithm
    for group in opt.param_groups:
        group.update(lr=a.critic_lr if critic else a.lr, betas=a.betas, weight_decay=a.weight_decay)


def make_optimizer(model: torch.nn.Module, bp: Blueprint, *, critic: bool = False) -> torch.optim.Optimizer:
    a = bp.algorithm
    params = [p for p in model.parameters() if p.requires_grad]  # model.lora: the adapters only
    # One fused kernel per step on CUDA instead of a for-each op chain over every (DTensor) shard; the state
    # dict is the same, so checkpoints move between fused and not (CPU keeps the reference implementation).
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=a.critic_lr if critic else a.lr, betas=a.betas,
                             weight_decay=a.weight_decay, fused=fused or None)
