"""checkpoint: export the iteration's policy as an HF safetensors folder, then promote it and apply retention.

Inputs: `build` (hf_meta/), `update` (policy/: an update, or the last sft/dpo step of a phased run), `rollout`
(its metrics rank the checkpoint; none after an sft/dpo phase). Output: hf/, in
storage.export_dtype (verlflow.core.ml.export); with model.lora the merged model or, with
storage.export_lora=adapter, the PEFT adapter folder. The pipeline plans it every storage.export_every iterations and at
the last. Promotion happens after this stage's manifest is committed: `latest` never points at a half-written
export. So does, for a run of a recurring chain, promoted or not, the move of the chain's data cursor to where the
export's policy left off (verlflow.core.store.chain). The stage makes the export's CPU copy and hands its write to
ctx.write: in a warm pool with resources.async_checkpoint, it runs in the background (overlapping the next rollout)
before the commit.
"""

from verlflow.core import faults
from verlflow.core.ml import export
from verlflow.core.stages.common import StageContext, retention_pass, stage_main
from verlflow.core.store.promote import PromotePolicy, after_export


def run(ctx: StageContext) -> dict:
    build = ctx.input("build")  # on every rank: input() is collective in a multi-rank job
    meta_dir = build / "hf_meta"
    policy = ctx.models.policy("update")
    adapter_only = ctx.bp.model.lora is not None and ctx.bp.storage.export_lora == "adapter"
    full = policy.gathered(adapters=adapter_only)  # collective: every rank
    if not ctx.is_main():  # one rank exports (this stage gets several only in a warm pool)
        return {}
    dtype = export.export_dtype(ctx.bp.storage, ctx.bp.model, meta_dir)
    with ctx.timed("export_copy_s"):
        if adapter_only:
            model = export.AdapterExport(ctx.bp.model, dtype, adapters=full, policy_dir=policy.folder)
        else:
            model = ctx.models.export_copy(policy, dtype, lambda into: export.export_model(
                meta_dir, ctx.bp.model, dtype, full=full, policy_dir=policy.folder, base_dir=build / "ref", into=into))
    full = None  # the gathered weights go before the write
    ctx.write(lambda: _write(ctx, model, meta_dir, dtype))
    # An sft/dpo phase's export has no rollout: its phase's own metrics instead.
    scored = ctx.input_manifest("rollout").metrics if "rollout" in ctx.job.inputs else {}
    return {"step": policy.state["step"], "data_cursor": policy.state.get("data_cursor", 0),
            "reward_mean": scored.get("reward_mean"), "reward_std": scored.get("reward_std"), "export_dtype": dtype}


def _write(ctx: StageContext, model, meta_dir, dtype: str) -> None:
    faults.kill_point("export", ctx.rank)  # a crash while the export is written
    with ctx.timed("export_s"):
        if isinstance(model, export.AdapterExport):
            model.write(meta_dir, ctx.out / "hf")
        else:
            export.write_export(model, meta_dir, ctx.out / "hf", dtype)


def after_commit(ctx: StageContext, manifest: dict) -> None:
    # the gate and the chain's cursor; a rerun that reuses this export completes them if the run stopped here
    after_export(ctx.store, PromotePolicy.of(ctx.bp), ctx.job.run_id, ctx.job.iteration, ctx.job.inputs, manifest)
    retention_pass(ctx)  # after the pointers moved: what they named before may go now


main = stage_main(run, after_commit)

if __name__ == "__main__":
    main()
