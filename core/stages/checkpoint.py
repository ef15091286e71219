"""checkpoint: export the iteration's policy as an HF safetensors folder, then promote it and apply retention.

Inputs: `build` (hf_meta/), `update` (policy/), `rollout` (its metrics rank the checkpoint). Output: hf/.
Promotion happens after this stage's manifest is committed: `latest` never points at a half-written export.
"""

import logging

from verlflow.core.ml import checkpoint, model as M
from verlflow.core.stages import modelcache
from verlflow.core.stages.build import copy_meta
from verlflow.core.stages.common import StageContext, retention_pass, stage_main
from verlflow.core.store.promote import promote

log = logging.getLogger("verlflow.checkpoint")


def run(ctx: StageContext) -> dict:
    meta_dir = ctx.input("build") / "hf_meta"  # on every rank: input() is collective in a multi-rank job
    # A warm pool's update, still in memory: exported from there while its files are written in the background.
    cached = modelcache.get("policy", ctx.identity("update"))
    policy_dir = ctx.input("update") / "policy" if cached is None else None
    full = checkpoint.full_state_dict(cached[0]) if cached is not None else None  # collective: every rank
    if not ctx.is_main():  # one rank exports (this stage gets several only in a warm pool)
        return {}
    with ctx.timed("export_s"):
        model = M.empty_module(meta_dir, ctx.bp)
        if full is not None:
            model.load_state_dict(full)
        else:
            checkpoint.load_full(policy_dir, model)
        model.config.use_cache = True
        model.save_pretrained(ctx.out / "hf", safe_serialization=True)
        copy_meta(meta_dir, ctx.out / "hf")
    state = checkpoint.read_state(policy_dir) if cached is None else cached[2]
    rollout = ctx.input_manifest("rollout").metrics
    return {"step": state["step"], "data_cursor": state["data_cursor"], "reward_mean": rollout.get("reward_mean"),
            "reward_std": rollout.get("reward_std")}


def after_commit(ctx: StageContext, manifest: dict) -> None:
    promote(ctx.store, ctx.bp, ctx.job, manifest)
    retention_pass(ctx)  # after the pointers moved: what they named before may go now


main = stage_main(run, after_commit)

if __name__ == "__main__":
    main()
