"""Metric names, one namespace for everything that reads a stage's metrics: promotion (promote.metric), the
trackers (MLflow, TensorBoard, W&B), the report's figures and `verlflow compare`.

A name is `<prefix>/<metric>`: the prefix says which stage of the iteration measured it, the rest is the key of
that stage's manifest `metrics`, e.g. rollout/reward_mean, update/kl_loss, eval/accuracy (all data sources) and
eval/openai/gsm8k/accuracy (one data source; the evaluate stage names its per-source metrics `<source>/<metric>`).
"""

from __future__ import annotations

import math

from verlflow.core.store.artifacts import ArtifactStore, stage_key

PREFIX = {"rollout": "rollout", "update": "update", "evaluate": "eval"}


def flat(stage: str, metrics: dict) -> dict[str, float]:
    """A stage's manifest metrics under their names; only finite numbers (no counts of text, no booleans)."""
    prefix = PREFIX[stage]
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def of_iteration(store: ArtifactStore, run_id: str, iteration: int) -> dict[str, float]:
    """Every named metric the committed stages of one iteration recorded (iteration 0: the initial evaluation)."""
    out: dict[str, float] = {}
    for stage in PREFIX:
        manifest = store.read_manifest(stage_key(run_id, iteration, stage))
        if manifest is not None:
            out.update(flat(stage, manifest.get("metrics", {})))
    return out


# The keys each stage's manifest metrics hold: the rollout's (verlflow.core.ml.rollout.save_batch), the update's
# (verlflow.core.stages.update.run, kl_in_reward from verlflow.core.ml.ppo.advantages), the evaluate stage's per
# data source and over all of them (its pass@K for each eval.pass_k).
ROLLOUT_KEYS = ("reward_mean", "reward_std", "reward_max", "response_len_mean", "samples", "tokens", "tokens_per_s",
                "sampling_s", "engine_setup_s", "data_cursor", "prompts_consumed")  # the rollout stage adds the last two
# verlflow.core.stages.collect: DAPO's dynamic sampling and remax's greedy baseline, when configured
FILTER_GROUPS_KEYS = ("rounds", "prompts_sampled", "informative_groups", "uniform_groups", "filled_with_uniform",
                      "samples_sampled")
UPDATE_KEYS = ("step", "pg_loss", "kl_loss", "entropy", "pg_clipfrac", "grad_norm", "tokens_per_s")
# adv_estimator gae: the critic's (verl's critic/* names; vf_explained_var from verlflow.core.ml.ppo.prepare)
CRITIC_KEYS = ("vf_loss", "vf_clipfrac", "vpred_mean", "vf_explained_var", "critic_grad_norm")
# verlflow.core.ml.ppo.rollout_correction (verl's names): the gap between the rollout's and the policy's log-probs
ROLLOUT_CORR_KEYS = ("kl", "k3_kl", "ppl_ratio", "log_ppl_abs_diff", "chi2_token", "rollout_is_mean",
                     "rollout_is_max", "rollout_is_ratio_fraction_high", "rollout_is_eff_sample_size")
EVAL_KEYS = ("reward_mean", "accuracy", "response_len_mean", "samples")


def eval_sources(files: list[str]) -> list[str]:
    """The data sources of the eval files (their data_source column, read with pyarrow); unreadable files add none
    (missing_inputs reports them)."""
    import pyarrow.parquet as pq

    found: set[str] = set()
    for f in files:
        try:
            found.update(str(s) for s in pq.read_table(f, columns=["data_source"]).column(0).unique().to_pylist())
        except Exception:  # noqa: BLE001 - a missing file or column is the eval checks' to report
            continue
    return sorted(found)


def available(bp) -> list[str]:
    """Every metric name the blueprint's configured stages record: what promote.metric may name."""
    names = [f"rollout/{k}" for k in ROLLOUT_KEYS] + [f"update/{k}" for k in UPDATE_KEYS]
    if bp.algorithm.filter_groups.enable:
        names += [f"rollout/filter_groups/{k}" for k in FILTER_GROUPS_KEYS]
    if bp.algorithm.greedy_baseline:
        names.append("rollout/remax/baseline_reward_mean")
    if bp.reward.overlong_buffer.enable:
        names += ["rollout/overlong/penalised_frac", "rollout/overlong/penalty_mean"]
    if bp.algorithm.use_kl_in_reward:
        names.append("update/kl_in_reward")
    if bp.algorithm.adv_estimator == "gae":
        names += [f"update/{k}" for k in CRITIC_KEYS]
    if bp.algorithm.rollout_correction:
        names += [f"update/rollout_corr/{k}" for k in ROLLOUT_CORR_KEYS]
    if bp.eval.files:
        keys = EVAL_KEYS + tuple(f"pass@{k}" for k in bp.eval.pass_k)
        for source in [""] + [f"{s}/" for s in eval_sources(bp.eval.files)]:
            names += [f"eval/{source}{k}" for k in keys]
    return names


def unknown_metric_problem(bp) -> str | None:
    """promote.metric, when it names no metric the configured stages record: the problem, with the names."""
    import difflib

    metric = bp.promote.metric
    names = available(bp)
    if metric is None or metric in names:
        return None
    close = difflib.get_close_matches(metric, names, n=1)
    return (f"promote.metric={metric} is not a metric this blueprint's stages record"
            f"{f' (did you mean {close[0]}?)' if close else ''}; choose one of: {', '.join(names)}")
