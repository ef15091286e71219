"""rollout: each rank samples its share of this iteration's prompts on an unsharded copy of the policy.

Inputs: `build` (hf_meta/), `policy` (policy/ checkpoint). Outputs: batch.safetensors, samples.parquet.
"""

import logging

from verlflow.core.ml import model as M
from verlflow.core.ml.data import load_prompts
from verlflow.core.ml.rollout import save_batch
from verlflow.core.stages.collect import collect
from verlflow.core.stages.common import StageContext, stage_main

log = logging.getLogger("verlflow.rollout")


def run(ctx: StageContext) -> dict:
    bp = ctx.bp
    policy = ctx.models.policy()
    tok, state = M.load_tokenizer(policy.meta_dir), policy.state
    data = load_prompts(bp.data.train_files, bp.data.prompt_key)
    with ctx.timed("load_s"):
        model = ctx.models.inference_copy(policy)
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
    if bp.rollout.mode == "agent":
        log.info("rollout[%s]: agent: %.2f turns and %.2f tool calls per trajectory, %d timeouts, %.0f%% truncated, "
                 "%d failed; tools %.1f s (the engine waited %.1f s of them), generation %.1f s, %.0f%% of turns "
                 "resumed in their trajectory's cache", ctx.iteration,
                 stats["agent/turns_mean"], stats["agent/tool_calls_mean"], stats["agent/tool_timeouts"],
                 100 * stats["agent/truncated_frac"], stats["agent/failed"], stats["agent/env_s"],
                 stats["agent/env_wait_s"], stats["agent/gen_s"], 100 * stats["agent/turns_resumed_frac"])
    return stats


main = stage_main(run)

if __name__ == "__main__":
    main()
