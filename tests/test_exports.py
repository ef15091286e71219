"""HF exports that cost less (issue 15, item 3): in the model's dtype (storage.export_dtype), every
storage.export_every iterations and at the last, and in a warm pool written in the background before the commit.

The stages an export reads (build, rollout, update) are cloned from the session's reference run
(tests/reference.py) where the subject is the export alone; the cadence test runs its own tiny pipeline in one
warm pool (1 rank)."""

import json
import struct

import pytest
import torch
from prefect_server import api
from reference import clone_stages
from tinybp import ONE_RANK, tiny_blueprint

from verlflow.core.blueprint import load_blueprint
from verlflow.core.errors import BlueprintError, InputError
from verlflow.core.ml import checkpoint, model as M
from verlflow.core.ml.export import export_dtype
from verlflow.core.orchestrate.launcher import StageFailure
from verlflow.core.orchestrate.pipeline import checked_plan, plan, run_pipeline
from verlflow.core.orchestrate.pool import warm_pools
from verlflow.core.orchestrate.runner import RunContext, run_stage
from verlflow.core.store.artifacts import open_store

pytestmark = pytest.mark.system

QUIET = dict(on_line=lambda line: None)
EXPORT_INPUTS = [("init", "build"), (1, "rollout"), (1, "update")]


def _weights_of_update(store_root, run_id: str, it: int, bp) -> dict:
    """The update's DCP policy weights, as the export reads them (fp32 master weights on the tiny kit)."""
    model = M.build_module(store_root / f"runs/{run_id}/init/build/hf_meta", bp.model)
    checkpoint.load_full(store_root / f"runs/{run_id}/{it}/update/policy", model)
    return model.state_dict()


