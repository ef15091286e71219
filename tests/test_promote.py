"""Promotion pointers and retention of exports (keep the last k and the best one by a metric; the rest of
retention: tests/test_retention.py)."""

import json

import pytest

from verlflow.core.blueprint import Blueprint
from verlflow.core.job import JobSpec
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.store.digests import file_digest
from verlflow.core.store.promote import PromotePolicy, promote
from verlflow.core.store.retention import retain as prune

pytestmark = pytest.mark.system


def _fake_checkpoint(store: ArtifactStore, tmp_path, run_id: str, it: int, reward: float) -> dict:
    key = f"runs/{run_id}/{it}/export"
    local = tmp_path / f"hf{it}"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"w" * (10 + it))
    store.upload_dir(local, f"{key}/hf")
    files = {"hf/model.safetensors": file_digest(local / "model.safetensors")}
    # The policy of iteration `it` is ranked by the rollout that sampled from it, the next one.
    store.commit(f"runs/{run_id}/{it + 1}/rollout", {"key": f"r{it + 1}", "stage": "rollout",
                                                     "metrics": {"reward_mean": reward}}, {})
    return store.commit(key, {"key": f"k{it}", "stage": "export", "metrics": {"reward_mean": reward}}, files)


def test_retention_keeps_last_k_and_best(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(storage={"uri": str(tmp_path / "store"), "keep_last": 2, "keep_best_metric": "reward_mean"})
    rewards = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4}
    for it, r in rewards.items():
        _fake_checkpoint(store, tmp_path, "r", it, r)
    pruned = prune(store, bp.storage, "r")
    assert pruned == ["runs/r/1/export", "runs/r/3/export"]
    for it in rewards:
        m = store.read_manifest(f"runs/r/{it}/export")
        assert m is not None  # still committed: a rerun skips it
        exists = (tmp_path / f"store/runs/r/{it}/export/hf/model.safetensors").exists()
        assert exists == (it in (2, 4, 5)) and bool(m.get("pruned")) == (it in (1, 3))
    assert prune(store, bp.storage, "r") == []  # idempotent


def test_promote_moves_latest_pointers(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="nm", storage={"uri": str(tmp_path / "store")})
    for it in (1, 2):
        m = _fake_checkpoint(store, tmp_path, "r", it, 0.1 * it)
        job = JobSpec.model_construct(run_id="r", iteration=it, output=f"runs/r/{it}/export",
                                      inputs={"update": f"runs/r/{it}/update", "build": "runs/r/init/build"})
        promote(store, PromotePolicy.of(bp), job, m)
        for name in ("runs/r/latest", "blueprints/nm/latest"):
            p = store.get_pointer(name)
            assert p["iteration"] == it and p["update"] == f"runs/r/{it}/update"
    assert json.loads((tmp_path / "store/pointers/blueprints/nm/latest.json").read_text())["metrics"]["reward_mean"] == 0.2


def _evaluated(store: ArtifactStore, run_id: str, it: int, reward: float) -> None:
    """A committed evaluation of iteration `it` (0: the start policy)."""
    store.commit(f"runs/{run_id}/{it}/evaluate", {"key": f"e{it}", "stage": "evaluate",
                                                  "metrics": {"reward_mean": reward}}, {})


def _exported(store: ArtifactStore, bp: Blueprint, run_id: str, it: int, reward: float) -> dict | None:
    """Iteration `it` evaluated at `reward`, its checkpoint stage committed, then the gate: what promote returns."""
    _evaluated(store, run_id, it, reward)
    out = f"runs/{run_id}/{it}/export"
    store.commit(out, {"key": f"c{it}", "stage": "export", "metrics": {}}, {})
    job = JobSpec.model_construct(run_id=run_id, iteration=it, output=out,
                                  inputs={"update": f"runs/{run_id}/{it}/update", "build": f"runs/{run_id}/init/build"})
    return promote(store, PromotePolicy.of(bp), job, {"metrics": {}})


