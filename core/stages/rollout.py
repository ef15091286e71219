"""rollout: each rank samples its share of this iteration's prompts on an unsharded copy of the policy.

Inputs: `build` (hf_meta/), `policy` (policy/ checkpoint). Outputs: batch.safetensors, samples.parquet.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from verlflow.core.ml import checkpoint, model as M
from verlflow.core.ml.data import load_prompts
from verlflow.core.ml.rollout import save_batch
from verlflow.core.stages import modelcache
from verlflow.core.stages.collect import collect
from verlflow.core.stages.common import StageContext, stage_main

log = logging.getLogger("verlflow.rollout")


def inference_copy(ctx: StageContext, src: "PolicySource"):
    """The policy's weights in an unsharded model of the inference dtype. A warm pool's previous copy is refilled
    in place: its static engine (compiled, CUDA graphs captured on these very tensors) is reused as the monolithic
    stage reuses its own. The evaluate stage shares it (and the copy)."""
    bp = ctx.bp
    infer_id = (ctx.identity("build"), bp.fsdp.mixed_precision)
    model = modelcache.get("infer", infer_id) if src.cached is not None else None
    if model is None:
        with torch.device(ctx.device):  # random init on the device is fast; the load overwrites it
            model = M.build_module(src.meta_dir, bp)
        if src.cached is None:
            checkpoint.load_full(src.policy_dir, model, base=src.base_dir)
    if src.cached is not None:
        model.load_state_dict(checkpoint.full_state_dict(src.cached[0]))
    model.to(M.inference_dtype(bp))  # a no-op for the reused copy: its tensors (and graphs) stay
    modelcache.put("infer", infer_id, model)
    return model


@dataclass
class PolicySource:
    """Where a stage's unsharded copy of the policy comes from: a warm pool's last update still in memory (`cached`:
    its files may still be being written in the background), else its checkpoint folder (and, for LoRA adapters,
    the build's plain checkpoint of the base they merge into)."""
    meta_dir: Path
    cached: tuple | None
    policy_dir: Path | None
    base_dir: Path


def policy_inputs(ctx: StageContext) -> PolicySource:
    """input() is collective: every rank calls this."""
    build = ctx.input("build")
    cached = modelcache.get("policy", ctx.identity("policy"))
    policy_dir = ctx.input("policy") / "policy" if cached is None else None
    return PolicySource(build / "hf_meta", cached, policy_dir, build / "ref")


def run(ctx: StageContext) -> dict:
    bp = ctx.bp
    src = policy_inputs(ctx)
    tok = M.load_tokenizer(src.meta_dir)
    state = checkpoint.read_state(src.policy_dir) if src.cached is None else src.cached[2]
    data = load_prompts(bp.data.train_files, bp.data.prompt_key)
    with ctx.timed("load_s"):
        model = inference_copy(ctx, src)
    progress = log.info if ctx.is_main() else None
    with ctx.timed("generate_s"):
        got = collect(ctx, model, tok, data, state["data_cursor"], ctx.iteration, progress, state.get("data_seed"))
    if not ctx.is_main():
        return {}
    stats = save_batch(got.samples, ctx.out, tok.pad_token_id, bp.rollout.max_new_tokens, got.prompts_consumed)
    stats.update(got.metrics, data_cursor=state["data_cursor"], prompts_consumed=got.prompts_consumed)
    # generate_s is the whole phase; tokens_per_s counts sampling_s only, without the engine's set-up
    ctx.timings.update(sampling_s=stats.pop("sampling_s"), engine_setup_s=stats.pop("engine_setup_s"))
    log.info("rollout[%s]: reward mean %.4f std %.4f, %d samples, %.0f tok/s", ctx.iteration, stats["reward_mean"],
             stats["reward_std"], stats["samples"], stats["tokens_per_s"])
    return stats


main = stage_main(run)

if __name__ == "__main__":
    main()