def _header_dtypes(path) -> set[str]:
    """The dtypes a safetensors file's header records (what is on disk, not what a loader converts to)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _export_step(bp, run_id: str, it: int):
    return next(s for s in plan(bp, run_id) if s.name == f"export[{it}]")


def test_auto_export_dtype_is_the_model_folders_own(tiny_kit, tmp_path):
    """auto: the config's `dtype` (transformers 5) or `torch_dtype` (older folders, Qwen2.5's), else model.dtype;
    a set export_dtype wins; a dtype no export can have is refused naming the file and the field."""
    bp = tiny_blueprint(tiny_kit, tmp_path / "store")

    def with_config(**config) -> str:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
        return export_dtype(bp.storage, bp.model, tmp_path)

    assert with_config(torch_dtype="bfloat16") == "bfloat16"
    assert with_config(dtype="float16", torch_dtype="float32") == "float16"
    assert with_config() == bp.model.dtype == "float32"
    bp.storage.export_dtype = "bfloat16"
    assert with_config(dtype="float32") == "bfloat16"
    bp.storage.export_dtype = "auto"
    with pytest.raises(InputError) as e:
        with_config(dtype="int8")
    assert str(tmp_path / "config.json") in str(e.value) and "storage.export_dtype" in str(e.value)


def test_a_bf16_export_is_bf16_on_disk_loads_and_equals_the_dcp_weights(reference, tmp_path):
    """export_dtype: bfloat16 from fp32 master weights: every tensor BF16 in the file, config.json says so,
    from_pretrained gives a bf16 model, and the weights are the update's checkpoint cast to bf16, exactly (half the
    reference's fp32 export)."""
    root = tmp_path / "store"
    bp = tiny_blueprint(reference.kit, root, resources__nproc_per_node=1, storage__export_dtype="bfloat16")
    store = open_store(bp.storage)
    clone_stages(open_store(reference.bp.storage), "eq", "b16", EXPORT_INPUTS, dst_store=store)
    res = run_stage(RunContext(bp, "b16", **QUIET), "export", 1, _export_step(bp, "b16", 1).inputs)
    hf = root / "runs/b16/1/export/hf"
    assert not res.skipped and _header_dtypes(hf / "model.safetensors") == {"BF16"}
    assert res.manifest["metrics"]["export_dtype"] == "bfloat16"
    config = json.loads((hf / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # the model folder's own config otherwise
    want = {k: v.to(torch.bfloat16) for k, v in _weights_of_update(root, "b16", 1, bp).items()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf)
    got = model.state_dict()
    assert model.dtype == torch.bfloat16 and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write the digit 3 twice."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]
    fp32 = reference.root / "runs/eq/1/export/hf/model.safetensors"
    assert (hf / "model.safetensors").stat().st_size < 0.6 * fp32.stat().st_size
    assert store.get_pointer("runs/b16/latest")["hf_uri"] == store.uri("runs/b16/1/export/hf")


def test_export_every_plans_checkpoints_on_those_iterations_and_the_last(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path, iterations=5, storage__export_every=2)
    names = [s.name for s in plan(bp, "p")]
    assert [n for n in names if n.startswith("export")] == ["export[2]", "export[4]", "export[5]"]
    assert names[-4:] == ["export[4]", "rollout[5]", "update[5]", "export[5]"]
    assert names[names.index("update[3]") + 1] == "rollout[4]"
    with pytest.raises(BlueprintError) as e:
        checked_plan(bp, "p", "export[3]")
    assert "storage.export_every" in str(e.value) and "export[4]" in str(e.value)
    every = load_blueprint(None, ["storage.export_every=1"], data=bp.model_dump(mode="json"))
    assert [s.iteration for s in plan(every, "p") if s.stage == "export"] == [1, 2, 3, 4, 5]


@pytest.mark.slow(
    reason="covered by test_exports::test_export_every_plans_checkpoints_on_those_iterations_and_the_last")
def test_export_every_two_of_five_exports_and_promotes_at_2_4_5_only_and_a_rerun_skips_all(prefect_server, tiny_kit,
                                                                                          tmp_path):
    """After every step, the run's `latest` names the last export so far; only iterations 2, 4 and 5 have a
    checkpoint stage (an export) in the store. The rerun, as the Prefect flow (its run report has a row per
    iteration, with the checkpoint's only where there is one), reuses every stage."""
    bp = tiny_blueprint(tiny_kit, tmp_path, *ONE_RANK, iterations=5, storage__export_every=2,
                        resources__warm_workers=True, resources__async_checkpoint=False)
    store = open_store(bp.storage)
    latest = {}

    def seen(step, res):
        latest[step.name] = (store.get_pointer("runs/e/latest") or {}).get("iteration")

    results = run_pipeline(bp, "e", on_step=seen, **QUIET)
    assert [f"{r.manifest['stage']}[{r.manifest['iteration']}]" for r in results if r.manifest["stage"] ==
            "export"] == ["export[2]", "export[4]", "export[5]"]
    assert sorted(p.parent.parent.name for p in (tmp_path / "runs/e").glob("*/export/manifest.json")) == [
        "2", "4", "5"]
    assert not list((tmp_path / "runs/e").glob("[13]/export"))
    assert {n: latest[n] for n in ("update[1]", "update[2]", "export[2]", "update[3]", "update[4]",
                                   "export[4]", "update[5]", "export[5]")} == {
        "update[1]": None, "update[2]": None, "export[2]": 2, "update[3]": 2, "update[4]": 2,
        "export[4]": 4, "update[5]": 4, "export[5]": 5}
    pointer = store.get_pointer("runs/e/latest")
    assert pointer["update"] == "runs/e/5/update" and pointer["export"] == "runs/e/5/export"

    again = run_pipeline(bp, "e", **QUIET)
    assert len(again) == 2 + 2 * 5 + 3 and all(r.skipped for r in again)

    # The flow's run report over these steps: a row per iteration, its checkpoint's only where there is one, and
    # the summary names the last export's folder.
    from prefect import flow

    from verlflow.tasks.report import RunReport

    @flow
    def report_of_the_run() -> list[dict]:
        report = RunReport(bp, "e")
        for step, res in zip(plan(bp, "e"), again):
            report.step_done(step, res)
        return report.rows

    state = report_of_the_run(return_state=True)
    rows = state.result()
    assert [(r["iteration"], r["reused"], r["checkpoint_s"] is not None) for r in rows] == [
        (1, "rollout,update", False), (2, "rollout,update,export", True), (3, "rollout,update", False),
        (4, "rollout,update,export", True), (5, "rollout,update,export", True)]
    fr = str(state.state_details.flow_run_id)
    arts = api(prefect_server, "/artifacts/filter", {"artifacts": {"key": {"any_": ["e-summary"]},
                                                                   "flow_run_id": {"any_": [fr]}}})
    summary = max(arts, key=lambda a: a["created"])["data"]  # one version per row
    assert "5 of 5 iterations done" in summary and "- Promoted policy: iteration 5; HF folder:" in summary
    assert "runs/e/5/export/hf" in summary


@pytest.mark.slow(reason="covered by test_pool::test_a_crash_during_a_background_commit_commits_nothing_after_it")
def test_a_warm_pool_exports_in_the_background_and_a_crash_there_commits_and_promotes_nothing(
        reference, tmp_path, monkeypatch):
    """resources.async_checkpoint in a warm pool: rank 0 SIGKILLed as the background export begins fails the
    run with nothing of export[1] committed or promoted. The clean rerun, the fresh pool's only job (nothing
    earlier to commit), returns before its export is written (pending), lands it when the pool closes, promotes
    it, and its file is byte for byte the inline export of the same update (the reference's, a fresh job)."""
    root = tmp_path / "store"
    bp = tiny_blueprint(reference.kit, root, resources__nproc_per_node=1, resources__warm_workers=True,
                        resources__retries=0)
    assert bp.resources.async_checkpoint  # the default
    store = open_store(bp.storage)
    clone_stages(open_store(reference.bp.storage), "eq", "bg", EXPORT_INPUTS, dst_store=store)
    inputs = _export_step(bp, "bg", 1).inputs
    monkeypatch.setenv("VERLFLOW_FAULT", "kill_rank0_in_export")
    monkeypatch.setenv("VERLFLOW_FAULT_ONCE", str(tmp_path / "fired"))
    lines = []
    with pytest.raises(StageFailure):
        with warm_pools() as pools:
            run_stage(RunContext(bp, "bg", on_line=lines.append, pools=pools), "export", 1, inputs)
    assert "SIGKILL in export" in "\n".join(lines)
    assert store.read_manifest("runs/bg/1/export") is None
    assert not (root / "runs/bg/1/export/hf/model.safetensors").exists()
    assert not list((root / "pointers").rglob("*.json"))  # nothing promoted

    monkeypatch.delenv("VERLFLOW_FAULT")
    with warm_pools() as pools:
        res = run_stage(RunContext(bp, "bg", pools=pools, **QUIET), "export", 1, inputs)
        assert res.pending  # the stage returned; its export is written by the pool's committer
    landed = store.read_manifest("runs/bg/1/export")
    assert landed["timings"]["export_s"] > 0 and landed["timings"]["background_s"] >= 0
    assert store.get_pointer("runs/bg/latest")["export"] == "runs/bg/1/export"
    inline = open_store(reference.bp.storage).read_manifest("runs/eq/1/export")["files"]["hf/model.safetensors"]
    assert landed["files"]["hf/model.safetensors"]["sha256"] == inline["sha256"]
