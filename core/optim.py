"""The optimizer of a role (policy or critic), built the same way by build and update so DCP states match."""

import torch

from core.blueprint import Blueprint


def make_optimizer(model: torch.nn.Module, bp: Blueprint, *, critic: bool = False) -> torch.optim.Optimizer:
    a = bp.algorithm
    return torch.optim.AdamW(model.parameters(), lr=a.critic_lr if critic else a.lr, betas=a.betas,
                             weight_decay=a.weight_decay)
