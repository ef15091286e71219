"""Metric names, one namespace for everything that reads a stage's metrics: promotion (promote.metric), the
trackers (MLflow, TensorBoard, W&B), the report's figures and `verlflow compare`.

A name is `<prefix>/<metric>`: the prefix says which stage of the iteration measured it, the rest is the key of
that stage's manifest `metrics`, e.g. rollout/reward_mean, update/kl_loss, eval/accuracy (all data sources) and
eval/openai/gsm8k/accuracy (one data source; the evaluate stage names its per-source metrics `<source>/<metric>`),
sft/sft_loss, dpo/rewards/margins, user/<what a user stage returned>.

A metric is read and logged at a step number (step_numbers): the iteration of a run without phases; in a phased
run, whose steps are named (evaluate[base], sft[sft.1], dpo[dpo.2]) as well as numbered (its rl iterations), the
position of the step's iteration in the plan.
"""

from __future__ import annotations

import math
from typing import Iterable

from verlflow.core.stagespec import SPECS, metric_stages
from verlflow.core.store.artifacts import ArtifactStore, stage_key

PREFIX = {name: s.metric_prefix for name, s in SPECS.items() if s.metric_prefix}
RL_STAGES = metric_stages("numbered")  # the stages of a numbered iteration
PHASE_STAGES = metric_stages("named")  # the stages of a named one (evaluate[base], sft[sft.1], user[judge])


def flat(stage: str, metrics: dict) -> dict[str, float]:
    """A stage's manifest metrics under their names; only finite numbers (no counts of text, no booleans)."""
    prefix = PREFIX[stage]
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def of_iteration(store: ArtifactStore, run_id: str, iteration: int | str) -> dict[str, float]:
    """Every named metric the committed stages of one iteration recorded (iteration 0: the initial evaluation); of a
    phase's named step its stage's; of a phase's export (export[dpo]) those of the policy it exported, its last
    epoch's (dpo[dpo.2]), which promote.metric judges."""
    numbered = str(iteration).isdigit()
    out: dict[str, float] = {}
    for stage in RL_STAGES if numbered else PHASE_STAGES:
        manifest = store.read_manifest(stage_key(run_id, iteration, stage))
        if manifest is not None:
            out.update(flat(stage, manifest.get("metrics", {})))
    if not numbered and (export := store.read_manifest(stage_key(run_id, iteration, "export"))):
        source = export.get("inputs", {}).get("update", {}).get("stage", "")
        stage = source.rsplit("/", 1)[-1]
        if stage in PREFIX and (manifest := store.read_manifest(source)) is not None:
            out.update(flat(stage, manifest.get("metrics", {})))
    return out


def step_numbers(steps: Iterable[tuple[str, int | str]]) -> dict[str, int]:
    """Iteration (as text) -> the step number its metrics are logged and drawn at, for a plan's (stage, iteration)
    pairs: a run without phases keeps its iterations; a phased run numbers its iterations with metrics in plan
    order from 0. From the plan alone, so a rerun numbers each step as the first attempt did."""
    its = list(dict.fromkeys(str(it) for stage, it in steps if stage in PREFIX))
    if all(it.isdigit() for it in its):
        return {it: int(it) for it in its}
    return {it: n for n, it in enumerate(its)}


def step_names(steps: Iterable[tuple[str, int | str]]) -> dict[int, str]:
    """Step number -> the names of the plan's steps logged there (`evaluate[base]`, `rollout[1] update[1]`)."""
    steps = list(steps)
    numbers, names = step_numbers(steps), {}
    for stage, it in steps:
        if stage in PREFIX:
            names.setdefault(numbers[str(it)], []).append(f"{stage}[{it}]")
    return {n: " ".join(v) for n, v in names.items()}


# The keys each stage's manifest metrics hold: the rollout's (verlflow.core.ml.rollout.save_batch), the update's
# (verlflow.core.stages.update.run, kl_in_reward from verlflow.core.ml.ppo.advantages), the evaluate stage's per
# data source and over all of them (its pass@K for each eval.pass_k).
ROLLOUT_KEYS = ("reward_mean", "reward_std", "reward_max", "response_len_mean", "samples", "tokens", "tokens_per_s",
                "sampling_s", "engine_setup_s", "data_cursor", "prompts_consumed")  # the rollout stage adds the last two
