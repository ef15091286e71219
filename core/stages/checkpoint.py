"""checkpoint: export the iteration's policy as an HF safetensors folder, then promote it and apply retention.

Inputs: `build` (hf_meta/), `update` (policy/: an update, or the last sft/dpo step of a phased run), `rollout`
(its metrics rank the checkpoint; none after an sft/dpo phase). Output: hf/, in
storage.export_dtype (verlflow.core.ml.export); with model.lora the merged model or, with
storage.export_lora=adapter, the PEFT adapter folder. The pipeline plans it every storage.export_every iterations and at
the last. Promotion happens after this stage's manifest is committed: `latest` never points at a half-written
export. So does, for a run of a recurring chain, promoted or not, the move of the chain's data cursor to where the
export's policy left off (verlflow.core.store.chain). In a warm pool with resources.async_checkpoint the stage only
makes the export's CPU copy; the pool's committer writes it (overlapping the next rollout) before the commit.
"""

import logging
import threading

from verlflow.core.ml import checkpoint, export
from verlflow.core.stages import modelcache
from verlflow.core.stages.common import StageContext, retention_pass, stage_main
from verlflow.core.store.promote import after_export
from verlflow.core.testing import faults

log = logging.getLogger("verlflow.checkpoint")


def run(ctx: StageContext) -> dict:
    build = ctx.input("build")  # on every rank: input() is collective in a multi-rank job
    meta_dir = build / "hf_meta"
    # A warm pool's update, still in memory: exported from there while its files are written in the background.
    cached = modelcache.get("policy", ctx.identity("update"))
    policy_dir = ctx.input("update") / "policy" if cached is None else None
    adapter_only = ctx.bp.model.lora is not None and ctx.bp.storage.export_lora == "adapter"
    full = None
    if cached is not None:  # collective: every rank
        full = checkpoint.full_adapters(cached[0]) if adapter_only else checkpoint.full_state_dict(cached[0])
    if not ctx.is_main():  # one rank exports (this stage gets several only in a warm pool)
        return {}
    dtype = export.export_dtype(ctx.bp, meta_dir)
    written = None
    with ctx.timed("export_copy_s"):
        if adapter_only:
            model = export.AdapterExport(ctx.bp, dtype, adapters=full, policy_dir=policy_dir)
        else:
            # A warm pool keeps the export's CPU model: the next export refills it once this one is written.
            key = (ctx.identity("build"), dtype)
            idle = modelcache.local("export", key, usable=lambda kept: kept[1].is_set()) if full is not None else None
            model = export.export_model(meta_dir, ctx.bp, dtype, full=full, policy_dir=policy_dir,
                                        base_dir=build / "ref", into=idle[0] if idle else None)
            written = threading.Event()
            modelcache.put("export", key, (model, written))
    del full
    background = ctx.background()
    if background is None:
        _write(ctx, model, meta_dir, dtype, written)
    else:
        background.add_write(lambda: _write(ctx, model, meta_dir, dtype, written))
    state = checkpoint.read_state(policy_dir) if cached is None else cached[2]
    # An sft/dpo phase's export has no rollout: its phase's own metrics instead.
    scored = ctx.input_manifest("rollout").metrics if "rollout" in ctx.job.inputs else {}
    return {"step": state["step"], "data_cursor": state.get("data_cursor", 0), "reward_mean": scored.get("reward_mean"),
            "reward_std": scored.get("reward_std"), "export_dtype": dtype}


def _write(ctx: StageContext, model, meta_dir, dtype: str, written: threading.Event | None = None) -> None:
    faults.kill_point("export", ctx.rank)  # test hook: a crash while the export is written
    try:
        with ctx.timed("export_s"):
            if isinstance(model, export.AdapterExport):
                model.write(meta_dir, ctx.out / "hf")
            else:
                export.write_export(model, meta_dir, ctx.out / "hf", dtype)
    finally:
        if written is not None:  # the model may be refilled now (the next export overwrites all of it)
            written.set()


def after_commit(ctx: StageContext, manifest: dict) -> None:
    # the gate and the chain's cursor; a rerun that reuses this export completes them if the run stopped here
    after_export(ctx.store, ctx.bp, ctx.job.run_id, ctx.job.iteration, ctx.job.inputs, manifest)
    retention_pass(ctx)  # after the pointers moved: what they named before may go now


main = stage_main(run, after_commit)

if __name__ == "__main__":
    main()
