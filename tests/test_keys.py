"""Stage keys survive a release that does not touch the maths: a copy of the package with an edited CLI, backend or
store computes the same keys for every stage of a run (the run resumes); an edit of the update's maths changes the
update's key and those of every stage after it; a comment or docstring edit changes nothing."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from tinybp import tiny_blueprint

from verlflow.core.orchestrate.pipeline import plan
import verlflow.core.orchestrate.runner as runner
from verlflow.core.stagespec import SPECS
from verlflow.core.store.keys import stage_code_versions

pytestmark = pytest.mark.unit

CORE = Path(runner.__file__).parents[1]


@pytest.fixture
def pkg(tmp_path):
    """A copy of the core package to edit."""
    dst = tmp_path / "core"
    shutil.copytree(CORE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} no longer has {old!r}"
    path.write_text(text.replace(old, new, 1))


def plan_keys(bp, versions: dict) -> dict[str, str]:
    """{step: key} of a 2-iteration run, each step's inputs keyed by the earlier steps' keys, with `versions`."""
    saved = runner._CODE_VERSION
    runner._CODE_VERSION = versions
    try:
        keys, by_path = {}, {}
        for step in plan(bp, "r"):
            k = runner.compute_key(step.stage, bp, step.iteration, {n: by_path[p] for n, p in step.inputs.items()})
            keys[step.name] = by_path[f"runs/r/{step.iteration}/{step.stage}"] = k
        return keys
    finally:
        runner._CODE_VERSION = saved


@pytest.fixture
def bp(tiny_kit, tmp_path):
    return tiny_blueprint(tiny_kit, tmp_path / "store", iterations=2)


def test_editing_the_plan_backends_runner_and_store_keeps_every_key(pkg, bp):
    before = plan_keys(bp, stage_code_versions(pkg))
    edit(pkg / "orchestrate/pipeline.py", "\nimport ", "\n# a typo fixed in a comment\nimport ")
    edit(pkg / "orchestrate/backends/slurm.py", "\nimport ", "\nSBATCH_POLL_S = 2.5  # a behaviour change of the backend\nimport ")
    edit(pkg / "orchestrate/runner.py", "\nimport ", "\nRUNNER_NOTE = 'changed'\nimport ")
    edit(pkg / "store/artifacts.py", "\nimport ", "\nSTORE_NOTE = 'changed'\nimport ")
    edit(pkg / "orchestrate/launcher.py", "\nimport ", "\nLAUNCH_NOTE = 'changed'\nimport ")
    # what a stage reports, where caches live, and what retention prunes: none of it computes a stage's outputs
    edit(pkg / "ml/compiletime.py", "\nKEYS = ", "\nREPORT_NOTE = 'changed'\nKEYS = ")
    edit(pkg / "cachedir.py", "\nimport ", "\nCACHE_NOTE = 'changed'\nimport ")
    edit(pkg / "store/retention.py", "\nimport ", "\nPRUNE_NOTE = 'changed'\nimport ")
    assert plan_keys(bp, stage_code_versions(pkg)) == before


def test_comments_and_docstrings_of_the_maths_keep_every_key(pkg, bp):
    before = stage_code_versions(pkg)
    edit(pkg / "ml/ppo.py", '"""', '"""A docstring typo fixed. ')
    text = (pkg / "ml/ppo.py").read_text()
    (pkg / "ml/ppo.py").write_text(text.replace("\n\n\ndef ", "\n\n\n# a new comment\ndef ", 1))
    edit(pkg / "ml/ppo.py", 'log = logging.getLogger("verlflow.ppo")', 'log = logging.getLogger("verlflow.ppo")  # why')
    assert stage_code_versions(pkg) == before


def test_editing_the_update_maths_changes_the_update_key_and_every_later_one(pkg, bp):
    before = plan_keys(bp, stage_code_versions(pkg))
    edit(pkg / "ml/ppo.py", "\nimport ", "\nEXTRA_SCALE = 1.0001\nimport ")
    after = plan_keys(bp, stage_code_versions(pkg))
    same = {name for name in before if before[name] == after[name]}
    assert same == {"validate[init]", "build[init]", "rollout[1]"}, same  # update[1] and all after it changed


def test_the_stage_runtime_is_plumbing_and_the_loads_it_calls_are_maths(pkg):
    """Every module under core/stages/runtime/ keeps every key (the models it takes from memory equal a load); how a
    model is loaded from its checkpoint (core/stages/loads.py, which the runtime calls) is the stages' maths."""
    before = stage_code_versions(pkg)
    for module in sorted((pkg / "stages/runtime").glob("*.py")):
        edit(module, '"""\n', '"""\nRUNTIME_NOTE = "changed"\n')
    assert stage_code_versions(pkg) == before
    edit(pkg / "stages/loads.py", "\nimport ", "\nLOAD_NOTE = 'changed'\nimport ")
    after = stage_code_versions(pkg)
    assert all(before[s] != after[s] for s in ("rollout", "update", "evaluate", "export")), after


def test_editing_fastgen_changes_the_rollout_key(pkg, bp):
    before = stage_code_versions(pkg)
    edit(pkg / "ml/fastgen/sampling.py", "\nimport ", "\nEXTRA = 1\nimport ")  # reached through a function-level import
    after = stage_code_versions(pkg)
    assert before["rollout"] != after["rollout"] and before["build"] == after["build"]


def test_a_stage_version_bump_reruns_that_stage_and_the_later_ones(pkg, bp, monkeypatch):
    before = plan_keys(bp, stage_code_versions(pkg))
    monkeypatch.setitem(SPECS, "export", replace(SPECS["export"], version=SPECS["export"].version + 1))
    after = plan_keys(bp, stage_code_versions(pkg))
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed == ["export[1]", "export[2]"], changed  # nothing reads a checkpoint stage


def test_the_static_engines_batching_reruns_what_samples_and_nothing_before(bp):
    """rollout.batching decides which rows a static engine's samples come from: a change reruns the rollouts (and
    what reads them) and the evaluations, not validate's inputs to the build nor the build."""
    other = bp.model_copy(deep=True)
    other.rollout.batching = "micro_batches"
    versions = stage_code_versions()
    a, b = plan_keys(bp, versions), plan_keys(other, versions)
    changed = {step for step in a if a[step] != b[step]}
    assert {"rollout[1]", "update[1]", "rollout[2]"} <= changed and "build[init]" not in changed
    for stage in ("rollout", "evaluate"):
        assert runner.compute_key(stage, bp, 1, {}) != runner.compute_key(stage, other, 1, {}), stage