# verlflow.core.stages.collect: DAPO's dynamic sampling and remax's greedy baseline, when configured
FILTER_GROUPS_KEYS = ("rounds", "prompts_sampled", "informative_groups", "uniform_groups", "filled_with_uniform",
                      "samples_sampled")
# verlflow.core.ml.agent_rollout.agent_stats, as rollout/agent/<key>: rollout.mode=agent
AGENT_KEYS = ("turns_mean", "turns_max", "tool_calls_mean", "tool_errors_mean", "tool_timeouts", "truncated_frac",
              "failed", "tool_success_frac", "env_s", "env_wait_s", "gen_s", "turns_resumed_frac")
UPDATE_KEYS = ("step", "pg_loss", "kl_loss", "entropy", "pg_clipfrac", "grad_norm", "tokens_per_s")
# adv_estimator gae: the critic's (verl's critic/* names; vf_explained_var from verlflow.core.ml.ppo.prepare)
CRITIC_KEYS = ("vf_loss", "vf_clipfrac", "vpred_mean", "vf_explained_var", "critic_grad_norm")
# verlflow.core.ml.ppo.rollout_correction (verl's names): the gap between the rollout's and the policy's log-probs
ROLLOUT_CORR_KEYS = ("kl", "k3_kl", "ppl_ratio", "log_ppl_abs_diff", "chi2_token", "rollout_is_mean",
                     "rollout_is_max", "rollout_is_ratio_fraction_high", "rollout_is_eff_sample_size")
EVAL_KEYS = ("reward_mean", "accuracy", "response_len_mean", "samples")
# verlflow.core.stages.sft / dpo (dpo's rewards/ and logps/ from verlflow.core.ml.dpo.dpo_loss): a phase's epoch
SFT_KEYS = ("step", "epoch", "rows", "sft_loss", "sft_loss_first", "sft_loss_mean")
DPO_KEYS = ("step", "epoch", "pairs", "dpo_loss", "accuracy_first", "rewards/chosen", "rewards/rejected",
            "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


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
    kinds = {ph.kind for ph in bp.phases}
    names = [f"{kind}/{k}" for kind, keys in (("sft", SFT_KEYS), ("dpo", DPO_KEYS)) if kind in kinds for k in keys]
    if not bp.phases or "rl" in kinds:
        names += _rl_names(bp)
    return names + _eval_names(bp)


def _rl_names(bp) -> list[str]:
    names = [f"rollout/{k}" for k in ROLLOUT_KEYS] + [f"update/{k}" for k in UPDATE_KEYS]
    if bp.algorithm.filter_groups.enable:
        names += [f"rollout/filter_groups/{k}" for k in FILTER_GROUPS_KEYS]
    if bp.rollout.mode == "agent":
        names += [f"rollout/agent/{k}" for k in AGENT_KEYS]
    if bp.algorithm.greedy_baseline:
        names.append("rollout/remax/baseline_reward_mean")
    if bp.rollout.weights == "auto":
        names.append("rollout/weights_fp8")
    if bp.reward.overlong_buffer.enable:
        names += ["rollout/overlong/penalised_frac", "rollout/overlong/penalty_mean"]
    if bp.algorithm.use_kl_in_reward:
        names.append("update/kl_in_reward")
    if bp.algorithm.adv_estimator == "gae":
        names += [f"update/{k}" for k in CRITIC_KEYS]
    if bp.algorithm.rollout_correction:
        names += [f"update/rollout_corr/{k}" for k in ROLLOUT_CORR_KEYS]
    return names


def _eval_names(bp) -> list[str]:
    if not bp.eval.files:
        return []
    keys = EVAL_KEYS + tuple(f"pass@{k}" for k in bp.eval.pass_k)
    return [f"eval/{source}{k}" for source in [""] + [f"{s}/" for s in eval_sources(bp.eval.files)] for k in keys]
