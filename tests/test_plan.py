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