def test_the_gate_promotes_only_a_policy_better_than_the_start_and_the_summary_says_which(tmp_path, caplog):
    """The start policy's evaluation (evaluate[0]) is the score to beat for the run's and the blueprint's pointers;
    the blueprint's also has its best across runs."""
    from verlflow.core.store.promote import PromotePolicy, export_verdict, promotion_status

    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="g", storage={"uri": str(tmp_path / "store")}, eval={"files": ["held.parquet"]},
                   promote={"metric": "eval/reward_mean", "min_delta": 0.01})
    _evaluated(store, "r", 0, 0.5)
    with caplog.at_level("INFO", logger="verlflow.promote"):
        for it, reward in ((1, 0.2), (2, 0.505)):  # worse; better by less than min_delta
            assert _exported(store, bp, "r", it, reward) is None
    for name in ("runs/r/latest", "runs/r/best", "blueprints/g/latest", "blueprints/g/best"):
        assert store.get_pointer(name) is None, name
    assert ("not promoted: r iteration 1 has eval/reward_mean=0.2, not better than its start policy's "
            "eval/reward_mean=0.5 (evaluate[0]) by more than promote.min_delta=0.01") in caplog.text
    assert promotion_status(store, PromotePolicy.of(bp), "r") == (
        "No policy promoted: no export of this run beat its start policy's eval/reward_mean=0.5 (evaluate[0]) by "
        "more than promote.min_delta=0.01, so the start policy stays the one to use")
    assert export_verdict(store, "r", 2) == "not promoted: the run's latest pointer names no policy"
    _evaluated(store, "q", 0, 0.5)  # a run whose first export is still committing: nothing to say yet
    assert promotion_status(store, PromotePolicy.of(bp), "q") == (
        "No policy promoted: no export of this run has been committed yet")

    _exported(store, bp, "r", 3, 0.6)
    for name in ("runs/r/latest", "blueprints/g/latest"):
        assert store.get_pointer(name)["iteration"] == 3, name
    assert promotion_status(store, PromotePolicy.of(bp), "r") == "Promoted policy: iteration 3 (eval/reward_mean=0.6)"
    assert (export_verdict(store, "r", 3), export_verdict(store, "r", 2)) == (
        "promoted: the run's latest pointer names it", "not promoted: the run's latest pointer names iteration 3")

    # Another run beats its own start but not the blueprint's best: only its run's pointer moves.
    _evaluated(store, "s", 0, 0.1)
    _exported(store, bp, "s", 1, 0.3)
    assert store.get_pointer("runs/s/latest")["iteration"] == 1
    assert store.get_pointer("blueprints/g/latest")["run_id"] == "r"


def test_a_chain_gives_each_run_its_place_once_and_its_cursor_only_moves_forward(tmp_path):
    from verlflow.core.store.chain import advance, join

    store = ArtifactStore(tmp_path / "store")
    first = join(store, "c", "r1", cursor=6, data_seed=7)  # a new chain: at the first run's warm start's cursor
    assert first == {"position": 0, "data_cursor": 6, "data_seed": 7}
    advance(store, "c", 14)
    assert join(store, "c", "r2", cursor=0, data_seed=9) == {"position": 1, "data_cursor": 14, "data_seed": 7}
    assert join(store, "c", "r1", cursor=0, data_seed=9) == first  # a rerun (even of its build) keeps its place
    advance(store, "c", 10)  # an earlier run resumed: the chain is further on already
    assert join(store, "c", "r3", cursor=0, data_seed=9)["data_cursor"] == 14
    doc = store.get_pointer("blueprints/c/chain")
    assert [(r["run_id"], r["position"]) for r in doc["runs"]] == [("r1", 0), ("r2", 1), ("r3", 2)]
    assert not any("runs/" in json.dumps(v) for v in doc.values())  # no stage key: retention pins nothing for it


def test_the_run_summary_names_the_policy_the_pointer_names_never_the_last_export(tmp_path):
    """A 3-iteration run whose best evaluation is iteration 2: its summary names iteration 2, while the export of
    iteration 3 still commits in the background (the gate decides on it when it lands: no claim), and after."""
    from verlflow.tasks.report import run_summary

    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="s", iterations=3, storage={"uri": str(tmp_path / "store")}, eval={"files": ["held.parquet"]},
                   promote={"metric": "eval/reward_mean"})
    rows = [{"iteration": i, "reward_mean": None} for i in (1, 2, 3)]
    _evaluated(store, "r", 0, 0.1)
    _exported(store, bp, "r", 1, 0.3)
    _exported(store, bp, "r", 2, 0.5)
    hf2 = store.uri("runs/r/2/export/hf").removeprefix("file://")
    pending = run_summary(store, bp, "r", rows)  # export[3] not committed yet
    assert f"- Promoted policy: iteration 2 (eval/reward_mean=0.5); HF folder: `{hf2}`" in pending, pending
    assert ("The export of iteration 3 is still committing in the background: the promotion gate decides on it "
            "when its commit lands") in pending
    assert "iteration 3" not in pending.replace("export of iteration 3", "")
    _exported(store, bp, "r", 3, 0.4)
    landed = run_summary(store, bp, "r", rows)
    assert f"- Promoted policy: iteration 2 (eval/reward_mean=0.5); HF folder: `{hf2}`" in landed, landed
    assert "still committing" not in landed


# ------------------------------------------- a crash between an export's commit and its gate (issue 38, item 8)

