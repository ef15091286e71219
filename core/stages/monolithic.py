"""monolithic: the same K iterations as the staged pipeline, in one torchrun job with models kept in memory.

The reference for "staged equals monolithic" (same final weights) and for the cost of stage boundaries.
Input: `build` (hf_meta/, policy/, ref/ [, critic/]). Output: policy/ (DCP), metrics per iteration.
"""

import logging

import torch
import torch.distributed as dist

from verlflow.core.ml import checkpoint, export, model as M, ppo
from verlflow.core.ml.data import load_prompts
from verlflow.core.ml.optim import apply_hparams
from verlflow.core.ml.rollout import load_batch, save_batch
from verlflow.core.stages.common import StageContext, stage_main
from verlflow.core.stages.collect import collect
from verlflow.core.stages.loads import load_trainee, sharded
from verlflow.core.stages.update import ppo_spec

log = logging.getLogger("verlflow.monolithic")


def _trainee(ctx: StageContext, build, role: str) -> ppo.Trainee:
    """A role's FSDP model and optimizer from the build stage's checkpoint, with the blueprint's hyperparameters."""
    trainee = load_trainee(ctx, build / "hf_meta", build, role, base=build / "ref")
    a = ctx.bp.algorithm
    apply_hparams(trainee.optimizer, a.critic_optim if role == "critic" else a.optim)
    return trainee


def _as_batch(ctx: StageContext, got, tok, it: int) -> tuple[dict, dict]:
    """The samples through the same file format as the staged path (so both see identical tensors), and their
    statistics."""
    batch_dir = ctx.out / "batches" / str(it)
    stats = [None]
    if ctx.is_main():
        batch_dir.mkdir(parents=True, exist_ok=True)
        stats[0] = save_batch(got.samples, batch_dir, tok.pad_token_id, ctx.bp.rollout.max_new_tokens,
                              got.prompts_consumed)
    dist.broadcast_object_list(stats)
    return load_batch(batch_dir), stats[0]


def _update(ctx: StageContext, ref, models: ppo.Models, batch: dict, it: int) -> list[dict]:
    spec, at = ppo_spec(ctx.bp), ctx.placement
    ref_logp = ppo.score_all(ref, batch, spec, at)
    old_logp = ppo.old_logprobs(models.policy.model, batch, spec, at)
    values = None if models.critic is None else ppo.score_all(models.critic.model, batch, spec, at, critic=True)
    data, _ = ppo.prepare(spec.algorithm, batch, old_logp, ref_logp, values, iteration=it)
    return ppo.train(spec, models, data, at)


def _export(ctx: StageContext, policy, meta_dir) -> None:
    """The HF export the export stage writes (in storage.export_dtype), from the weights in memory."""
    full = checkpoint.full_state_dict(policy)  # collective: every rank
    if ctx.is_main():
        dtype = export.export_dtype(ctx.bp.storage, ctx.bp.model, meta_dir)
        export.write_export(export.export_model(meta_dir, ctx.bp.model, dtype, full=full), meta_dir, ctx.out / "hf",
                            dtype)
    if ctx.world > 1:
        dist.barrier()


def run(ctx: StageContext) -> dict:
    bp = ctx.bp
    build = ctx.input("build")
    meta_dir = build / "hf_meta"
    tok = M.load_tokenizer(meta_dir)
    data = load_prompts(bp.data.train_files, bp.data.prompt_key)

    ref = sharded(ctx, meta_dir)
    checkpoint.load(build / "ref", ref)
    policy = _trainee(ctx, build, "policy")
    state = checkpoint.read_state(build / "policy")
    critic = _trainee(ctx, build, "critic") if bp.algorithm.adv_estimator == "gae" else None
    models = ppo.Models(policy, critic, step=state["step"])
    with torch.device(ctx.device):
        infer = M.build_module(meta_dir, bp.model)
    infer.to(M.inference_dtype(bp.fsdp))

    per_iter = []
    for it in range(1, bp.iterations + 1):
        with ctx.timed("rollout_s"):
            checkpoint.copy_full_into(policy.model, infer)
            got = collect(ctx, infer, tok, data, state["data_cursor"], it, data_seed=state.get("data_seed"))
        batch, stats = _as_batch(ctx, got, tok, it)
        with ctx.timed("update_s"):
            history = _update(ctx, ref, models, batch, it)
        state = {**state, "step": models.step, "data_cursor": state["data_cursor"] + got.prompts_consumed,
                 "iteration": it}
        per_iter.append({"iteration": it, "reward_mean": stats["reward_mean"], "pg_loss": history[-1]["pg_loss"],
                         "rollout_s": round(ctx.timings["rollout_s"] - sum(p["rollout_s"] for p in per_iter), 4),
                         "update_s": round(ctx.timings["update_s"] - sum(p["update_s"] for p in per_iter), 4)})
        log.info("monolithic[%d]: reward mean %.4f", it, stats["reward_mean"])
    with ctx.timed("save_s"):
        for role, trainee in (("policy", policy), ("critic", critic)):
            if trainee is not None:
                checkpoint.save(ctx.out / role, trainee.model, trainee.optimizer, state)
    with ctx.timed("export_s"):
        _export(ctx, policy.model, meta_dir)
    return {"iterations": per_iter, "step": state["step"]}


main = stage_main(run)

if __name__ == "__main__":
    main()
