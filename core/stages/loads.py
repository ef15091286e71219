"""How a stage's models are read from checkpoint folders: the sharded models it trains, the frozen reference, the
unsharded inference copy.

Part of every stage's key (stages/common.py hands this module to ctx.models, verlflow.core.stages.runtime.models,
which decides whether a warm pool's memory replaces a load): what a load gives is the stage's maths; the runtime
around it is plumbing.
"""

import torch

from verlflow.core.ml import checkpoint
from verlflow.core.ml.optim import make_optimizer
from verlflow.core.stages.runtime.context import StageContext
from verlflow.core.stages.runtime.models import Policy, Trainee


def sharded(ctx: StageContext, meta_dir, critic: bool = False, adapters: bool = False, packed: bool | None = None):
    """An FSDP model whose weights come from a checkpoint load (meta init where FSDP2 allows); `adapters`: the
    policy, with model.lora's adapters when the blueprint has them; `packed`: padding-free rows (default: the rl
    algorithm's use_remove_padding; an sft/dpo phase passes its own)."""
    from verlflow.core.ml import model as M  # here: it loads inductor, which a stage that loads no model skips

    bp = ctx.bp
    packed = bp.algorithm.use_remove_padding if packed is None else packed
    module = M.build_module(meta_dir, bp.model, critic=critic, meta=bp.fsdp.version == 2, packed=packed,
                            adapters=adapters)
    model, rep = M.wrap_fsdp(module, bp.fsdp, ctx.device, bp.algorithm.fused_head)
    problems = M.check_shards(rep, bp.fsdp)
    if problems:
        raise RuntimeError("; ".join(problems))
    return model


def load_trainee(ctx: StageContext, meta_dir, prev, role: str, base) -> Trainee:
    """A role's FSDP model, optimizer and state from the previous checkpoint; a LoRA policy's base weights from
    `base` (the build's plain reference checkpoint)."""
    critic = role == "critic"
    model = sharded(ctx, meta_dir, critic=critic, adapters=role == "policy")
    opt = make_optimizer(model, ctx.bp.algorithm.critic_optim if critic else ctx.bp.algorithm.optim)
    checkpoint.load(prev / role, model, opt, base=base)
    return Trainee(model, opt, checkpoint.read_state(prev / role))


def frozen(ctx: StageContext, meta_dir, folder):
    """A sharded model, not trained, from the checkpoint in `folder` (the build's reference)."""
    model = sharded(ctx, meta_dir)
    checkpoint.load(folder, model)
    return model


def frozen_copy(ctx: StageContext, meta_dir, policy):
    """A sharded model holding the policy's current weights (shard to shard: no gather, no file)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ref = sharded(ctx, meta_dir)
    set_model_state_dict(ref, get_model_state_dict(policy))
    return ref


def inference_copy(ctx: StageContext, policy: Policy, into=None):
    """The policy's weights in an unsharded model of the inference dtype: `into` (an earlier copy) refilled from the
    weights in memory, else a new model filled from them or from the policy's checkpoint."""
    from verlflow.core.ml import model as M

    model = into
    if model is None:
        # Filled from memory, tensor by tensor, it is built in the inference dtype: never a whole model in the
        # policy's dtype beside the policy. From a checkpoint it loads in the model's dtype (a LoRA merge runs on
        # those weights) and is cast after, as before: both give the same tensors.
        spec = ctx.bp.model
        if policy.trained is not None:
            spec = spec.model_copy(update={"dtype": M.dtype_name(M.inference_dtype(ctx.bp.fsdp))})
        with torch.device(ctx.device):  # random init on the device is fast; the load overwrites it
            model = M.build_module(policy.meta_dir, spec)
        if policy.trained is None:
            checkpoint.load_full(policy.folder, model, base=policy.base_dir)
    if policy.trained is not None:
        checkpoint.copy_full_into(policy.trained.model, model)
    model.to(M.inference_dtype(ctx.bp.fsdp))  # a no-op for the reused copy: its tensors (and graphs) stay
    return model
