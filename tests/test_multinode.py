"""backend local, static multi-node: one verlflow agent per node (here: two agents on this machine, each in its
own thread, as two machines would each run `verlflow run bp.yaml resources.node_rank=K`), nnodes=2 x 1 process,
a c10d rendezvous on node 0's endpoint, one shared artifact store. Node 0 leads (clears outputs, runs the
single-process checkpoint stage); node 1 joins every torchrun job and waits for node 0's commits.

Checkpoints written by the 2-node run load in a 1-node run and the other way round (DCP resharding), and the
weights loaded at either world size are exactly the saved ones.
"""

import json
import socket
import threading
import time

import pytest
import torch
from tinybp import tiny_blueprint

from verlflow.core.ml import checkpoint, model as M
from verlflow.core.orchestrate.launcher import LaunchSpec, launch
from verlflow.core.orchestrate.pipeline import run_pipeline

pytestmark = pytest.mark.stages

QUIET = dict(on_line=lambda line: None)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_bps(kit, store, **kw):
    kw = {"storage__keep_last_checkpoints": 3, **kw}  # the reshard test reads update[1] after iteration 3
    endpoint = f"127.0.0.1:{_port()}"
    return [tiny_blueprint(kit, store, resources__nnodes=2, resources__nproc_per_node=1,
                           resources__node_rank=rank, resources__rdzv_endpoint=endpoint, **kw) for rank in (0, 1)]


