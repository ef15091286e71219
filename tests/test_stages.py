"""The five stages as real torchrun jobs (2 ranks, gloo, FSDP) on the tiny kit: learning, equivalence, resharding."""

import json

import pytest
import torch
from reference import rekey
from tinybp import tiny_blueprint

from verlflow.core.errors import StoreError
from verlflow.core.ml import checkpoint, model as M
from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.orchestrate.pipeline import run_pipeline
from verlflow.core.orchestrate.runner import RunContext, run_stage

pytestmark = pytest.mark.stages

QUIET = dict(on_line=lambda line: None)


def full_weights(store_root, stage_dir: str, bp) -> dict:
    root = store_root / "runs"
    model = M.build_module(root / stage_dir.split("/", 1)[0] / "init/build/hf_meta", bp.model)
    checkpoint.load_full(root / stage_dir / "policy", model)
    return model.state_dict()


@pytest.fixture
def staged(reference):
    """Two GRPO iterations as separate stage jobs with artifacts between them: the session's reference run
    (tests/reference.py), read only."""
    return reference.bp, reference.root, reference.results


@pytest.fixture
def staged_copy(reference, tmp_path):
    """The same run in a store of this test's own, for a test that runs stages there."""
    bp, root = reference.copy(tmp_path)
    return bp, root, reference.results


def test_pipeline_commits_every_stage(staged):
    bp, store, results = staged
    names = [(r.manifest["stage"], r.manifest["iteration"]) for r in results]
    assert names == [("validate", "init"), ("build", "init"), ("rollout", 1), ("update", 1), ("export", 1),
                     ("rollout", 2), ("update", 2), ("export", 2)]
    build = results[1].manifest["metrics"]
    # The tutorial's checks: one FSDP unit per decoder layer + root, each rank holding half the parameters.
    assert build["policy_fsdp_units"] == 2 + 1
    assert build["policy_shard_balance"] == pytest.approx([1.0, 1.0], abs=0.05)
    update = results[3].manifest["metrics"]
    assert update["step"] == 2  # 4 prompts / mini-batch of 2 prompts
    for row in update["mini_batches"]:
        assert row["grad_norm"] > 0 and torch.isfinite(torch.tensor(row["grad_norm"]))
    norms = [row["grad_norm"] for row in update["mini_batches"]]
    assert len(set(norms)) == len(norms)  # changes from step to step
    pointer = json.loads((store / "pointers/runs/eq/latest.json").read_text())
    assert pointer["iteration"] == 2
    # The build's optimizer never stepped: its checkpoint holds no optimizer state (all zeros: 2/3 of a full
    # checkpoint's bytes), the first update starts a fresh one (test_staged_equals_monolithic: the same weights)
    # and saves it.
    from torch.distributed.checkpoint import FileSystemReader

    def optim_keys(stage):
        meta = FileSystemReader(str(store / f"runs/eq/{stage}/policy/dcp")).read_metadata().state_dict_metadata
        return [k for k in meta if k.startswith("optim.")]

    assert optim_keys("init/build") == [] and optim_keys("1/update")
    # The export holds exactly the update's weights (it is written from an uninitialised model the load fills)...
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = store / "runs/eq/2/export/hf"
    exported, want = load_file(hf / "model.safetensors"), full_weights(store, "eq/2/update", bp)
    assert exported.keys() == want.keys() and all(torch.equal(exported[k], want[k]) for k in want)
    # ...and loads with from_pretrained and generates.
    model, tok = AutoModelForCausalLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write the digit 3 twice."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow(reason="covered by test_hangs::test_fourteen_stages_with_background_commits_under_cpu_load")
def test_staged_equals_monolithic(staged_copy):
    """The same 2 iterations in one process (models kept in memory) give bit-identical fp32 weights."""
    bp, store, results = staged_copy
    mono = run_stage(RunContext(bp, "eq", **QUIET), "monolithic", "mono", {"build": "runs/eq/init/build"})
    staged_w = full_weights(store, "eq/2/update", bp)
    mono_w = full_weights(store, "eq/mono/monolithic", bp)
    init_w = full_weights(store, "eq/init/build", bp)
    assert staged_w.keys() == mono_w.keys()
    assert all(torch.equal(staged_w[k], mono_w[k]) for k in staged_w)
    assert any(not torch.equal(staged_w[k], init_w[k]) for k in staged_w)  # it did train
    rewards = [r.manifest["metrics"]["reward_mean"] for r in results if r.manifest["stage"] == "rollout"]
    assert [it["reward_mean"] for it in mono.manifest["metrics"]["iterations"]] == rewards


