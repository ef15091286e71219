"""Promotion pointers and retention of exports (keep the last k and the best one by a metric; the rest of
retention: tests/test_retention.py)."""

import json

from verlflow.core.blueprint import Blueprint
from verlflow.core.job import JobSpec
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.store.digests import file_digest
from verlflow.core.store.promote import promote
from verlflow.core.store.retention import retain as prune


def _fake_checkpoint(store: ArtifactStore, tmp_path, run_id: str, it: int, reward: float) -> dict:
    key = f"runs/{run_id}/{it}/checkpoint"
    local = tmp_path / f"hf{it}"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"w" * (10 + it))
    store.upload_dir(local, f"{key}/hf")
    files = {"hf/model.safetensors": file_digest(local / "model.safetensors")}
    # The policy of iteration `it` is ranked by the rollout that sampled from it, the next one.
    store.commit(f"runs/{run_id}/{it + 1}/rollout", {"key": f"r{it + 1}", "stage": "rollout",
                                                     "metrics": {"reward_mean": reward}}, {})
    return store.commit(key, {"key": f"k{it}", "stage": "checkpoint", "metrics": {"reward_mean": reward}}, files)


def test_retention_keeps_last_k_and_best(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(storage={"uri": str(tmp_path / "store"), "keep_last": 2, "keep_best_metric": "reward_mean"})
    rewards = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4}
    for it, r in rewards.items():
        _fake_checkpoint(store, tmp_path, "r", it, r)
    pruned = prune(store, bp, "r")
    assert pruned == ["runs/r/1/checkpoint", "runs/r/3/checkpoint"]
    for it in rewards:
        m = store.read_manifest(f"runs/r/{it}/checkpoint")
        assert m is not None  # still committed: a rerun skips it
        exists = (tmp_path / f"store/runs/r/{it}/checkpoint/hf/model.safetensors").exists()
        assert exists == (it in (2, 4, 5)) and bool(m.get("pruned")) == (it in (1, 3))
    assert prune(store, bp, "r") == []  # idempotent


def test_promote_moves_latest_pointers(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    bp = Blueprint(name="nm", storage={"uri": str(tmp_path / "store")})
    for it in (1, 2):
        m = _fake_checkpoint(store, tmp_path, "r", it, 0.1 * it)
        job = JobSpec.model_construct(run_id="r", iteration=it, output=f"runs/r/{it}/checkpoint",
                                      inputs={"update": f"runs/r/{it}/update", "build": "runs/r/init/build"})
        promote(store, bp, job, m)
        for name in ("runs/r/latest", "blueprints/nm/latest"):
            p = store.get_pointer(name)
            assert p["iteration"] == it and p["update"] == f"runs/r/{it}/update"
    assert json.loads((tmp_path / "store/pointers/blueprints/nm/latest.json").read_text())["metrics"]["reward_mean"] == 0.2
