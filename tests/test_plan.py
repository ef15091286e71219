"""The plan as data: every step wired as its stage's spec says, names, `--from`, and what retention reads of it.

No process, no kit: blueprints with paths that need not exist (planning reads none of them)."""

from dataclasses import replace
from pathlib import Path

import pytest
from tinybp import tiny_blueprint

from verlflow.core.blueprint import load_blueprint
from verlflow.core.errors import BlueprintError
from verlflow.core.orchestrate.pipeline import parse_from, plan, step_spec
from verlflow.core.stagespec import SPECS
from verlflow.core.store import retention

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
NOWHERE = {"model_dir": "/nonexistent/model", "train_file": "/nonexistent/train.parquet"}


def _rl(tmp_path, **fields):
    return tiny_blueprint(NOWHERE, tmp_path / "store", iterations=3, storage__export_every=2,
                          eval__before_train=True, eval__files=["/nonexistent/eval.parquet"], **fields)


def _shipped(name: str, tmp_path):
    return load_blueprint(REPO / "blueprints" / name, [f"storage.uri={tmp_path / 'store'}"])


def test_an_rl_run_is_planned_as_its_specs_say(tmp_path):
    steps = plan(_rl(tmp_path), "r")
    assert [s.name for s in steps] == [
        "validate[init]", "build[init]", "evaluate[0]", "rollout[1]", "update[1]", "evaluate[1]", "rollout[2]",
        "update[2]", "evaluate[2]", "export[2]", "rollout[3]", "update[3]", "evaluate[3]", "export[3]"]
    for s in steps:
        spec = step_spec(s)
        assert set(spec.inputs) <= set(s.inputs) <= set(spec.inputs + spec.optional), s.name
    export = steps[-1].inputs
    assert export == {"build": "runs/r/init/build", "update": "runs/r/3/update", "rollout": "runs/r/3/rollout",
                      "evaluate": "runs/r/3/evaluate"}


@pytest.mark.parametrize("blueprint", ["tiny-phases.yaml", "tiny-judge.yaml"])
def test_phased_runs_and_user_stages_are_planned_as_their_specs_say(blueprint, tmp_path):
    for s in plan(_shipped(blueprint, tmp_path), "r"):
        spec = step_spec(s)
        assert set(spec.inputs) <= set(s.inputs) <= set(spec.inputs + spec.optional), s.name
    user = [s for s in plan(_shipped("tiny-judge.yaml", tmp_path), "r") if s.stage == "user"]
    assert [(s.name, step_spec(s).inputs) for s in user] == [("user[judge]", ("rollout",))]  # its class's inputs


def test_a_step_wired_without_an_input_its_spec_needs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(SPECS, "rollout", replace(SPECS["rollout"], inputs=("build", "policy", "critic")))
    with pytest.raises(AssertionError, match=r"rollout\[1\]: rollout is wired without \['critic'\]"):
        plan(_rl(tmp_path), "r")


def test_a_step_wired_with_an_input_its_spec_does_not_know_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(SPECS, "export", replace(SPECS["export"], optional=("rollout",)))
    with pytest.raises(AssertionError, match=r"export\[2\]: .*unknown inputs \['evaluate'\]"):
        plan(_rl(tmp_path), "r")


def test_from_takes_the_export_by_its_old_name_too(tmp_path):
    steps = plan(_rl(tmp_path), "r")
    names = [s.name for s in steps]
    assert parse_from("checkpoint[2]", steps) == parse_from("export[2]", steps) == names.index("export[2]")
    with pytest.raises(BlueprintError, match=r"--from checkpoint\[1\]: no such step \(an export step runs every"):
        parse_from("checkpoint[1]", steps)


def test_retention_reads_of_each_input_what_its_spec_says():
    for name, spec in SPECS.items():
        for given in (*spec.inputs, *spec.optional):
            assert retention.reads_checkpoint(name, given) == (spec.reads_everything or given in spec.checkpoint_inputs)
    assert retention.reads_checkpoint("export", "update") and not retention.reads_checkpoint("export", "rollout")
    assert retention.reads_checkpoint("checkpoint", "update")  # a manifest of an earlier release's export stage


ASYNC = ("resources.nproc_per_node=4", "rollout.async.staleness=1", "algorithm.rollout_correction=true")


def test_an_async_rollout_samples_an_older_policy_on_its_own_lane_and_refuses_an_uncorrected_update(tmp_path):
    from verlflow.core.orchestrate.pipeline import lane_of

    bp = tiny_blueprint(NOWHERE, tmp_path / "store", *ASYNC, iterations=3)
    steps = {s.name: s for s in plan(bp, "a")}
    assert [steps[f"rollout[{i}]"].inputs["policy"] for i in (1, 2, 3)] == [
        "runs/a/init/build", "runs/a/init/build", "runs/a/1/update"]
    assert steps["update[3]"].inputs["policy"] == "runs/a/2/update"  # it trains the newest, on older samples
    assert {s.name for s in steps.values() if lane_of(bp, s) == "rollout"} == {"rollout[1]", "rollout[2]", "rollout[3]"}
    assert ("runs/a/3/rollout", "runs/a/1/update") in retention_reads(steps.values())  # kept until it sampled
    # the staleness is part of the rollout's and the update's keys; how the node is split is not
    split = tiny_blueprint(NOWHERE, tmp_path / "store", *ASYNC, "resources.nproc_per_node=6",
                           "rollout.async.devices=4", iterations=3)
    on_policy = tiny_blueprint(NOWHERE, tmp_path / "store", iterations=3)
    assert bp.section_hash("rollout") == split.section_hash("rollout") != on_policy.section_hash("rollout")
    with pytest.raises(BlueprintError, match="algorithm.rollout_correction=true .* or algorithm.policy_loss=bypass"):
        tiny_blueprint(NOWHERE, tmp_path / "store", *ASYNC[:2])
    with pytest.raises(BlueprintError, match="give each at least one"):
        tiny_blueprint(NOWHERE, tmp_path / "store", *ASYNC, "rollout.async.devices=4")


def retention_reads(steps) -> list:
    from verlflow.core.orchestrate.pipeline import checkpoint_reads

    return checkpoint_reads(list(steps), "a")
