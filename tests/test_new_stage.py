"""A new stage kind is one spec plus one worker file: keyed, run under torchrun, committed, reused, rerun when a
field its spec hashes changes; no other table to visit."""

import os
from pathlib import Path

import pytest
from tinybp import FRESH_JOBS, ONE_RANK, tiny_blueprint

from verlflow.core.orchestrate import runner
from verlflow.core.orchestrate.runner import RunContext, run_stage
from verlflow.core.stagespec import SPECS, StageSpec

pytestmark = pytest.mark.stages

HERE = Path(__file__).resolve().parent


def test_a_stage_kind_made_of_a_spec_and_a_worker_runs_commits_and_reruns(tiny_kit, tmp_path, monkeypatch):
    monkeypatch.setitem(SPECS, "hello", StageSpec("hello", key_sections=("seed",), worker="hello_stage"))
    monkeypatch.setattr(runner, "_CODE_VERSION", None)  # the code versions are computed per spec
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}

    def run(seed: int):
        bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, FRESH_JOBS, seed=seed)
        return run_stage(RunContext(bp, "new", on_line=lambda line: None, env=env), "hello", "init", {})

    first = run(1)
    assert not first.skipped and first.manifest["stage"] == "hello" and first.manifest["metrics"] == {"greetings": 1}
    assert (tmp_path / "store/runs/new/init/hello/hello.txt").read_text() == "hello from seed 1"
    assert run(1).skipped  # the same key: reused
    again = run(2)  # a field its spec hashes
    assert not again.skipped and again.key != first.key
    assert (tmp_path / "store/runs/new/init/hello/hello.txt").read_text() == "hello from seed 2"