def _inputs(run_id: str, it: int) -> dict:
    return {"update": f"runs/{run_id}/{it}/update", "build": f"runs/{run_id}/init/build"}


def _gate(store, bp, run_id: str, it: int, manifest: dict) -> None:
    promote(store, PromotePolicy.of(bp), JobSpec.model_construct(
        run_id=run_id, iteration=it, output=f"runs/{run_id}/{it}/export", inputs=_inputs(run_id, it)), manifest)


def _moves(store, name: str) -> list:
    return [(e["by"], e["run_id"], e["iteration"]) for e in (store.get_pointer(name) or {}).get("history", [])]


def test_a_reused_export_whose_gate_never_ran_is_gated_once(tmp_path):
    """Without promote.metric: export[2] committed, then the run stopped before its gate. The rerun that reuses
    it runs the gate; a second rerun moves nothing. Stopped between the gate's two moves, the rerun makes only the
    one missing. A blueprint pointer that a newer export moved since is left to it; a person's move since wins."""
    from verlflow.core.store.promote import PromotePolicy, after_export, move, policy_of

    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="nm", storage={"uri": str(tmp_path / "store")})
    run, blue = "runs/r/latest", "blueprints/nm/latest"

    def reused(run_id, it, m):
        return after_export(store, PromotePolicy.of(bp), run_id, it, _inputs(run_id, it), m, reused=True)

    m1 = _fake_checkpoint(store, tmp_path, "r", 1, 0.1)
    _gate(store, bp, "r", 1, m1)
    m2 = _fake_checkpoint(store, tmp_path, "r", 2, 0.2)  # the run stopped here
    assert reused("r", 1, m1) == (False, None)  # its gate ran
    ran, moved = reused("r", 2, m2)
    assert ran and moved["iteration"] == 2
    for name in (run, blue):
        assert _moves(store, name) == [("gate", "r", 1), ("gate", "r", 2)], name
    assert reused("r", 2, m2) == (False, None) and _moves(store, run)[-1] == ("gate", "r", 2)

    m3 = _fake_checkpoint(store, tmp_path, "r", 3, 0.3)
    before = store.get_bytes(f"pointers/{run}.json")
    _gate(store, bp, "r", 3, m3)
    store.put_bytes(f"pointers/{run}.json", before)  # stopped after the blueprint's move, before the run's
    assert reused("r", 3, m3)[0]
    assert _moves(store, run)[-1] == ("gate", "r", 3) and _moves(store, blue).count(("gate", "r", 3)) == 1

    m4 = _fake_checkpoint(store, tmp_path, "r", 4, 0.4)  # stopped; then another run of the blueprint exported
    (tmp_path / "s").mkdir()
    _gate(store, bp, "s", 1, _fake_checkpoint(store, tmp_path / "s", "s", 1, 0.5))
    assert reused("r", 4, m4)[0]
    assert store.get_pointer(run)["iteration"] == 4 and store.get_pointer(blue)["run_id"] == "s"

    m5 = _fake_checkpoint(store, tmp_path, "r", 5, 0.6)  # stopped; then a person moved the run's pointer back
    policy = policy_of(store, {**m1, "run_id": "r", "iteration": 1, "blueprint_name": "nm",
                               "inputs": {n: {"stage": k} for n, k in _inputs("r", 1).items()}})
    move(store, run, policy, "promote")
    assert reused("r", 5, m5) == (False, None) and store.get_pointer(run)["iteration"] == 1


def test_a_reused_export_is_gated_by_its_metric_and_a_half_done_gate_is_finished(tmp_path):
    """With promote.metric: the rerun gates an export the run stopped before gating (a worse one: no move, again on
    the next rerun); stopped after the gate moved the `best` pointers, before the run's `latest`, the rerun moves
    that `latest` and no pointer twice."""
    from verlflow.core.store.promote import PromotePolicy, after_export

    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="g", storage={"uri": str(tmp_path / "store")}, eval={"files": ["held.parquet"]},
                   promote={"metric": "eval/reward_mean"})
    _evaluated(store, "r", 0, 0.2)
    for it, reward in ((1, 0.1), (2, 0.5)):
        _evaluated(store, "r", it, reward)
        store.commit(f"runs/r/{it}/export", {"key": f"c{it}", "stage": "export", "metrics": {}}, {})
    m1, m2 = (store.read_manifest(f"runs/r/{it}/export") for it in (1, 2))

    for _ in range(2):  # worse than the start: gated, nothing moves, and nothing marks it
        assert after_export(store, PromotePolicy.of(bp), "r", 1, _inputs("r", 1), m1, reused=True) == (True, None)
        assert not store.ls("pointers")
    _gate(store, bp, "r", 2, m2)
    store.rm("pointers/runs/r/latest.json")  # the run stopped before the gate's last move
    ran, moved = after_export(store, PromotePolicy.of(bp), "r", 2, _inputs("r", 2), m2, reused=True)
    assert ran and moved["iteration"] == 2
    for name in ("runs/r/latest", "runs/r/best", "blueprints/g/latest", "blueprints/g/best"):
        assert _moves(store, name) == [("gate", "r", 2)], name