def test_fresh_jobs_resume_from_the_warm_pools_checkpoint_to_the_same_weights(reference, tmp_path):
    """The reference ran in one warm pool: iteration 2 started from the models its update[1] left in memory. Rerun
    from rollout[2] as fresh torchrun jobs (resources.warm_workers=false), every stage reads what it needs back from
    the store instead (update[1]'s DCP policy and AdamW state): the weights and the export are bit-identical, each
    stage commits its own manifest, the pool's stages started within a fraction of a second where a fresh job
    spends seconds importing, and no process outlives either pipeline."""
    import psutil
    from tinybp import FRESH_JOBS

    from verlflow.core.blueprint import load_blueprint

    bp, root = reference.copy(tmp_path)
    fresh_bp = load_blueprint(None, [FRESH_JOBS], data=bp.model_dump(mode="json"))
    rekey(fresh_bp, reference.run_id)  # validate's key holds the resources: reuse it, as a rerun would
    fresh = run_pipeline(fresh_bp, reference.run_id, force_from="rollout[2]", **QUIET)
    warm = reference.results
    assert [(r.manifest["stage"], r.skipped) for r in fresh] == [(r.manifest["stage"], i < 5)
                                                                for i, r in enumerate(warm)]
    got, want = full_weights(root, "eq/2/update", fresh_bp), full_weights(reference.root, "eq/2/update", bp)
    assert all(torch.equal(got[k], want[k]) for k in want)
    sha = [r.manifest["files"]["hf/model.safetensors"]["sha256"] for r in (fresh[7], warm[7])]
    assert sha[0] == sha[1]  # the pool's export, from memory in the background, is the fresh job's file exactly
    # A fresh job spends seconds between launch and the worker's main (spawn + imports); the pool's jobs after the
    # first start within a fraction of a second.
    waits = [r.manifest["timings"]["launch_to_worker_s"] for r in warm[1:]]
    cold = [r.manifest["timings"]["launch_to_worker_s"] for r in fresh[5:]]
    assert max(waits) < 0.5 < min(cold), (waits, cold)
    assert warm[4].manifest["world_size"] == 2  # checkpoint ran on the pool's 2 ranks, rank 0 exporting
    # Models the pool's last update left in memory replace reading its checkpoint back (core/stages/modelcache.py).
    hits = {(r.manifest["stage"], r.manifest["iteration"]): r.manifest["metrics"].get("warm_cache_hits", [])
            for r in warm}
    # ... and so do those the build left: the first rollout and update read no checkpoint back either
    assert hits[("update", 1)] == ["policy"] and hits[("update", 2)] == ["policy", "ref"]
    assert hits[("rollout", 1)] == ["policy"] and hits[("rollout", 2)] == ["infer", "policy"]  # inference copy reused
    assert hits[("export", 1)] == ["policy"]
    assert hits[("export", 2)] == ["export", "policy"]  # the first export's CPU model, refilled (its sha above)
    assert all("warm_cache_hits" not in r.manifest["metrics"] for r in fresh[5:])  # fresh jobs: none
    assert not [p for p in psutil.Process().children(recursive=True) if "verlflow.core.stages" in " ".join(p.cmdline())]


