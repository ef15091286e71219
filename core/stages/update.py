"""update: old/ref log-probs, advantages, PPO epochs on the FSDP policy (and critic), a new DCP checkpoint.

Inputs: `build` (hf_meta/, ref/), `policy` (policy/ [+ critic/]), `rollout` (batch). Outputs: policy/ [+ critic/].
"""

import logging

from verlflow.core.blueprint import Blueprint
from verlflow.core.ml import checkpoint, lora, ppo
from verlflow.core.ml.optim import apply_hparams
from verlflow.core.ml.rollout import load_batch
from verlflow.core.stages.common import StageContext, retention_pass, stage_main

log = logging.getLogger("verlflow.update")


def ppo_spec(bp: Blueprint) -> ppo.PPOSpec:
    """What the PPO maths reads of the blueprint."""
    return ppo.PPOSpec(bp.algorithm, group_size=bp.rollout.n, temperature=bp.rollout.temperature,
                       defer_grad_sync=bp.fsdp.defer_grad_sync, seed=bp.seed, total_steps=bp.optimizer_steps())


def _ref_logp(ctx: StageContext, batch: dict, policy, policy_logp) -> tuple:
    """Log-probs under the frozen reference, and where the reference came from: the base model ("base", LoRA), a
    warm pool's memory ("cache"), the build's checkpoint, or the policy itself ("policy"). An update that starts
    from the build's policy is scored by it: the build wrote its policy and its reference from the same weights
    (the model folder, or the warm start), so their log-probs are one (`policy_logp` when the policy was scored,
    else scored now)."""
    spec = ppo_spec(ctx.bp)
    if ctx.bp.model.lora is not None:  # the base model is the policy with its adapters off: no second copy
        with lora.disabled(policy):
            return ppo.score_all(policy, batch, spec, ctx.placement), "base"
    from_build = ctx.job.inputs["policy"] == ctx.job.inputs["build"]
    ref = ctx.models.frozen("ref", policy=policy if from_build else None)
    if ref.model is policy and policy_logp is not None:
        return policy_logp, ref.source
    return ppo.score_all(ref.model, batch, spec, ctx.placement), ref.source


def _models(ctx: StageContext) -> ppo.Models:
    """The policy (and critic) to train, with the blueprint's hyperparameters."""
    a = ctx.bp.algorithm
    policy = ctx.models.trainee("policy")
    apply_hparams(policy.optimizer, a.optim)
    critic = None
    if a.adv_estimator == "gae":
        critic = ctx.models.trainee("critic")
        apply_hparams(critic.optimizer, a.critic_optim)
    return ppo.Models(policy, critic, step=policy.state["step"])


def _save(ctx: StageContext, models: ppo.Models, state: dict) -> str:
    """How the policy was saved: "inline", or through a CPU copy "refilled", "reserved" (by the build) or "made".
    Its models stay for the next stages (a warm pool)."""
    how = {}
    for role, trainee in (("policy", models.policy), ("critic", models.critic)):
        if trainee is not None:
            how[role] = checkpoint.save(ctx.out / role, trainee.model, trainee.optimizer, state, ctx.write)
            ctx.models.keep(role, trainee.model, trainee.optimizer, state)
    return how["policy"]


def run(ctx: StageContext) -> dict:
    bp, it, at = ctx.bp, ctx.iteration, ctx.placement
    spec = ppo_spec(bp)
    batch = load_batch(ctx.input("rollout"))
    with ctx.timed("load_s"):
        models = _models(ctx)
        state = models.policy.state
    with ctx.timed("old_logp_s"):
        old_logp = ppo.old_logprobs(models.policy.model, batch, spec, at)
        values = None if models.critic is None else ppo.score_all(models.critic.model, batch, spec, at, critic=True)
    with ctx.timed("ref_s"):
        scored = old_logp if bp.algorithm.old_logprobs == "recompute" else None
        ref_logp, ref_source = _ref_logp(ctx, batch, models.policy.model, scored)
    data, adv_metrics = ppo.prepare(bp.algorithm, batch, old_logp, ref_logp, values, iteration=it)
    with ctx.timed("train_s"):
        history = ppo.train(spec, models, data, at, progress=log.info if ctx.is_main() else None)
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
