"""Promotion decided by a metric (promote.metric, mode, min_delta): the gated `latest` pointers of a run and of its
blueprint, the `best` pointers, `verlflow promote RUN ITER` and `verlflow rollback NAME`, and validate's list of
metric names.

The nightly story runs on a real evaluation (eval/reward_mean on the tiny task's held-out split). The other gate
tests steer update/step, the optimizer steps taken so far: it grows with every iteration, so with promote.mode min
each later policy is worse by construction, and with max each is better (the rest of the pipeline is the real tiny
run: torchrun, one rank, warm workers).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tinybp import ONE_RANK, prompt_rows, tiny_blueprint

from verlflow.core.orchestrate.cli import main
from verlflow.core.orchestrate.pipeline import plan, run_pipeline, warm_start_source
from verlflow.core.orchestrate.runner import RunContext, open_store, run_stage
from verlflow.core.store.retention import retain

VERLFLOW = str(Path(sys.executable).with_name("verlflow"))
QUIET = dict(on_line=lambda line: None)
GATED = (*ONE_RANK, "resources.warm_workers=true", "promote.metric=update/step")


def pointer(store, name: str) -> dict | None:
    return store.get_pointer(name)


ANTI_REWARD = """
from verlflow.core.ml.rewards import tiny_digits


def anti(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 - tiny_digits(data_source, solution_str, ground_truth, extra_info)
"""


def test_a_night_whose_evaluation_gets_worse_moves_no_pointer_and_the_next_starts_from_the_promoted(
        tiny_kit, tmp_path, monkeypatch):
    """The gate on a real evaluation: night 1 learns the tiny task and is promoted by eval/reward_mean (its held-out
    split, greedy); night 2 warm-starts from it and trains against the task (its reward is 1 - the task's, while the
    evaluation keeps scoring the task): its evaluations get worse, so the blueprint's latest and best stay on night
    1, and night 3 warm-starts from night 1's policy."""
    from verlflow.core.metrics import available, of_iteration

    (tmp_path / "antireward.py").write_text(ANTI_REWARD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver's validate resolves the reward too
    eval_file = tmp_path / "held.parquet"
    pq.write_table(pq.read_table(tiny_kit["test_file"]).slice(0, 8), eval_file)

    def bp(*more):
        return tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "resources.warm_workers=true", "name=nightly",
                              f"eval.files={json.dumps([str(eval_file)])}", "eval.before_train=false",
                              "eval.reward=tiny_digits", "promote.metric=eval/reward_mean", "algorithm.lr=1e-2",
                              *more)

    def evals(run_id, iterations):
        return {i: of_iteration(store, run_id, i)["eval/reward_mean"] for i in iterations}

    first = bp("iterations=2")
    run_pipeline(first, "n1", **QUIET)
    store = open_store(first)
    night1 = evals("n1", (1, 2))
    top = 2 if night1[2] > night1[1] else 1  # strictly better moves the pointer (min_delta 0)
    for name in ("runs/n1/latest", "blueprints/nightly/latest", "runs/n1/best", "blueprints/nightly/best"):
        assert (pointer(store, name)["run_id"], pointer(store, name)["iteration"]) == ("n1", top), name
    best = pointer(store, "blueprints/nightly/best")
    assert (best["metric"], best["value"]) == ("eval/reward_mean", night1[top])
    assert [e["by"] for e in pointer(store, "blueprints/nightly/latest")["history"]] == ["gate"] * top
    # the names the run recorded (eval's included) are among those validate offers for promote.metric
    assert set(of_iteration(store, "n1", 2)) <= set(available(first))

    second = bp("iterations=2", "schedule.init_from=previous", "reward.function=antireward:anti")
    run_pipeline(second, "n2", **QUIET)
    assert store.read_manifest("runs/n2/init/build")["inputs"]["warm_start"]["stage"] == f"runs/n1/{top}/update"
    night2 = evals("n2", (1, 2))
    assert max(night2.values()) < night1[top], (night1, night2)  # trained against the task: worse held out
    for name in ("blueprints/nightly/latest", "blueprints/nightly/best"):
        assert (pointer(store, name)["run_id"], pointer(store, name)["iteration"]) == ("n1", top), name
    assert pointer(store, "runs/n2/latest")["run_id"] == "n2"  # the run's own pointer follows its own best

    third = bp("iterations=1", "schedule.init_from=previous")  # its build is all this needs: where it starts from
    (build,) = [s for s in plan(third, "n3", warm_start_source(third, "n3")) if s.stage == "build"]
    run_stage(RunContext(third, "n3", **QUIET), "build", "init", build.inputs)
    assert store.read_manifest("runs/n3/init/build")["inputs"]["warm_start"]["stage"] == f"runs/n1/{top}/update"


def test_mode_max_promotes_every_better_policy(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *GATED, "promote.mode=max", "name=up", "iterations=2")
    run_pipeline(bp, "u", **QUIET)
    store = open_store(bp)
    latest = pointer(store, "blueprints/up/latest")
    assert latest["iteration"] == 2 and pointer(store, "runs/u/best")["iteration"] == 2
    assert [(e["iteration"], e["from"]) for e in latest["history"]] == [
        (1, None), (2, {"run_id": "u", "iteration": 1})]


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([VERLFLOW, *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_promote_and_rollback_by_hand_through_the_cli(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *GATED, "promote.mode=min", "name=hand", "iterations=3",
                        storage__keep_last=1, storage__keep_best_metric=None)
    run_pipeline(bp, "h", **QUIET)
    store, root = open_store(bp), str(tmp_path / "store")
    raw = tmp_path / "store/pointers/blueprints/hand/latest.json"
    # The gate kept latest at 1; keep_last=1 kept the last export, the promoted one stayed, the gated-out 2 went.
    assert pointer(store, "runs/h/latest")["iteration"] == 1
    held = {i: not store.read_manifest(f"runs/h/{i}/checkpoint").get("pruned") for i in (1, 2, 3)}
    assert held == {1: True, 2: False, 3: True}

    def refused(*argv, says: tuple[str, ...]):
        before = raw.read_bytes(), (tmp_path / "store/pointers/runs/h/latest.json").read_bytes()
        p = cli(*argv)
        assert p.returncode != 0 and p.stdout == "" and "Traceback" not in p.stderr, p
        assert all(s in p.stderr for s in says), p.stderr
        assert (raw.read_bytes(), (tmp_path / "store/pointers/runs/h/latest.json").read_bytes()) == before

    refused("rollback", "hand", f"storage.uri={root}", says=("no earlier policy", "h iteration 1"))
    refused("promote", "h", "7", "--store", root, says=("iteration 7", "no committed checkpoint", "nearest: 3"))
    refused("promote", "h", "2", "--store", root, says=("pruned", "1, 3", "nearest: 1"))

    p = cli("promote", "h", "3", "--store", root)
    assert p.returncode == 0, p.stderr
    assert "runs/h/latest: h iteration 1" in p.stdout and "-> h iteration 3" in p.stdout
    assert "blueprints/hand/latest: h iteration 1" in p.stdout
    for name in ("runs/h/latest", "blueprints/hand/latest"):
        assert pointer(store, name)["iteration"] == 3 and pointer(store, name)["history"][-1]["by"] == "promote"
    assert pointer(store, "runs/h/best")["iteration"] == 1  # a person's choice is not the metric's best
    retain(store, bp, "h")  # now only the best pointers name iteration 1 (a history entry pins nothing)
    assert not store.read_manifest("runs/h/1/checkpoint").get("pruned")
    assert not store.read_manifest("runs/h/1/update").get("pruned")

    p = cli("rollback", "hand", f"storage.uri={root}")
    assert p.returncode == 0, p.stderr
    assert "blueprints/hand/latest: h iteration 3" in p.stdout and "-> h iteration 1" in p.stdout
    latest = pointer(store, "blueprints/hand/latest")
    assert latest["iteration"] == 1 and latest["update"] == "runs/h/1/update"
    assert [(e["by"], e["iteration"]) for e in latest["history"]] == [("gate", 1), ("promote", 3), ("rollback", 1)]
    assert latest["history"][-1]["from"] == {"run_id": "h", "iteration": 3}
    refused("rollback", "hand", f"storage.uri={root}", says=("no earlier policy",))  # 3 was undone, 1 is the first

    # A target whose export went since: promote 3 again, prune 1's export, then roll back to it.
    assert cli("promote", "h", "3", "--store", root).returncode == 0
    store.mark_pruned("runs/h/1/checkpoint", ("hf/",))
    refused("rollback", "hand", f"storage.uri={root}", says=("h iteration 1", "retention pruned", "verlflow promote"))


@pytest.fixture
def eval_file(tmp_path) -> Path:
    path = tmp_path / "heldout.parquet"
    rows = prompt_rows(2)
    rows["data_source"] = ["openai/gsm8k", "tiny_digits"]
    pq.write_table(pa.table(rows), path)
    return path


def test_validate_refuses_an_unknown_promote_metric_and_lists_the_names(tiny_kit, tmp_path, eval_file, capsys):
    from tinybp import tiny_overrides

    base = tiny_overrides(tiny_kit, tmp_path / "store", *ONE_RANK, f"eval.files={json.dumps([str(eval_file)])}",
                          "eval.n=2", "eval.temperature=0.7", "eval.pass_k=[1,2]")
    rc = main(["validate-blueprint", *base, "promote.metric=rollout/reward_meen"])
    err = capsys.readouterr().err
    assert rc != 0 and "promote.metric=rollout/reward_meen" in err and "did you mean rollout/reward_mean" in err
    for name in ("update/kl_loss", "eval/accuracy", "eval/pass@2", "eval/openai/gsm8k/accuracy",
                 "eval/tiny_digits/pass@1"):
        assert name in err
    assert main(["validate-blueprint", *base, "promote.metric=eval/openai/gsm8k/accuracy"]) == 0, capsys.readouterr()
    assert main(["validate-blueprint", *base, "promote.metric=eval/other/accuracy"]) != 0
    assert not (tmp_path / "store").exists()


def test_a_policy_without_the_metric_is_not_promoted_and_the_log_says_why(tmp_path, caplog):
    """A NaN (the manifests hold only finite metrics: core/metrics.flat) or absent metric moves no pointer."""
    from verlflow.core.blueprint import Blueprint
    from verlflow.core.job import JobSpec
    from verlflow.core.store.artifacts import ArtifactStore
    from verlflow.core.store.promote import promote

    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="nm", storage={"uri": str(tmp_path / "store")}, promote={"metric": "update/kl_loss"})
    for it, kl in ((1, 0.5), (2, float("nan"))):
        store.commit(f"runs/r/{it}/update", {"key": f"u{it}", "stage": "update", "metrics": {"kl_loss": kl}}, {})
        job = JobSpec.model_construct(run_id="r", iteration=it, output=f"runs/r/{it}/checkpoint",
                                      inputs={"update": f"runs/r/{it}/update", "build": "runs/r/init/build"})
        with caplog.at_level("INFO", logger="verlflow.promote"):
            promote(store, bp, job, {"metrics": {}})
    assert store.get_pointer("runs/r/latest")["iteration"] == 1
    assert store.get_pointer("blueprints/nm/best")["value"] == 0.5
    assert "not promoted: r iteration 2 has no finite update/kl_loss" in caplog.text


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_pointer_moves_and_their_history_are_one_conditional_write_on_a_folder_and_on_s3(where, tmp_path, request):
    """Two writers moving one pointer at once both land in its history (none lost between read and write)."""
    import threading

    from verlflow.core.store.artifacts import ArtifactStore
    from verlflow.core.store.promote import HISTORY_LEN, move

    uri = str(tmp_path / "store") if where == "folder" else f"{request.getfixturevalue('s3_bucket').uri}/p"
    store = ArtifactStore(uri)

    def policy(it: int) -> dict:
        return {"run_id": "r", "iteration": it, "checkpoint": f"runs/r/{it}/checkpoint"}

    threads = [threading.Thread(target=lambda w=w: [move(store, "runs/r/latest", policy(w * 100 + i), "promote")
                                                    for i in range(8)]) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = store.get_pointer("runs/r/latest")["history"]
    assert sorted(e["iteration"] for e in history) == sorted([100 + i for i in range(8)] + [200 + i for i in range(8)])
    for i in range(HISTORY_LEN):
        move(store, "runs/r/latest", policy(i), "gate")
    after = store.get_pointer("runs/r/latest")
    assert len(after["history"]) == HISTORY_LEN and after["history"][-1]["iteration"] == HISTORY_LEN - 1