@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_rollout_old_logprobs_give_the_recomputed_update(reference, tmp_path):
    """algorithm.old_logprobs=rollout (fp32, 2 ranks): update[1] from the log-probs its rollout saved has the
    losses and weights of the reference's update[1], which recomputed them with the FSDP policy."""
    from verlflow.core.blueprint import load_blueprint

    bp, root = reference.copy(tmp_path)
    rb = load_blueprint(None, ["algorithm.old_logprobs=rollout", "iterations=1"], data=bp.model_dump(mode="json"))
    results = {r.manifest["stage"]: r for r in run_pipeline(rb, reference.run_id, **QUIET)}
    assert results["rollout"].skipped and not results["update"].skipped  # the reference's batch, a new update
    got, want = full_weights(root, "eq/1/update", rb), full_weights(reference.root, "eq/1/update", reference.bp)
    moved = full_weights(reference.root, "eq/init/build", reference.bp)
    # Adam moves a weight by ~lr = 3e-3 a step, whatever its gradient's size: where a gradient is ~0, fp32 rounding of
    # the old log-probs (rollout logits vs the FSDP forward) tips its step. Agreed to 1/100 of a step, but for a
    # handful of such weights (one in 2026-12: 3.24e-5 after two steps), which stay within 1/10 of a step.
    diff = torch.cat([(got[k] - want[k]).abs().flatten() for k in want])
    assert int((diff > 3e-5).sum()) <= max(1, diff.numel() // 10_000) and float(diff.max()) < 3e-4, (
        int((diff > 3e-5).sum()), float(diff.max()))
    assert any(not torch.equal(want[k], moved[k]) for k in want)  # the update did move the weights
    new, old = results["update"].manifest["metrics"], reference.results[3].manifest["metrics"]
    assert len(new["mini_batches"]) == len(old["mini_batches"]) == 2
    for a, b in zip(new["mini_batches"], old["mini_batches"]):
        for k in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def test_rerun_reuses_and_resumes_at_another_world_size(staged_copy):
    """Same run id, one more iteration, 1 rank: the 2-rank stages are reused, the checkpoint reshards."""
    bp, store, _ = staged_copy
    bp1 = bp.model_copy(deep=True)
    bp1.iterations = 3
    bp1.resources.nproc_per_node = 1
    bp1.resources.warm_workers = True  # the new stages in one job: resharding, not the launcher, is the subject
    results = run_pipeline(bp1, "eq", **QUIET)
    skipped = [r.manifest["stage"] + str(r.manifest["iteration"]) for r in results if r.skipped]
    assert skipped == ["build" + "init", "rollout1", "update1", "export1", "rollout2", "update2", "export2"]
    new = {r.manifest["stage"]: r.manifest for r in results if not r.skipped}
    assert new["update"]["world_size"] == 1 and results[3].manifest["world_size"] == 2
    assert new["update"]["metrics"]["step"] == 2 + 2 + 2  # the optimizer step count continues


@pytest.mark.slow(reason="covered by test_dcpio::test_threaded_checkpoint_round_trips_exactly_and_reshards")
def test_checkpoint_loads_exactly_at_another_world_size(staged, tmp_path):
    """A 2-rank DCP checkpoint loaded into 1-rank and 2-rank FSDP models gives the same full weights."""
    from verlflow.core.orchestrate.launcher import LaunchSpec, launch

    bp, store, _ = staged
    want = full_weights(store, "eq/1/update", bp)
    for world in (1, 2):
        out = tmp_path / f"w{world}.safetensors"
        job = {"blueprint": bp.model_dump(mode="json"), "meta": str(store / "runs/eq/init/build/hf_meta"),
               "ckpt": str(store / "runs/eq/1/update/policy"), "out": str(out)}
        (tmp_path / "job.json").write_text(json.dumps(job))
        launch(LaunchSpec("verlflow.core.testing.reshard_probe", [str(tmp_path / "job.json")], nproc_per_node=world,
                          timeout_s=120), **QUIET)
        from safetensors.torch import load_file

        got = load_file(str(out))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), f"world {world} differs"


@pytest.mark.parametrize("estimator,lr", [("grpo", 1e-2), ("gae", 1e-2)])
@pytest.mark.slow(reason="covered by test_evaluate::test_the_held_out_split_improves_and_the_evaluation_shows_it")
def test_learning_beats_random_variation(tiny_kit, tmp_path, estimator, lr):
    """10 iterations (seed 0, 8 prompts x 4 samples): mean reward of the last two iterations exceeds the first
    two by > 0.1. A random policy's per-sample reward std is ~0.13, so the std error of a 64-sample mean is
    ~0.016: 0.1 is > 6 standard errors. Measured: grpo 0.08 -> 0.36, gae (PPO with critic) 0.07 -> 0.36."""
    bp = tiny_blueprint(tiny_kit, tmp_path, iterations=10, data__batch_size=8, algorithm__ppo_mini_batch_size=4,
                        algorithm__adv_estimator=estimator, algorithm__lr=lr, algorithm__critic_lr=1e-2)
    run_stage(RunContext(bp, "learn", **QUIET), "build", "init", {})
    res = run_stage(RunContext(bp, "learn", **QUIET), "monolithic", "mono", {"build": "runs/learn/init/build"})
    rewards = [it["reward_mean"] for it in res.manifest["metrics"]["iterations"]]
    assert sum(rewards[-2:]) / 2 - sum(rewards[:2]) / 2 > 0.1, rewards