def _on_both_nodes(fn, *args_per_node):
    """fn(*args) for node 0 and node 1 at once; the results, or the first error."""
    out, errors = [None, None], []

    def run(i):
        try:
            out[i] = fn(*args_per_node[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    if errors:
        raise errors[0]
    return out


class Lines(list):
    def __call__(self, line):
        self.append(line)


@pytest.fixture(scope="module")
def two_node_run(tiny_kit, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    bps = _node_bps(tiny_kit, store)
    lines = [Lines(), Lines()]
    t0 = time.monotonic()
    results = _on_both_nodes(lambda bp, on_line: run_pipeline(bp, "mn", on_line=on_line),
                             (bps[0], lines[0]), (bps[1], lines[1]))
    print(f"\n2 agents x 1 process, tiny pipeline: {time.monotonic() - t0:.1f} s")
    return store, bps, results, lines


@pytest.mark.slow(reason="covered by test_slurm::test_failing_rank_names_its_node_and_rank (2 nodes x 1 rank)")
def test_two_agents_run_the_pipeline(two_node_run):
    store, bps, (node0, node1), (lines0, lines1) = two_node_run
    stages = [r.manifest["stage"] for r in node0]
    assert stages == ["validate", "build", "rollout", "update", "export"]
    assert [r.manifest["key"] for r in node0] == [r.manifest["key"] for r in node1]  # both agents agree
    assert [r.manifest["world_size"] for r in node0] == [2, 2, 2, 2, 1]
    assert node0[1].manifest["metrics"]["policy_shard_balance"] == pytest.approx([1.0, 1.0], abs=0.05)
    assert any("export[1] runs on node 0 only" in line for line in lines1)
    assert any("node 1 of 2" in line for line in lines1) and any("node 0 of 2" in line for line in lines0)
    assert (store / "runs/mn/1/export/hf/config.json").is_file()


def _full_weights(store, stage_dir, bp):
    model = M.build_module(store / "runs/mn/init/build/hf_meta", bp.model)
    checkpoint.load_full(store / "runs/mn" / stage_dir / "policy", model)
    return model.state_dict()


def _probe_job(tmp_path, store, bp, ckpt, name):
    job = {"blueprint": bp.model_dump(mode="json"), "meta": str(store / "runs/mn/init/build/hf_meta"),
           "ckpt": str(store / "runs/mn" / ckpt / "policy"), "out": str(tmp_path / f"{name}.safetensors")}
    (tmp_path / f"{name}.json").write_text(json.dumps(job))
    return str(tmp_path / f"{name}.json"), tmp_path / f"{name}.safetensors"


@pytest.mark.slow(reason="covered by test_stages::test_rerun_reuses_and_resumes_at_another_world_size")
def test_checkpoints_reshard_between_two_nodes_and_one(two_node_run, tiny_kit, tmp_path):
    from safetensors.torch import load_file

    store, bps, _, _ = two_node_run
    # 2 nodes -> 1 node: iteration 2 at world size 1 continues from the 2-node update[1].
    one = tiny_blueprint(tiny_kit, store, resources__nproc_per_node=1, iterations=2, storage__keep_last_checkpoints=3)
    res1 = run_pipeline(one, "mn", **QUIET)
    ran = {(r.manifest["stage"], r.manifest["iteration"]): r for r in res1 if not r.skipped}
    assert set(ran) == {("validate", "init"), ("rollout", 2), ("update", 2), ("export", 2)}
    assert ran[("update", 2)].manifest["world_size"] == 1
    assert ran[("update", 2)].manifest["metrics"]["step"] == 4  # the optimizer's step count continues: 2 + 2

    # 1 node -> 2 nodes: iteration 3 as two agents continues from the 1-node update[2].
    bps3 = _node_bps(tiny_kit, store, iterations=3)
    res2 = _on_both_nodes(lambda bp: run_pipeline(bp, "mn", **QUIET), (bps3[0],), (bps3[1],))
    ran = {(r.manifest["stage"], r.manifest["iteration"]): r for r in res2[0] if not r.skipped}
    assert set(ran) == {("validate", "init"), ("rollout", 3), ("update", 3), ("export", 3)}
    assert ran[("update", 3)].manifest["world_size"] == 2
    assert ran[("update", 3)].manifest["metrics"]["step"] == 6

    # Exactness: the 2-node update[1] loaded into a 1-rank FSDP model, and the 1-node update[2] loaded into
    # FSDP across two agents, give the weights that were saved.
    job, out = _probe_job(tmp_path, store, one, "1/update", "w1")
    launch(LaunchSpec("verlflow.core.testing.reshard_probe", [job], nproc_per_node=1, timeout_s=120), **QUIET)
    want = _full_weights(store, "1/update", one)
    got = load_file(str(out))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    job, out = _probe_job(tmp_path, store, one, "2/update", "w2")
    endpoint, rid = f"127.0.0.1:{_port()}", "reshard-probe-2n"
    specs = [LaunchSpec("verlflow.core.testing.reshard_probe", [job], nproc_per_node=1, nnodes=2, node_rank=r,
                        rdzv_endpoint=endpoint, rdzv_id=rid, timeout_s=120) for r in (0, 1)]
    _on_both_nodes(lambda spec: launch(spec, **QUIET), (specs[0],), (specs[1],))
    want = _full_weights(store, "2/update", one)
    got = load_file(str(out))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(want[k], _full_weights(store, "1/update", one)[k]) for k in want)  # it trained


def test_blueprint_rules_for_static_multinode():
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.errors import BlueprintError

    with pytest.raises(BlueprintError, match="needs rdzv_endpoint"):
        load_blueprint(None, ["resources.nnodes=2"])
    with pytest.raises(BlueprintError, match="node_rank=2 must be below nnodes=2"):
        load_blueprint(None, ["resources.nnodes=2", "resources.node_rank=2", "resources.rdzv_endpoint=h:1"])
    with pytest.raises(BlueprintError, match="must be host:port"):
        load_blueprint(None, ["resources.nnodes=2", "resources.rdzv_endpoint=nohost"])
    a = load_blueprint(None, ["resources.nnodes=2", "resources.rdzv_endpoint=h:29400", "resources.node_rank=0"])
    b = load_blueprint(None, ["resources.nnodes=2", "resources.rdzv_endpoint=h:29400", "resources.node_rank=1"])
    assert a.section_hash("resources") == b.section_hash("resources")  # the agents of one job share its keys
    assert a.hash() != b.hash()
