"""monolithic: the same K iterations as the staged pipeline, in one torchrun job with models kept in memory.

The reference for "staged equals monolithic" (same final weights) and for the cost of stage boundaries.
Input: `build` (hf_meta/, policy/, ref/ [, critic/]). Output: policy/ (DCP), metrics per iteration.
"""

import logging

import torch
import torch.distributed as dist

from verlflow.core.ml import checkpoint, model as M, ppo
from verlflow.core.ml.data import load_prompts, select
from verlflow.core.ml.optim import apply_hparams, make_optimizer
from verlflow.core.ml.rollout import generate_share, load_batch, save_batch
from verlflow.core.stages.common import StageContext, stage_main
from verlflow.core.stages.update import sharded

log = logging.getLogger("verlflow.monolithic")


def run(ctx: StageContext) -> dict:
    bp = ctx.bp
    build = ctx.input("build")
    meta_dir = build / "hf_meta"
    tok = M.load_tokenizer(meta_dir)
    data = load_prompts(bp.data.train_files, bp.data.prompt_key)
    gae = bp.algorithm.adv_estimator == "gae"
    args = (ctx.rank, ctx.world, ctx.device)

    ref = sharded(ctx, meta_dir)
    checkpoint.load(build / "ref", ref)
    policy = sharded(ctx, meta_dir)
    popt = make_optimizer(policy, bp)
    state = checkpoint.load(build / "policy", policy, popt)
    apply_hparams(popt, bp)
    critic = copt = None
    if gae:
        critic = sharded(ctx, meta_dir, critic=True)
        copt = make_optimizer(critic, bp, critic=True)
        checkpoint.load(build / "critic", critic, copt)
        apply_hparams(copt, bp, critic=True)
    with torch.device(ctx.device):
        infer = M.build_module(meta_dir, bp)
    infer.to(M.inference_dtype(bp))

    per_iter = []
    for it in range(1, bp.iterations + 1):
        rows = select(len(data), state["data_cursor"], bp.data.batch_size, bp.seed, bp.data.shuffle).tolist()
        with ctx.timed("rollout_s"):
            infer.load_state_dict(checkpoint.full_state_dict(policy))
            mine = generate_share(infer, tok, bp, data.take(rows), rows, it, *args)
            parts = [None] * ctx.world
            dist.all_gather_object(parts, mine)
        # The batch goes through the same file format as the staged path (so both see identical tensors).
        batch_dir = ctx.out / "batches" / str(it)
        stats = [None]
        if ctx.is_main():
            batch_dir.mkdir(parents=True, exist_ok=True)
            stats[0] = save_batch([s for p in parts for s in p], batch_dir, tok.pad_token_id,
                                  bp.rollout.max_new_tokens)
        dist.broadcast_object_list(stats)
        stats = stats[0]
        batch = load_batch(batch_dir)
        with ctx.timed("update_s"):
            ref_logp = ppo.score_all(ref, batch, bp, *args)
            old_logp = ppo.score_all(policy, batch, bp, *args)
            values = ppo.score_all(critic, batch, bp, *args, critic=True) if gae else None
            adv, ret, _ = ppo.advantages(bp, batch, old_logp, ref_logp, values)
            history, step = ppo.train(bp, batch, old_logp, ref_logp, adv, ret, policy, popt, *args, iteration=it,
                                      step=state["step"], critic=critic, copt=copt, values=values)
        state = {**state, "step": step, "data_cursor": state["data_cursor"] + bp.data.batch_size, "iteration": it}
        per_iter.append({"iteration": it, "reward_mean": stats["reward_mean"], "pg_loss": history[-1]["pg_loss"],
                         "rollout_s": round(ctx.timings["rollout_s"] - sum(p["rollout_s"] for p in per_iter), 4),
                         "update_s": round(ctx.timings["update_s"] - sum(p["update_s"] for p in per_iter), 4)})
        log.info("monolithic[%d]: reward mean %.4f", it, stats["reward_mean"])
    with ctx.timed("save_s"):
        checkpoint.save(ctx.out / "policy", policy, popt, state)
        if gae:
            checkpoint.save(ctx.out / "critic", critic, copt, state)
    with ctx.timed("export_s"):  # the HF export the checkpoint stage writes, from the weights in memory
        full = checkpoint.full_state_dict(policy)  # collective: every rank
        if ctx.is_main():
            export = M.empty_module(meta_dir, bp)
            export.load_state_dict(full)
            export.config.use_cache = True
            export.save_pretrained(ctx.out / "hf", safe_serialization=True)
        if ctx.world > 1:
            dist.barrier()
    return {"iterations": per_iter, "step": state["step"]}


main = stage_main(run)

if __name__ == "__main__":
    main()