@pytest.mark.parametrize("critic", [False, True])
def test_a_module_built_on_meta_has_the_loaded_ones_dtypes(tiny_kit, tmp_path, critic):
    """Ranks > 0 build on meta what rank 0 loads with from_pretrained; a bf16 critic's backbone came out in fp32
    there, and FSDP2 then refused the mixed dtypes in update (2 ranks, gae, model.dtype bfloat16)."""
    bp = tiny_blueprint(tiny_kit, tmp_path, model__dtype="bfloat16")
    loaded = M.build_module(tiny_kit["model_dir"], bp.model, critic=critic)
    meta = M.build_module(tiny_kit["model_dir"], bp.model, critic=critic, meta=True)
    dtypes = lambda m: {n: p.dtype for n, p in m.named_parameters()}  # noqa: E731
    assert dtypes(meta) == dtypes(loaded) and set(dtypes(meta).values()) == {torch.bfloat16}
    assert {n: b.dtype for n, b in meta.named_buffers()} == {n: b.dtype for n, b in loaded.named_buffers()}


LLAMA_SLOW = pytest.mark.slow(reason="covered by the qwen2 case and test_algorithms' update of every estimator")


@pytest.mark.parametrize("arch,fsdp,estimator,packed,fused", [
    pytest.param("llama", 2, "rloo", True, True, marks=LLAMA_SLOW),
    ("qwen2", 1, "gae", True, False),
    pytest.param("llama", 1, "reinforce_plus_plus", False, True, marks=LLAMA_SLOW)])
def test_architectures_fsdp_versions_and_estimators(tiny_kit, tiny_llama_kit, tmp_path, arch, fsdp, estimator, packed,
                                                    fused):
    """packed: the padding-free update (token-balanced micro-batches on 2 ranks; FSDP2 also defers grad sync);
    fused: the chunked log-prob head inside FSDP's root forward. In a warm pool (fresh jobs: the `staged`
    fixture), so the critic and FSDP1 also go through the model cache."""
    kit = tiny_llama_kit if arch == "llama" else tiny_kit
    bp = tiny_blueprint(kit, tmp_path, fsdp__version=fsdp, algorithm__adv_estimator=estimator,
                        algorithm__use_remove_padding=packed, algorithm__ppo_max_token_len_per_gpu=60 if packed else None,
                        algorithm__use_fused_kernels=fused, fsdp__defer_grad_sync=packed, resources__warm_workers=True,
                        iterations=2)
    results = run_pipeline(bp, "r", **QUIET)
    build, update = results[1].manifest["metrics"], results[3].manifest["metrics"]
    assert build["policy_fsdp_units"] == 3
    assert build["policy_shard_balance"] == pytest.approx([1.0, 1.0], abs=0.1)
    assert all(row["grad_norm"] > 0 for row in update["mini_batches"])
    if estimator == "gae":
        assert "critic_params" in build and "vf_loss" in update["mini_batches"][0]
        assert {"vf_loss", "vf_clipfrac", "vpred_mean", "vf_explained_var"} <= set(update)  # what trackers read
    assert (tmp_path / "runs/r/2/export/hf/model.safetensors").is_file()
    if kit["tie_word_embeddings"]:  # one head/embedding parameter on every rank: one optimizer state for it
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(tmp_path / "runs/r/2/update/policy/dcp")).read_metadata().state_dict_metadata
        assert "optim.state.model.embed_tokens.weight.exp_avg" in keys
        assert not [k for k in keys if k.startswith("optim.state.lm_head")]
    want = ["critic", "policy", "ref"] if estimator == "gae" else ["policy", "ref"]
    assert results[6].manifest["metrics"]["warm_cache_hits"] == want  # update[2] started from memory
    assert update["warm_cache_hits"] == [r for r in want if r != "ref"]  # update[1] from the build's models


# ---- bad input: a clear error naming the field, nothing committed -------------------------------------


def _nothing_committed(store, run_id, stage, it):
    assert not (store / f"runs/{run_id}/{it}/{stage}").exists()


