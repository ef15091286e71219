"""Promotion decided by a metric (promote.metric, mode, min_delta): the gated `latest` pointers of a run and of its
blueprint, the `best` pointers, `verlflow promote RUN ITER` and `verlflow rollback NAME`, and validate's list of
metric names; a recurring chain (schedule.init_from: previous): its start policies, data cursor and seeds.

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

from verlflow.flows.cli import main
from verlflow.core.orchestrate.pipeline import run_pipeline
from verlflow.core.store.artifacts import open_store
from verlflow.core.store.retention import retain

pytestmark = pytest.mark.system

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


def test_a_run_that_never_beats_its_start_policy_promotes_nothing_and_says_so(tiny_kit, tmp_path, monkeypatch,
                                                                              capsys):
    """The gate on a real evaluation (eval/reward_mean on the tiny task's held-out split, greedy): the base model's
    evaluation (evaluate[0]) is the score to beat. A run trained against the task (its reward is 1 - the task's;
    the evaluation keeps scoring the task) never beats it, so neither its run's nor its blueprint's pointer moves,
    and the CLI's summary and the gate's log say why."""
    from verlflow.core.metrics import available, of_iteration
    from verlflow.core.orchestrate.logsink import log_folder
    from verlflow.core.store.promote import export_verdict
    from tinybp import tiny_overrides

    (tmp_path / "antireward.py").write_text(ANTI_REWARD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver's validate resolves the reward too
    eval_file = tmp_path / "held.parquet"
    pq.write_table(pq.read_table(tiny_kit["test_file"]).slice(0, 8), eval_file)
    overrides = tiny_overrides(tiny_kit, tmp_path / "store", *ONE_RANK, "resources.warm_workers=true", "name=worse",
                               f"eval.files={json.dumps([str(eval_file)])}", "eval.reward=tiny_digits",
                               "promote.metric=eval/reward_mean", "algorithm.lr=1e-2", "iterations=1",
                               "reward.function=antireward:anti")
    assert main(["run", *overrides, "--run-id", "w"]) == 0
    out = capsys.readouterr().out
    store = open_store(tiny_blueprint(tiny_kit, tmp_path / "store").storage)
    evals = {i: of_iteration(store, "w", i)["eval/reward_mean"] for i in (0, 1)}
    assert evals[1] <= evals[0], evals  # trained against the task: no better held out
    for name in ("runs/w/latest", "runs/w/best", "blueprints/worse/latest", "blueprints/worse/best"):
        assert pointer(store, name) is None, name
    assert (f"No policy promoted: no export of this run beat its start policy's eval/reward_mean={evals[0]:.4g} "
            "(evaluate[0])") in out, out
    assert "latest policy (HF folder)" not in out
    gate_log = "".join(f.read_text() for f in log_folder(store, "w").glob("*.log"))
    assert (f"not promoted: w iteration 1 has eval/reward_mean={evals[1]}, not better than its start policy's "
            f"eval/reward_mean={evals[0]} (evaluate[0])") in gate_log, gate_log
    assert export_verdict(store, "w", 1) == "not promoted: the run's latest pointer names no policy"
    # the names the run recorded (eval's included) are among those validate offers for promote.metric
    assert set(of_iteration(store, "w", 1)) <= set(available(tiny_blueprint(tiny_kit, tmp_path, *overrides)))


def trained_rows(store_root: Path, run_id: str, iteration: int) -> list[int]:
    """The prompt rows (of the train file) an iteration's rollout sampled, in its batch's order."""
    samples = pq.read_table(store_root / f"runs/{run_id}/{iteration}/rollout/samples.parquet").to_pylist()
    return [row for _, row in sorted({s["group"]: s["row"] for s in samples}.items())]


@pytest.mark.slow(reason="covered by test_schedule::test_a_scheduled_batch_gets_three_run_ids_that_train_and_warm_start"
                         "_in_order (served nights, a failed gate, an epoch's wrap, a rerun)")
def test_a_recurring_chain_starts_from_the_promoted_policy_continues_the_data_and_never_repeats_a_training(
        tiny_kit, tmp_path):
    """The issue's nights: four one-iteration runs of one blueprint with schedule.init_from: previous, gated by
    update/step with mode min. Run 1 starts from the base model (nothing promoted yet); runs 2 to 4 take as many
    steps, so none beats run 1 and each starts from run 1's policy again. Still, the chain's prompts run on from
    run to run, across epochs (an 8-row train file: each epoch visits every row once), each run has its own seed
    (a rerun keeps it), and no two runs train on the same rows from the same policy with the same seed."""
    train_file = tmp_path / "train8.parquet"
    pq.write_table(pq.read_table(tiny_kit["train_file"]).slice(0, 8), train_file)
    root = tmp_path / "store"

    def run(run_id: str) -> list:
        lines: list[str] = []
        bp = tiny_blueprint(tiny_kit, root, *GATED, "promote.mode=min", "name=chain", "schedule.init_from=previous",
                            f"data.train_files={json.dumps([str(train_file)])}")
        results = run_pipeline(bp, run_id, on_line=lines.append)
        logs[run_id] = "\n".join(lines)
        return results

    def build(run_id: str) -> dict:
        return store.read_manifest(f"runs/{run_id}/init/build")

    def warm_start(run_id: str) -> str | None:
        return build(run_id)["inputs"].get("warm_start", {}).get("stage")

    store, logs, nights = open_store(tiny_blueprint(tiny_kit, root).storage), {}, ("c1", "c2", "c3", "c4")
    for run_id in nights:
        run(run_id)
    latest = pointer(store, "blueprints/chain/latest")
    assert (latest["run_id"], [e["run_id"] for e in latest["history"]]) == ("c1", ["c1"])  # the others failed it
    assert [warm_start(r) for r in nights] == [None] + ["runs/c1/1/update"] * 3
    built = {r: build(r)["metrics"] for r in nights}
    assert "the base model" in built["c1"]["start"] and "named no policy of another run" in built["c1"]["start"]
    assert all("the policy of run c1 iteration 1" in built[r]["start"] for r in nights[1:])
    assert "build: starts from the policy of run c1 iteration 1" in logs["c4"]  # the build's log says it too

    # The chain's prompts: each run starts where the one before left off (4 prompts an iteration), in one order.
    assert [built[r]["chain_position"] for r in nights] == [0, 1, 2, 3]
    assert [built[r]["data_cursor"] for r in nights] == [0, 4, 8, 12]
    assert len({built[r]["data_seed"] for r in nights}) == 1
    rows = {r: trained_rows(root, r, 1) for r in nights}
    stream = [row for r in nights for row in rows[r]]
    assert sorted(stream[:8]) == sorted(stream[8:]) == list(range(8)), stream  # each epoch: every row once

    # Each run its own seed; no training repeated.
    seeds = [built[r]["seed"] for r in nights]
    assert len(set(seeds)) == 4, seeds
    assert len({(tuple(rows[r]), warm_start(r), built[r]["seed"]) for r in nights}) == 4
    # A rerun keeps its seed and its place in the chain: every stage is reused.
    assert all(res.skipped for res in run("c2"))


@pytest.mark.slow(reason="covered by test_phases::test_a_run_ending_in_dpo_promotes_its_export_by_a_dpo_metric (a max"
                         " gate that promotes, end to end) and test_promote's gate")
def test_mode_max_promotes_every_better_policy(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *GATED, "promote.mode=max", "name=up", "iterations=2")
    run_pipeline(bp, "u", **QUIET)
    store = open_store(bp.storage)
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
    store, root = open_store(bp.storage), str(tmp_path / "store")
    raw = tmp_path / "store/pointers/blueprints/hand/latest.json"
    # The gate kept latest at 1; keep_last=1 kept the last export, the promoted one stayed, the gated-out 2 went.
    assert pointer(store, "runs/h/latest")["iteration"] == 1
    held = {i: not store.read_manifest(f"runs/h/{i}/export").get("pruned") for i in (1, 2, 3)}
    assert held == {1: True, 2: False, 3: True}

    def refused(*argv, says: tuple[str, ...]):
        before = raw.read_bytes(), (tmp_path / "store/pointers/runs/h/latest.json").read_bytes()
        p = cli(*argv)
        assert p.returncode != 0 and p.stdout == "" and "Traceback" not in p.stderr, p
        assert all(s in p.stderr for s in says), p.stderr
        assert (raw.read_bytes(), (tmp_path / "store/pointers/runs/h/latest.json").read_bytes()) == before

    refused("rollback", "hand", f"storage.uri={root}", says=("no earlier policy", "h iteration 1"))
    refused("promote", "h", "7", "--store", root, says=("iteration 7", "no committed export", "nearest: 3"))
    refused("promote", "h", "2", "--store", root, says=("pruned", "1, 3", "nearest: 1"))

    p = cli("promote", "h", "3", "--store", root)
    assert p.returncode == 0, p.stderr
    assert "runs/h/latest: h iteration 1" in p.stdout and "-> h iteration 3" in p.stdout
    assert "blueprints/hand/latest: h iteration 1" in p.stdout
    for name in ("runs/h/latest", "blueprints/hand/latest"):
        assert pointer(store, name)["iteration"] == 3 and pointer(store, name)["history"][-1]["by"] == "promote"
    assert pointer(store, "runs/h/best")["iteration"] == 1  # a person's choice is not the metric's best
    retain(store, bp.storage, "h")  # now only the best pointers name iteration 1 (a history entry pins nothing)
    assert not store.read_manifest("runs/h/1/export").get("pruned")
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
    store.mark_pruned("runs/h/1/export", ("hf/",))
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
    capsys.readouterr()
    # an evaluation metric needs the start policy's evaluation: the score a run must beat to promote anything
    assert main(["validate-blueprint", *base, "promote.metric=eval/accuracy", "eval.before_train=false"]) != 0
    err = capsys.readouterr().err
    assert "promote.metric=eval/accuracy" in err and "set eval.before_train: true" in err, err
    assert main(["validate-blueprint", *base, "promote.metric=update/kl_loss", "eval.before_train=false"]) == 0
    assert not (tmp_path / "store").exists()


def test_a_policy_without_the_metric_is_not_promoted_and_the_log_says_why(tmp_path, caplog):
    """A NaN (the manifests hold only finite metrics: core/metrics.flat) or absent metric moves no pointer."""
    from verlflow.core.blueprint import Blueprint
    from verlflow.core.job import JobSpec
    from verlflow.core.store.artifacts import ArtifactStore
    from verlflow.core.store.promote import PromotePolicy, promote

    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="nm", storage={"uri": str(tmp_path / "store")}, promote={"metric": "update/kl_loss"})
    for it, kl in ((1, 0.5), (2, float("nan"))):
        store.commit(f"runs/r/{it}/update", {"key": f"u{it}", "stage": "update", "metrics": {"kl_loss": kl}}, {})
        job = JobSpec.model_construct(run_id="r", iteration=it, output=f"runs/r/{it}/export",
                                      inputs={"update": f"runs/r/{it}/update", "build": "runs/r/init/build"})
        with caplog.at_level("INFO", logger="verlflow.promote"):
            promote(store, PromotePolicy.of(bp), job, {"metrics": {}})
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
        return {"run_id": "r", "iteration": it, "export": f"runs/r/{it}/export"}

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
