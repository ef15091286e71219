"""update: old/ref log-probs, advantages, PPO epochs on the FSDP policy (and critic), a new DCP checkpoint.

Inputs: `build` (hf_meta/, ref/), `policy` (policy/ [+ critic/]), `rollout` (batch). Outputs: policy/ [+ critic/].
"""

import logging

from verlflow.core.ml import checkpoint, lora, model as M, ppo
from verlflow.core.ml.optim import apply_hparams, make_optimizer
from verlflow.core.ml.rollout import load_batch
from verlflow.core.stages import modelcache
from verlflow.core.stages.common import StageContext, retention_pass, stage_main

log = logging.getLogger("verlflow.update")


def sharded(ctx: StageContext, meta_dir, critic: bool = False, adapters: bool = False):
    """An FSDP model whose weights come from a checkpoint load (meta init where FSDP2 allows); `adapters`: the
    policy, with model.lora's adapters when the blueprint has them."""
    module = M.build_module(meta_dir, ctx.bp, critic=critic, meta=ctx.bp.fsdp.version == 2,
                            packed=ctx.bp.algorithm.use_remove_padding, adapters=adapters)
    model, rep = M.wrap_fsdp(module, ctx.bp, ctx.device)
    problems = M.check_shards(rep, ctx.bp)
    if problems:
        raise RuntimeError("; ".join(problems))
    return model


def load_trainee(ctx: StageContext, meta_dir, prev, role: str, base) -> ppo.Trainee:
    """A role's FSDP model and optimizer from the previous checkpoint; a LoRA policy's base weights from `base` (the
    build's plain reference checkpoint)."""
    critic = role == "critic"
    model = sharded(ctx, meta_dir, critic=critic, adapters=role == "policy")
    opt = make_optimizer(model, ctx.bp, critic=critic)
    checkpoint.load(prev / role, model, opt, base=base)
    return ppo.Trainee(model, opt)


def _ref_logp(ctx: StageContext, build, batch: dict, policy, policy_logp) -> tuple:
    """Log-probs under the frozen reference, and where the reference came from: a warm pool's memory ("cache"),
    the build's checkpoint, or the policy itself ("policy"). An update that starts from the build's policy is
    scored by it: the build wrote its policy and its reference from the same weights (the model folder, or the
    warm start), so their log-probs are one (`policy_logp` when the policy was scored, else scored now), and a warm
    pool keeps a copy of the policy's weights as the reference for later updates instead of reading it back."""
    if ctx.bp.model.lora is not None:  # the base model is the policy with its adapters off: no second copy
        with lora.disabled(policy):
            return ppo.score_all(policy, batch, ctx.bp, ctx.placement), "base"
    key = ctx.identity("build")
    ref = modelcache.get("ref", key)
    if ref is not None:
        return ppo.score_all(ref, batch, ctx.bp, ctx.placement), "cache"
    if ctx.job.inputs["policy"] == ctx.job.inputs["build"]:
        if modelcache.enabled():
            modelcache.put("ref", key, _frozen_copy(ctx, build / "hf_meta", policy))
        if policy_logp is None:
            policy_logp = ppo.score_all(policy, batch, ctx.bp, ctx.placement)
        return policy_logp, "policy"
    ref = sharded(ctx, build / "hf_meta")
    checkpoint.load(build / "ref", ref)
    modelcache.put("ref", key, ref)
    return ppo.score_all(ref, batch, ctx.bp, ctx.placement), "checkpoint"


def _frozen_copy(ctx: StageContext, meta_dir, policy):
    """A sharded model holding the policy's current weights (shard to shard: no gather, no file)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ref = sharded(ctx, meta_dir)
    set_model_state_dict(ref, get_model_state_dict(policy))
    return ref


def _models(ctx: StageContext, meta_dir) -> tuple[ppo.Models, dict]:
    """The policy (and critic) to train and the policy checkpoint's state. In a warm pool the previous update's
    models are still in memory (core/stages/modelcache.py); its files may still be being written in the
    background, and are not needed then."""
    bp = ctx.bp
    cached = modelcache.get("policy", ctx.identity("policy"))
    if cached is not None:
        policy, state = ppo.Trainee(*cached[:2]), cached[2]
    else:
        prev = ctx.input("policy")
        policy = load_trainee(ctx, meta_dir, prev, "policy", base=ctx.input("build") / "ref")
        state = checkpoint.read_state(prev / "policy")
    apply_hparams(policy.optimizer, bp)
    critic = None
    if bp.algorithm.adv_estimator == "gae":
        cached = modelcache.get("critic", ctx.identity("policy"))
        critic = ppo.Trainee(*cached) if cached else load_trainee(ctx, meta_dir, ctx.input("policy"), "critic",
                                                                   base=None)
        apply_hparams(critic.optimizer, bp, critic=True)
    return ppo.Models(policy, critic, step=state["step"]), state


def _save(ctx: StageContext, models: ppo.Models, state: dict) -> str:
    """How the policy was saved: "inline", or through a CPU copy "refilled", "reserved" (by the build) or "made"."""
    policy, critic = models.policy, models.critic
    how = checkpoint.save(ctx.out / "policy", policy.model, policy.optimizer, state, ctx.background())
    modelcache.put("policy", ctx.identity(), (policy.model, policy.optimizer, state))
    if critic is not None:
        checkpoint.save(ctx.out / "critic", critic.model, critic.optimizer, state, ctx.background())
        modelcache.put("critic", ctx.identity(), (critic.model, critic.optimizer))
    return how


def run(ctx: StageContext) -> dict:
    bp, it, at = ctx.bp, ctx.iteration, ctx.placement
    build = ctx.input("build")
    batch = load_batch(ctx.input("rollout"))
    with ctx.timed("load_s"):
        models, state = _models(ctx, build / "hf_meta")
    with ctx.timed("old_logp_s"):
        old_logp = ppo.old_logprobs(models.policy.model, batch, bp, at)
        values = None if models.critic is None else ppo.score_all(models.critic.model, batch, bp, at, critic=True)
    with ctx.timed("ref_s"):
        scored = old_logp if bp.algorithm.old_logprobs == "recompute" else None
        ref_logp, ref_source = _ref_logp(ctx, build, batch, models.policy.model, scored)
    data, adv_metrics = ppo.prepare(bp, batch, old_logp, ref_logp, values, iteration=it)
    with ctx.timed("train_s"):
        history = ppo.train(bp, models, data, at, progress=log.info if ctx.is_main() else None)
    consumed = int(batch["prompts_consumed"][0]) if "prompts_consumed" in batch else bp.data.batch_size
    new_state = {**state, "step": models.step, "data_cursor": state["data_cursor"] + consumed,
                 "iteration": it}
    with ctx.timed("save_s"):
        save_copy = _save(ctx, models, new_state)
    return {**adv_metrics, **ppo.update_metrics(history), "step": models.step, "ref_source": ref_source,
            "save_copy": save_copy, "mini_batches": history}


main = stage_main(run, retention_pass)  # the older checkpoints go once this one is committed

if __name__ == "__main__":
    main()
