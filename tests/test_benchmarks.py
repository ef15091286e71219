"""CPU smoke runs of the update and stage-boundary benchmarks, so the GPU measurements' code cannot rot."""

import json

import pytest
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_update_benchmark_smoke_two_ranks(tmp_path):
    """torchrun, 2 ranks (gloo): the baseline and the packed/deferred-sync paths of verlflow.core.ml.ppo on a ragged batch."""
    out = tmp_path / "u.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "benchmarks/update.py"),
           "--smoke", "--configs", "baseline,packed_no_ac,best_defer,fused_32k_keep", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| config | world | train MFU | ratio vs baseline |" in proc.stdout
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"baseline", "packed_no_ac", "best_defer", "fused_32k_keep"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["world"] == 2 and r["train_flops_per_s_per_gpu"] > 0 and r["tokens_per_s_per_gpu"] > 0
        assert r["real_tokens"] < r["padded_tokens"]  # the batch is ragged, as RL batches are


def test_boundaries_benchmark_smoke(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/boundaries.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("| measure | one process (baseline) | warm pool (ours, async commits) | ratio | warm pool, commits inline "
            "| fresh stage jobs |") in proc.stdout
    assert "| iteration 2: rollout + update + checkpoint |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["steady_iteration"] == 2 and res["monolithic_work_s"] > 0
    assert 0 < res["warm_staged_s"] < res["staged_s"]  # no spawn and imports per stage
    assert res["warm_staged_s"] < res["warm_first_s"]  # iteration 2 takes its models from memory
    assert res["warm_mode"] == "async" and res["warm_tail_s"] >= 0  # the last background commits, after the stages
    assert res["warm_ratio_vs_work"] == pytest.approx(res["warm_staged_s"] / res["monolithic_work_s"], rel=0.01)
    st, warm = res["stages"], res["warm_stages"]
    for s in ("rollout", "update", "checkpoint"):
        assert st[s]["launch_to_worker_s"] > 0 and st[s]["wall_s"] >= st[s]["stage_s"]
        assert warm[s]["launch_to_worker_s"] < st[s]["launch_to_worker_s"]
    assert {"save_s", "export_s", "rollout_s", "update_s"} <= set(st["monolithic"])
    assert [it["iteration"] for it in res["monolithic_per_iteration"]] == [1, 2]
    assert all(it["rollout_s"] > 0 and it["update_s"] > 0 for it in res["monolithic_per_iteration"])


def test_dcp_benchmark_smoke(tmp_path):
    """Today's DCP path and ours, inline and background, saved and loaded in two folders; every load checked."""
    out = tmp_path / "d.json"
    dirs = [tmp_path / "disk", tmp_path / "other"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/dcp.py"), "--smoke", "--threads", "3", "--json",
                           str(out), "--dirs", ",".join(map(str, dirs))], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| folder | path | operation | threads | stage waits s | behind s | total s | GB | GB/s | files | ok |" \
        in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    ops = [(r["path"], r["op"]) for r in rows]
    assert ops == 2 * [("old", "save inline"), ("old", "load"), ("new", "load (old ckpt)"),
                       ("old", "save background 1st"), ("new", "save inline"), ("new", "load"),
                       ("new", "save inline, no fsync"), ("new", "save inline, staged"),
                       ("new", "save background 1st"), ("new", "save background 2nd"),
                       ("new", "load (background ckpt)")]
    assert [r["dir"] for r in rows[::11]] == list(map(str, dirs))
    assert all(r["ok"] for r in rows if "load" in r["op"])
    old, new = rows[0], rows[4]
    assert (old["files"], new["files"]) == (2, 4)  # .metadata and a file per writer thread
    assert all(r["files"] == r["threads"] + 1 for r in rows if r["op"].startswith("save background 2"))
    assert abs(new["bytes"] - old["bytes"]) < 0.01 * old["bytes"] and all(r["gb_per_s"] > 0 for r in rows)
    assert [list(d.iterdir()) for d in dirs] == [[], []]  # every checkpoint deleted