@pytest.mark.slow(reason="covered by test_cli::test_bad_input_is_refused_clearly")
def test_dataset_missing_columns_fails_validate(tiny_kit, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]]}), bad)
    bp = tiny_blueprint(tiny_kit, tmp_path / "s", data__train_files=[str(bad)])
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(bp, "bad", **QUIET), "validate", "init", {})
    assert e.value.kind is FailureKind.USER_ERROR
    assert "data.train_files" in str(e.value) and "data_source" in str(e.value)
    _nothing_committed(tmp_path / "s", "bad", "validate", "init")


@pytest.mark.slow(reason="covered by test_preflight and test_cli::test_bad_input_is_refused_clearly")
def test_unknown_reward_and_bad_model_reported_together(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "s", reward__function="no_such_reward")
    bp.model.path = str(tmp_path / "nope")
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(bp, "bad", **QUIET), "validate", "init", {})
    msg = str(e.value)
    assert "reward.function" in msg and "no_such_reward" in msg and "model.path" in msg
    _nothing_committed(tmp_path / "s", "bad", "validate", "init")


@pytest.mark.slow(reason="covered by test_preflight::test_prompts_over_max_prompt_length")
def test_overlong_prompt_fails_rollout(staged_copy, tmp_path):
    bp, store, _ = staged_copy
    short = bp.model_copy(deep=True)
    short.data.max_prompt_length = 4
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(short, "eq", **QUIET), "rollout", 9,
                  {"build": "runs/eq/init/build", "policy": "runs/eq/init/build"})
    assert "data.max_prompt_length=4" in str(e.value)
    _nothing_committed(store, "eq", "rollout", 9)


@pytest.mark.slow(reason="covered by test_stages::test_missing_input_is_a_clear_error")
def test_checkpoint_of_another_model_is_refused(staged_copy, tiny_llama_kit, tmp_path):
    bp, store, _ = staged_copy
    # A build of the llama kit, then an update that feeds it the qwen2 run's policy.
    other = tiny_blueprint(tiny_llama_kit, store)
    run_stage(RunContext(other, "other", **QUIET), "build", "init", {})
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(other, "other", **QUIET), "update", 1,
                  {"build": "runs/other/init/build", "policy": "runs/eq/1/update", "rollout": "runs/eq/1/rollout"})
    assert "does not match" in str(e.value)
    _nothing_committed(store, "other", "update", 1)


def test_missing_input_is_a_clear_error(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path)
    with pytest.raises(StoreError, match="not committed"):
        run_stage(RunContext(bp, "x", **QUIET), "rollout", 1,
                  {"build": "runs/x/init/build", "policy": "runs/x/init/build"})


def test_nonfinite_loss_commits_nothing(staged_copy, monkeypatch):
    bp, store, _ = staged_copy
    monkeypatch.setenv("VERLFLOW_FAULT", "nan_loss")
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(bp, "eq", **QUIET), "update", 7,
                  {"build": "runs/eq/init/build", "policy": "runs/eq/init/build", "rollout": "runs/eq/1/rollout"})
    assert e.value.kind is FailureKind.NONFINITE and not e.value.retryable
    _nothing_committed(store, "eq", "update", 7)


def test_wrong_world_size_for_batch_is_refused_before_launch(tiny_kit, tmp_path):
    from verlflow.core.errors import BlueprintError

    with pytest.raises(BlueprintError, match="divide across 3 ranks"):
        tiny_blueprint(tiny_kit, tmp_path, resources__nproc_per_node=3)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow(reason="covered by test_stages::test_rerun_reuses_and_resumes_at_another_world_size")
def test_blueprint_lr_overrides_the_checkpointed_optimizer(staged_copy):
    """The optimizer state saved by update[1] carries lr=3e-3; an update run with another lr must use it. (The
    build's checkpoint holds no optimizer state: it never stepped.)"""
    bp, store, _ = staged_copy
    other = bp.model_copy(deep=True)
    other.algorithm.lr = 1.5e-3
    res = run_stage(RunContext(other, "eq", **QUIET), "update", 8,
                    {"build": "runs/eq/init/build", "policy": "runs/eq/1/update", "rollout": "runs/eq/2/rollout"})
    assert {row["lr"] for row in res.manifest["metrics"]["mini_batches"]} == {1.5e-3}
