"""Shared fixtures. verl installs its own top-level `tests` package, so helpers here are plain modules."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

pytest_plugins = ["s3server", "kits", "prefect_server", "reference"]


# -- the order files reach the two xdist workers (`--dist loadfile --no-loadscope-reorder`) ----------------------
# xdist would otherwise order files by their number of tests. test_stages first: its first test builds the session's
# reference run (tests/reference.py, ~4 minutes loaded) while the other worker goes through files that do not need
# it (test_schedule, test_phases; test_hangs' CPU hogs after them, not beside the reference build: 404 s there);
# then the rest longest first, so the last file to finish is a short one. Worker-seconds of `make test`'s files in
# CI (2026-12-04, byte-compiled imports, before the fault stories came back): hangs 176, schedule 107, stages 106,
# flows 106, phases 81, launcher 59, slurm 50, dcpio 47, ui 43, cli 42.
HEAVY_FIRST = ("test_stages", "test_schedule", "test_phases", "test_hangs", "test_flows", "test_cli", "test_faults",
               "test_cancel_ui", "test_ui_links",
               "test_retention", "test_evaluate", "test_launcher", "test_preflight", "test_security", "test_dcpio",
               "test_slurm", "test_promotion", "test_packaging", "test_footprint", "test_algorithms", "test_tracking",
               "test_ui", "test_keys", "test_packing", "test_fastgen", "test_benchmarks", "test_exports", "test_lease",
               "test_determinism", "test_store", "test_blueprint", "test_lora", "test_dpo_core", "test_pool",
               "test_multinode", "test_postgres", "test_k8s", "test_verify")


# -- `make test` (CI, 20 minutes on 2 cores) and `make test-all` --------------------------------------------------
# Scenarios marked `slow` here run in `make test-all` only. Each is a second whole pipeline (or cluster, or server)
# for a story another test in `make test` already drives end to end; the comment names that test. Chosen from one
# loaded run's durations (2026-12-03: 8,285 worker-seconds in all, ~2,790 left in `make test`). The scheduler's batch of
# runs and the fourteen stages under CPU hogs stay in `make test`: batches and load are where users' bugs appeared.
# 2026-12-04: with the venv byte-compiled (Makefile COMPILE) `make test` took 1,148 worker-seconds (12 min in CI), the
# slow set 2,100: the fault stories, a crash or a full store during a background commit, retention (after every
# stage, a kill mid-prune, S3) and the e2e benchmark's smoke came back (~370 worker-seconds).
SLOW = {
    # NaN: test_stages' nonfinite test; timeouts: test_hangs; a corrupted file: the corrupted S3 object (test_faults);
    # the other fault stories (kill, S3 outage, cancel, reboot, two runs at once) run in `make test`
    "test_faults.py::test_nan_loss_commits_and_promotes_nothing": "",
    "test_faults.py::test_corrupted_file_on_disk_is_named_by_the_next_stage": "",
    "test_faults.py::test_stage_timeout_is_killed_classified_and_retried": "",
    "test_faults.py::test_bad_input_is_refused_clearly[tokenizer-without-chat-template]": "a stage job each",
    "test_faults.py::test_bad_input_is_refused_clearly[architecture-without-decoder-layer-class]": "",
    # the reference run, the warm pool's equality and a world-size change stay (test_stages)
    "test_stages.py::test_staged_equals_monolithic": "",
    "test_stages.py::test_rollout_old_logprobs_give_the_recomputed_update": "",
    "test_stages.py::test_checkpoint_loads_exactly_at_another_world_size": "test_dcpio reshards",
    # learning: test_evaluate's 6 GRPO iterations improve the held-out reward by > 0.1 (5 standard errors); the
    # monolithic stage: test_hangs' pool under CPU load equals a monolithic run
    "test_stages.py::test_learning_beats_random_variation": "",
    "test_stages.py::test_architectures_fsdp_versions_and_estimators[llama-2-rloo-True-True]": "qwen2/gae stays",
    "test_stages.py::test_architectures_fsdp_versions_and_estimators[llama-1-reinforce_plus_plus-False-True]": "",
    "test_stages.py::test_unknown_reward_and_bad_model_reported_together": "test_preflight, test_cli",
    "test_stages.py::test_overlong_prompt_fails_rollout": "test_preflight",
    "test_stages.py::test_checkpoint_of_another_model_is_refused": "",
    "test_stages.py::test_blueprint_lr_overrides_the_checkpointed_optimizer": "",
    "test_stages.py::test_dataset_missing_columns_fails_validate": "test_cli's bad input",
    # background commits: test_hangs' hung pool stage, test_exports' bf16 export, test_stages' warm pool
    "test_pool.py::test_failure_ends_the_pool_and_a_rerun_starts_fresh": "",
    "test_pool.py::test_background_commits_upload_to_s3": "",
    "test_pool.py::test_a_background_commit_logs_under_its_own_stage": "",
    "test_pool.py::test_cancel_kills_the_pool": "test_cancel_ui's cancel of a hung served run",
    "test_pool.py::test_a_pipeline_lands_its_background_commits_before_it_returns_whatever_its_caller_holds": "",
    # every estimator and loss: test_algorithms' two-rank update
    "test_algorithms.py::test_a_reward_model_adds_to_a_batched_rule_reward_deterministically": "",
    "test_algorithms.py::test_remax_rollout_samples_a_greedy_baseline_and_the_update_subtracts_it": "",
    "test_algorithms.py::test_the_recipe_blueprints_run_on_the_tiny_kit": "",
    "test_algorithms.py::test_dynamic_sampling_keeps_informative_groups_and_fills_the_batch": "",
    "test_algorithms.py::test_dynamic_sampling_fills_with_uniform_groups_when_rounds_run_out": "",
    "test_algorithms.py::test_cosine_schedule_follows_verl_across_a_rerun_at_another_world_size": "",
    # the scheduler: test_flows' next scheduled run (warm start, cancel); test_schedule's id and order rules
    "test_flows.py::test_scheduled_run_fails_in_update_and_the_ui_retry_resumes": "",
    "test_flows.py::test_one_warm_pool_rule_drives_the_runner_and_the_flow_slots": "",
    "test_schedule.py::test_serve_restart_keeps_schedules_added_in_the_ui": "",
    "test_postgres.py::": "the same flow on SQLite: test_flows",
    # tracking: test_tracking's W&B offline run and its TensorBoard/MLflow file readers
    "test_tracking.py::test_mlflow_server_one_run_per_verlflow_run": "",
    "test_lora.py::test_adapter_checkpoints_merged_and_adapter_exports_and_a_world_size_change": "",
    "test_lora.py::test_a_lora_run_learns_the_tiny_task": "test_lora's smaller tests",
    # clusters: test_k8s' and test_slurm's other tests
    "test_k8s.py::test_failing_rank_names_its_pod_node_and_rank": "",
    "test_k8s.py::test_cancel_deletes_the_job_and_its_pods": "",
    "test_k8s.py::test_stage_runs_as_two_pods_through_the_api": "",
    "test_multinode.py::": "",
    "test_slurm.py::test_stage_runs_across_two_nodes": "",
    "test_benchmarks.py::test_update_benchmark_smoke_two_ranks": "",
    "test_promotion.py::test_a_night_whose_evaluation_gets_worse_moves_no_pointer_and_the_next_starts_from_the_promoted": "",
    "test_exports.py::test_a_warm_pool_exports_in_the_background_and_a_crash_there_commits_and_promotes_nothing": "",
    "test_exports.py::test_export_every_two_of_five_exports_and_promotes_at_2_4_5_only_and_a_rerun_skips_all": "",
    "test_dcpio.py::test_a_writer_thread_that_fails_fails_the_save": "",
    # a served run hung in a collective: test_cancel_ui cancels one from the UI, under load
    "test_hangs.py::test_cancel_of_a_served_run_hung_in_a_collective_is_prompt": "",
    "test_verify.py::test_the_advised_reruns_repair_a_truncated_manifest_and_a_deleted_file": "",
    "test_packaging.py::test_a_project_with_its_own_core_flows_and_tasks_runs_the_flow": "its CLI run stays",
}


def _slow(nodeid: str) -> bool:
    name = nodeid.removeprefix("tests/")
    return any(name.startswith(k) if k.endswith("::") or "[" in k else name == k or name.startswith(k + "[")
               for k in SLOW)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: tests keep their order in a file


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of tiny-shape tests (more threads only spin, and CI runs two workers on two
    cores); a module asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
