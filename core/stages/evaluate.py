"""evaluate: each rank generates its share of the held-out prompts (eval.files) on an unsharded copy of the policy,
scores them, and rank 0 reports per data source (verlflow.core.ml.evaluate).

Inputs: `build` (hf_meta/), `policy` (the build's or an update's policy/ checkpoint). Outputs: samples.parquet
(every sample), the metrics in the manifest (`<source>/<metric>` and over all sources), and under the metrics'
`report` key the first eval.samples_shown samples of each data source.
"""

import logging

from verlflow.core.ml import model as M
from verlflow.core.ml.evaluate import generate_share, load_held_out, metrics, save_samples, shown
from verlflow.core.stages.common import StageContext, stage_main
from verlflow.core.stages.collect import gather

log = logging.getLogger("verlflow.evaluate")


def run(ctx: StageContext) -> dict:
    bp = ctx.bp
    policy = ctx.models.policy()  # as the rollout takes it
    tok = M.load_tokenizer(policy.meta_dir)
    held = load_held_out(bp.eval)
    with ctx.timed("load_s"):
        model = ctx.models.inference_copy(policy)  # the rollout's, in a warm pool
    progress = log.info if ctx.is_main() else None
    with ctx.timed("generate_s"):
        mine = generate_share(model, tok, bp.eval, bp.rollout, bp.reward, held, ctx.iteration, ctx.placement,
                              max_prompt_len=bp.data.max_prompt_length, seed=bp.seed, progress=progress)
    samples = gather(ctx, mine)
    if not ctx.is_main():
        return {}
    save_samples(samples, ctx.out)
    stats = metrics(samples, bp.eval)
    log.info("evaluate[%s]: reward mean %.4f, accuracy %.4f, %d samples of %d prompts", ctx.iteration,
             stats["reward_mean"], stats["accuracy"], stats["samples"], len(held))
    return {**stats, "report": shown(samples, held, bp.eval.samples_shown)}


main = stage_main(run)

if __name__ == "__main__":
    main()
