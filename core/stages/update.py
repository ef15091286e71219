"""update: old/ref log-probs, advantages, PPO epochs on the FSDP policy (and critic), a new DCP checkpoint.

Inputs: `build` (hf_meta/, ref/), `policy` (policy/ [+ critic/]), `rollout` (batch). Outputs: policy/ [+ critic/].
"""

import logging

from verlflow.core.ml import checkpoint, model as M, ppo
from verlflow.core.stages import modelcache
from verlflow.core.ml.optim import apply_hparams, make_optimizer
from verlflow.core.ml.rollout import load_batch
from verlflow.core.stages.common import StageContext, stage_main

log = logging.getLogger("verlflow.update")


def sharded(ctx: StageContext, meta_dir, critic: bool = False):
    """An FSDP model whose weights come from a checkpoint load (meta init where FSDP2 allows)."""
    module = M.build_module(meta_dir, ctx.bp, critic=critic, meta=ctx.bp.fsdp.version == 2,
                            packed=ctx.bp.algorithm.use_remove_padding)
    model, rep = M.wrap_fsdp(module, ctx.bp, ctx.device)
    problems = M.check_shards(rep, ctx.bp)
    if problems:
        raise RuntimeError("; ".join(problems))
    return model


def _load(ctx: StageContext, meta_dir, prev, role: str):
    """A role's FSDP model and optimizer from the previous checkpoint."""
    critic = role == "critic"
    model = sharded(ctx, meta_dir, critic=critic)
    opt = make_optimizer(model, ctx.bp, critic=critic)
    checkpoint.load(prev / role, model, opt)
    return model, opt


def run(ctx: StageContext) -> dict:
    bp, it = ctx.bp, ctx.iteration
    build = ctx.input("build")
    meta_dir = build / "hf_meta"
    batch = load_batch(ctx.input("rollout"))
    gae = bp.algorithm.adv_estimator == "gae"
    args = (ctx.rank, ctx.world, ctx.device)
    with ctx.timed("ref_s"):
        ref = modelcache.get("ref", ctx.identity("build"))
        if ref is None:
            ref = sharded(ctx, meta_dir)
            checkpoint.load(build / "ref", ref)
            modelcache.put("ref", ctx.identity("build"), ref)
        ref_logp = ppo.score_all(ref, batch, bp, *args)
        del ref
    with ctx.timed("load_s"):
        # In a warm pool the previous update's models are still in memory (core/stages/modelcache.py); its files may
        # still be being written in the background, and are not needed then.
        cached = modelcache.get("policy", ctx.identity("policy"))
        if cached is not None:
            policy, popt, state = cached
        else:
            prev = ctx.input("policy")
            policy, popt = _load(ctx, meta_dir, prev, "policy")
            state = checkpoint.read_state(prev / "policy")
        apply_hparams(popt, bp)
        critic = copt = values = None
        if gae:
            critic, copt = modelcache.get("critic", ctx.identity("policy")) or _load(
                ctx, meta_dir, ctx.input("policy"), "critic")
            apply_hparams(copt, bp, critic=True)
    with ctx.timed("old_logp_s"):
        old_logp = ppo.score_all(policy, batch, bp, *args)
        if gae:
            values = ppo.score_all(critic, batch, bp, *args, critic=True)
    adv, ret, adv_metrics = ppo.advantages(bp, batch, old_logp, ref_logp, values)
    with ctx.timed("train_s"):
        history, step = ppo.train(bp, batch, old_logp, ref_logp, adv, ret, policy, popt, *args, iteration=it,
                                  step=state["step"], critic=critic, copt=copt, values=values,
                                  progress=log.info if ctx.is_main() else None)
    new_state = {**state, "step": step, "data_cursor": state["data_cursor"] + bp.data.batch_size, "iteration": it}
    with ctx.timed("save_s"):
        checkpoint.save(ctx.out / "policy", policy, popt, new_state, ctx.background())
        modelcache.put("policy", ctx.identity(), (policy, popt, new_state))
        if gae:
            checkpoint.save(ctx.out / "critic", critic, copt, new_state, ctx.background())
            modelcache.put("critic", ctx.identity(), (critic, copt))
    last = history[-1]
    return {**adv_metrics, "step": step, "mini_batches": history, "pg_loss": last["pg_loss"],
            "kl_loss": last["kl_loss"], "entropy": last["entropy"], "pg_clipfrac": last["pg_clipfrac"],
            "grad_norm": last["grad_norm"], "tokens_per_s": last["tokens_per_s"]}


main = stage_main(run)

if __name__ == "__main__":
    main()
