"""The optimizer of a role (policy or critic), built the same way by build and update so DCP states match."""

import torch

from verlflow.core.blueprint.sections import OptimSpec


def apply_hparams(optimizer: torch.optim.Optimizer, opt: OptimSpec) -> None:
    """A loaded optimizer state carries the hyperparameters it was saved with; the blueprint wins, so changing
    algorithm.lr between iterations (or on a rerun) takes effect."""
    for group in optimizer.param_groups:
        group.update(lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)


def make_optimizer(model: torch.nn.Module, opt: OptimSpec) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # model.lora: the adapters only
    # One fused kernel per step on CUDA instead of a for-each op chain over every (DTensor) shard; the state
    # dict is the same, so checkpoints move between fused and not (CPU keeps the reference implementation).
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay, fused=fused or None)