def test_a_rerun_completes_the_promotion_the_run_stopped_before(reference, tmp_path, capsys, monkeypatch, request):
    """The reference run as if it stopped after export[2] committed, before its promotion (both `latest`
    pointers back at iteration 1). `verlflow rerun` reuses every stage, promotes iteration 2 and says so; a second
    rerun moves nothing. So does the flow (`verlflow rerun --prefect`), which shares the pipeline loop."""
    from tinybp import tiny_overrides

    from verlflow.flows.cli import main
    from verlflow.core.store.promote import policy_of

    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    bp, root = reference.copy(tmp_path)
    store = ArtifactStore(root)
    names = ("runs/eq/latest", f"blueprints/{bp.name}/latest")
    args = tiny_overrides(reference.kit, root, iterations=2, storage__keep_last_checkpoints=3)

    def stop_before_the_gate() -> None:
        first = policy_of(store, store.read_manifest("runs/eq/1/export"))
        for name in names:
            moves = store.get_pointer(name)["history"]
            assert [(e["run_id"], e["iteration"]) for e in moves[-2:]] == [("eq", 1), ("eq", 2)]
            store.set_pointer(name, {**first, "history": moves[:-1]})

    def rerun(*more) -> str:
        capsys.readouterr()
        rc = main(["rerun", "eq", *args, *more])
        out, err = capsys.readouterr()
        assert rc == 0, out[-3000:] + err
        assert "Promoted policy: iteration 2" in out, out[-3000:]
        assert all(store.get_pointer(name)["iteration"] == 2 for name in names), out[-3000:]
        return out

    stop_before_the_gate()
    out = rerun()
    assert out.count("is committed with the same key: reusing") == 8, out
    assert "export[2]: its promotion never happened" in out and "promoted it -> " in out, out
    moves = [store.get_pointer(name)["history"] for name in names]
    assert "promotion never happened" not in rerun() and [store.get_pointer(n)["history"] for n in names] == moves

    request.getfixturevalue("prefect_server")  # the flow path: a real Prefect server
    stop_before_the_gate()
    rerun("--prefect")
    assert [len(store.get_pointer(n)["history"]) for n in names] == [len(m) for m in moves]


def test_a_store_from_before_the_export_rename_is_promoted_rolled_back_and_pruned(tmp_path):
    """Exports committed as `runs/<run>/<i>/checkpoint` with pointers whose field is `checkpoint` (the release
    before the stage's rename): `verlflow promote` and `rollback` find them, retention counts them as exports."""
    from verlflow.core.store.promote import export_of, move, promotable, promote_by_hand, rollback

    store = ArtifactStore(tmp_path / "store")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/model.safetensors").write_bytes(b"w" * 10)
    for it in (1, 2, 3):
        store.upload_dir(tmp_path / "hf", f"runs/old/{it}/checkpoint/hf")
        store.commit(f"runs/old/{it}/checkpoint", {"key": f"c{it}", "stage": "checkpoint", "run_id": "old",
                                                   "iteration": it, "blueprint_name": "bp", "metrics": {},
                                                   "inputs": {"update": {"stage": f"runs/old/{it}/update"},
                                                              "build": {"stage": "runs/old/init/build"}}},
                     {"hf/model.safetensors": file_digest(tmp_path / "hf/model.safetensors")})
    assert promotable(store, "old") == [1, 2, 3]
    for it in (1, 2):
        promote_by_hand(store, "old", it)
    latest = store.get_pointer("blueprints/bp/latest")
    assert export_of(latest) == "runs/old/2/checkpoint" and latest["hf_uri"].endswith("runs/old/2/checkpoint/hf")
    before, after = rollback(store, "bp")
    assert (before["iteration"], after["iteration"], export_of(after)) == (2, 1, "runs/old/1/checkpoint")
    legacy = {k: v for k, v in after.items() if k != "export"} | {"checkpoint": "runs/old/1/checkpoint"}
    assert export_of(legacy) == "runs/old/1/checkpoint"  # a pointer written by the earlier release
    move(store, "runs/old/latest", legacy, "promote")
    assert prune(store, Blueprint(storage={"uri": str(tmp_path / "store"), "keep_last": 1,
                                           "keep_best_metric": None}).storage, "old") == ["runs/old/2/checkpoint"]
