"""Experiment tracking (core/tracking): a real `mlflow server` read back through MlflowClient (and its UI in
headless Chromium), TensorBoard event files read back with tensorboard's EventAccumulator, an offline W&B run read
back from its .wandb file, and validate's refusal of an unreachable tracking.mlflow_uri. Runs start from a copy of
the reference run (every stage reused, nothing logged yet), so only the forced update[2] rerun computes anything."""

import glob
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sysdeps import unavailable
from tinybp import ONE_RANK, tiny_overrides

from verlflow.core.metrics import flat
from verlflow.core.store.artifacts import stage_key

pytestmark = pytest.mark.system


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--default-artifact-root", str(tmp_path / "server-artifacts")]
    log = open(tmp_path / "server.log", "w")
    # Without its job runner: MLflow 3 starts six huey consumer processes for server-side jobs (half a core busy
    # polling here); verlflow logs runs, params, metrics and artifacts, none of which is a job.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)  # + uvicorn
    deadline = time.monotonic() + 180  # a loaded machine: the server's first start migrates its database
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)

    def stop():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)

    yield url, stop
    stop()
    log.close()


def _tracked_copy(reference, tmp_path, **tracking):
    bp, root = reference.copy(tmp_path)
    bp.tracking = bp.tracking.model_copy(update=tracking)
    return bp, root


def _metrics(root_bp, run_id: str, stage: str, it: int) -> dict[str, float]:
    from verlflow.core.store.artifacts import open_store

    return flat(stage, open_store(root_bp.storage).read_manifest(stage_key(run_id, it, stage))["metrics"])


def _history(client, run_uuid: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_uuid, name))


@pytest.mark.slow(
    reason="covered by test_tracking::test_a_flow_run_is_tagged_and_the_linked_mlflow_page_opens_on_model_training")
def test_mlflow_server_one_run_per_verlflow_run(reference, tmp_path, mlflow_server, caplog):
    """Params, metrics per iteration and the promoted model's tag on a real server; a rerun and a forced
    `--from update[2]` resume the same MLflow run and log only what they recomputed; a server gone mid-run
    costs one warning, not the training."""
    from mlflow.tracking import MlflowClient

    from verlflow.core.orchestrate.pipeline import run_pipeline
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.tracking import mlflow_run_url

    url, stop_server = mlflow_server
    bp, root = _tracked_copy(reference, tmp_path, backends=["mlflow"], mlflow_uri=url)
    run_id, lines = reference.run_id, []
    client = MlflowClient(tracking_uri=url)
    client.create_experiment(bp.name)  # as an earlier release created it: no experiment kind
    run_pipeline(bp, run_id, on_line=lines.append)

    exp = client.get_experiment_by_name(bp.name)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # a model-training experiment

    def the_run():
        runs = client.search_runs([exp.experiment_id])
        assert len(runs) == 1, [r.info.run_name for r in runs]
        return runs[0]

    run = the_run()
    uuid = run.info.run_id
    assert run.info.run_name == run_id and run.data.tags["verlflow.run_id"] == run_id
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["algorithm.lr"] == str(bp.algorithm.lr) and params["iterations"] == "2"
    assert params["resources.backend"] == "local"  # a local run: no Slurm or Kubernetes settings
    assert not [k for k in params if k.startswith(("resources.slurm.", "resources.kubernetes."))]
    assert params["storage.uri"] == bp.storage.uri and params["data.batch_size"] == str(bp.data.batch_size)
    expected = {it: {**_metrics(bp, run_id, "rollout", it), **_metrics(bp, run_id, "update", it)} for it in (1, 2)}
    assert "rollout/reward_mean" in expected[1] and any(k.startswith("update/") for k in expected[1])
    for name in expected[1]:
        assert _history(client, uuid, name) == [(1, pytest.approx(expected[1][name])),
                                                (2, pytest.approx(expected[2][name]))], name
    pointer = open_store(bp.storage).get_pointer(f"runs/{run_id}/latest")
    assert run.data.tags["verlflow.promoted_model"] == pointer["hf_uri"]
    assert mlflow_run_url(open_store(bp.storage), run_id) == \
        f"{url}/#/experiments/{exp.experiment_id}/runs/{uuid}?workflowType=machine_learning"

    run_pipeline(bp, run_id, on_line=lines.append)  # everything reused: nothing logged again
    assert the_run().info.run_id == uuid
    for name in expected[1]:
        assert [s for s, _ in _history(client, uuid, name)] == [1, 2], name

    run_pipeline(bp, run_id, on_line=lines.append, force_from="update[2]")  # update[2] recomputed, logged anew
    assert the_run().info.run_id == uuid
    for name in expected[1]:
        steps = [s for s, _ in _history(client, uuid, name)]
        assert steps == ([1, 2, 2] if name.startswith("update/") else [1, 2]), name
    assert the_run().data.tags["verlflow.promoted_model"] == open_store(bp.storage).get_pointer(
        f"runs/{run_id}/latest")["hf_uri"]

    caplog.set_level("WARNING", logger="verlflow.tracking")

    def server_gone(step, res):  # the tracker opened its run at build: the server goes down mid-run
        if step.stage == "build":
            stop_server()

    results = run_pipeline(bp, run_id, on_line=lines.append, on_step=server_gone, force_from="update[2]")
    assert results[-1].manifest["stage"] == "export" and not results[-1].skipped  # the run went on to the end
    warned = [r.getMessage() for r in caplog.records if r.name == "verlflow.tracking"]
    assert len(warned) == 1 and "mlflow failed to log update[2]" in warned[0], warned


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _page_text(url: str, profile: Path) -> str:
    """The text of `url` as headless Chromium renders it (the SPA runs for the virtual-time budget)."""
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        "--virtual-time-budget=20000", "--dump-dom", url], capture_output=True, text=True, timeout=120)
    body = re.sub(r"<(script|style)[^>]*>.*?</\1>", "", r.stdout, flags=re.S)
    return " ".join(re.sub(r"<[^>]+>", " ", body).split())


def test_a_flow_run_is_tagged_and_the_linked_mlflow_page_opens_on_model_training(prefect_server, reference,
                                                                                    tmp_path, mlflow_server):
    """Tracked from a Prefect flow: the MLflow run carries the flow run's UI page; a new experiment is a model-training
    one; the page the run summary links opens in MLflow's Model training view (MLflow 3.17's UI shows every
    experiment as GenAI, on its empty traces pages, unless the URL or the user's switch says otherwise)."""
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.context import get_run_context

    from verlflow.core.orchestrate.pipeline import run_pipeline
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.tracking import mlflow_run_url, summary_lines

    if CHROMIUM is None:
        unavailable("chromium is not installed (`make test` installs it)")
    url, _ = mlflow_server
    bp, _ = _tracked_copy(reference, tmp_path, backends=["mlflow"], mlflow_uri=url)

    @flow
    def tracked() -> str:
        run_pipeline(bp, reference.run_id, on_line=lambda line: None)
        return str(get_run_context().flow_run.id)

    flow_run_id = tracked()
    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name(bp.name)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["verlflow.prefect_flow_run"] == f"{prefect_server.ui}/runs/flow-run/{flow_run_id}"
    page = mlflow_run_url(open_store(bp.storage), reference.run_id)
    assert summary_lines(open_store(bp.storage), reference.run_id) == [f"- MLflow run: [{page}]({page})"]
    text = _page_text(page, tmp_path / "chromium")
    assert reference.run_id in text and "algorithm.lr" in text, text[:2000]  # the run's page, with its params
    assert "Model registry" in text and "Observability" not in text, text[:2000]  # Model training's menu, not GenAI's


def test_params_hold_the_backend_sections_that_apply():
    """A Slurm run logs its slurm settings (not its shell setup, which may export a token) and no Kubernetes ones."""
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.tracking.params import blueprint_params

    slurm = blueprint_params(load_blueprint(None, ["resources.backend=slurm", "resources.slurm.partition=gpu"]))
    assert slurm["resources.slurm.partition"] == "gpu" and "resources.slurm.setup" not in slurm
    assert not [k for k in slurm if k.startswith("resources.kubernetes.")]
    local = blueprint_params(load_blueprint(None, []))
    assert not [k for k in local if k.startswith(("resources.slurm.", "resources.kubernetes."))]
    assert set(slurm) - set(local) == {k for k in slurm if k.startswith("resources.slurm.")}


def test_params_redact_each_credential_a_blueprint_can_hold(tmp_path, monkeypatch):
    """Credentials planted in each free-form place of a blueprint (a user stage's options: by key, nested, in a
    list, in a URI's user-info or query; Kubernetes labels and node selector; Slurm's sbatch lines and setup; the
    store's endpoint, the MLflow URI) and an environment secret's value: no param holds one, a redacted one reads
    [REDACTED] under its own key, the options are params field by field, and the schema's own names that look like
    secrets (prompt_key, max_new_tokens, env_from_secret) keep their values. Before: the `phases` param held the
    options whole, and TOKENIZERS_PARALLELISM=false dropped every param holding `false`."""
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.redact import REDACTED
    from verlflow.core.tracking.params import blueprint_params

    s = {k: f"{k}-s3cr3t-{i}" for i, k in enumerate(("opt", "camel", "nested", "listed", "query", "userinfo", "env",
                                                      "label", "selector", "sbatch", "setup", "endpoint", "mlflow"))}
    monkeypatch.setenv("MY_SERVICE_TOKEN", s["env"])
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a name with TOKEN in it, not a secret
    options = {"url": f"https://judge.example/score?api_key={s['query']}&lang=en", "api_key": s["opt"],
               "apiKey": s["camel"], "auth": {"user": "me", "pass": s["nested"]}, "timeout_s": 10,
               "headers": [{"Authorization": f"Bearer {s['listed']}", "Accept": "json"}],
               "mirror": f"https://bob:{s['userinfo']}@mirror.example/x", "note": f"plain {s['env']}",
               "api_key_env": "JUDGE_API_KEY"}  # where the key is, not the key
    k8s = {"image": "img", "labels": {"api-token": s["label"]}, "node_selector": {"secret-pool": s["selector"]},
           "tolerations": [{"key": "gpu", "operator": "Exists"}], "env_from_secret": "my-k8s-secret"}
    bp = load_blueprint(None, [], data={
        "phases": [{"kind": "rl"}, {"kind": "verlflow.core.examples.judge:JudgeStage", "name": "judge",
                                    "resources": {"backend": "kubernetes"}, "options": options}],
        "resources": {"backend": "slurm", "kubernetes": k8s,
                      "slurm": {"extra_sbatch": [f"--export=ALL,HF_TOKEN={s['sbatch']}"],
                                "setup": [f"export HF_TOKEN={s['setup']}"]}},
        "storage": {"uri": str(tmp_path / "store"), "endpoint_url": f"http://minio:{s['endpoint']}@minio:9000"},
        "tracking": {"mlflow_uri": f"https://user:{s['mlflow']}@mlflow.example"}})
    params = blueprint_params(bp)
    assert not [(k, v) for k, v in params.items() for secret in s.values() if secret in k + v]
    opts = {k.removeprefix("phases.1.options."): v for k, v in params.items() if k.startswith("phases.1.options.")}
    assert opts == {"url": f"https://judge.example/score?api_key={REDACTED}&lang=en", "api_key": REDACTED,
                    "apiKey": REDACTED, "auth": REDACTED, "timeout_s": "10", "headers.0.Authorization": REDACTED,
                    "headers.0.Accept": "json", "mirror": f"https://{REDACTED}@mirror.example/x", "note": REDACTED,
                    "api_key_env": "JUDGE_API_KEY"}
    assert (params["phases.0.kind"], params["phases.1.kind"]) == ("rl", "verlflow.core.examples.judge:JudgeStage")
    assert params["resources.kubernetes.labels.api-token"] == params["resources.kubernetes.node_selector.secret-pool"] \
        == REDACTED
    assert params["resources.slurm.extra_sbatch"] == f'["--export=ALL,HF_TOKEN={REDACTED}"]'
    assert "resources.slurm.setup" not in params
    assert params["storage.endpoint_url"] == f"http://{REDACTED}@minio:9000"
    assert params["tracking.mlflow_uri"] == f"https://{REDACTED}@mlflow.example"
    assert (params["data.prompt_key"], params["rollout.max_new_tokens"], params["resources.kubernetes.env_from_secret"],
            params["deterministic"]) == ("prompt", "16", "my-k8s-secret", "false")


def test_tensorboard_event_files_hold_each_iteration(reference, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verlflow.core.orchestrate.pipeline import run_pipeline

    bp, root = _tracked_copy(reference, tmp_path, backends=["tensorboard"])
    run_id = reference.run_id
    expected = {it: {**_metrics(bp, run_id, "rollout", it), **_metrics(bp, run_id, "update", it)} for it in (1, 2)}
    for _ in range(2):  # the rerun reuses every stage and adds no event for them
        run_pipeline(bp, run_id, on_line=lambda line: None)
        # purge_orphaned_data=False: steps written twice show as twice, not folded by TensorBoard's restart logic
        events = EventAccumulator(str(root / "tracking" / "tensorboard" / run_id), purge_orphaned_data=False)
        events.Reload()
        assert set(expected[1]) <= set(events.Tags()["scalars"])
        for name in expected[1]:
            got = [(e.step, e.value) for e in events.Scalars(name)]
            assert got == [(1, pytest.approx(expected[1][name], rel=1e-6)),
                           (2, pytest.approx(expected[2][name], rel=1e-6))], name


def test_a_step_committed_in_the_background_is_logged_before_the_later_ones(tmp_path):
    """update[1]'s commit lands in the background after update[2] committed inline: the tracker logs them in step
    order, so TensorBoard's event file holds the points in step order (tests/test_phases.py's tracking test saw
    them reversed under load); a step waits for every earlier one, steps of one number alike."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.tracking.tracker import tracked

    bp = load_blueprint(None, [f"storage.uri={tmp_path / 'store'}", "iterations=2", "tracking.backends=[tensorboard]"])

    def manifest(it: int, loss: float, pending: bool = False) -> dict:
        return {"key": f"runs/r/{it}/update", "committed_at": f"2026-12-06T12:00:0{it}.000001+00:00",
                "metrics": {"pg_loss": loss}, **({"pending": True} if pending else {})}

    rollout1 = {"key": "runs/r/1/rollout", "committed_at": "2026-12-06T12:00:00.5+00:00", "metrics": {}}
    with tracked(bp, "r", open_store(bp.storage)) as tracker:
        tracker.step("rollout", 1, {**rollout1, "pending": True})  # another step of number 1, in the background
        tracker.step("update", 1, manifest(1, 0.5, pending=True))
        tracker.step("rollout", 1, rollout1)  # rollout[1]'s commit landed; update[1]'s has not
        tracker.step("update", 2, manifest(2, 0.25))
        tracker.step("update", 1, manifest(1, 0.5))
    events = EventAccumulator(str(tmp_path / "store/tracking/tensorboard/r"), purge_orphaned_data=True)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("update/pg_loss")] == [(1, 0.5), (2, 0.25)]


def _wandb_records(path: Path):
    """The records of a .wandb file (wandb's own protobuf, in the LevelDB log framing wandb-core writes: a 7-byte
    file header, then 32 KiB blocks of chunks with a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, block = path.read_bytes(), 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wandb_file(path: Path):
    """(history rows by iteration, config, summary, record kinds) of a W&B run file."""
    history, config, summary, kinds = {}, {}, {}, []
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":  # a key is either `key` or a nested_key path
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(row["iteration"], {}).update(row)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "summary":
            summary.update({(u.key or "/".join(u.nested_key)): u.value_json for u in rec.summary.update})
    return history, config, summary, kinds


def test_wandb_offline_run_holds_metrics_and_never_the_key(reference, tmp_path, monkeypatch, capfd):
    from verlflow.core.orchestrate.pipeline import run_pipeline

    secret = "wbkey-" + "7f3a9c" * 6
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", secret)
    bp, root = _tracked_copy(reference, tmp_path, backends=["wandb"])
    bp.resources.slurm.setup = [f"export WANDB_API_KEY={secret}"]  # shell lines are never logged (validate reruns)
    run_id, lines = reference.run_id, []
    run_pipeline(bp, run_id, on_line=lines.append)

    files = glob.glob(str(root / "tracking" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    # wandb-core writes the file from its own process: on a loaded machine its last blocks can land after finish()
    deadline = time.monotonic() + 60
    while 2 not in (parsed := _wandb_file(Path(files[0])))[0] and time.monotonic() < deadline:
        time.sleep(0.5)  # the assertions below say what is missing if it never lands
    history, config, summary, kinds = parsed
    assert {1, 2} <= set(history), (kinds, os.path.getsize(files[0]), sorted(history))
    for it in (1, 2):
        for name, value in {**_metrics(bp, run_id, "rollout", it), **_metrics(bp, run_id, "update", it)}.items():
            assert history[it][name] == pytest.approx(value), (it, name)
    assert config["algorithm.lr"] == str(bp.algorithm.lr)
    assert "verlflow/promoted_model" in summary

    out, err = capfd.readouterr()
    assert secret not in out + err + "\n".join(lines)
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.parametrize("uri, why", [("http://127.0.0.1:{port}", "unreachable"), ("ftp://host/x", "scheme"),
                                      ("file://{tmp}/mlruns", "MLFLOW_ALLOW_FILE_STORE=true")])
def test_validate_refuses_an_unusable_mlflow_uri(tiny_kit, tmp_path, capsys, monkeypatch, uri, why):
    """A server nothing answers at, a scheme MLflow has no store for, a folder (MLflow 3.17 refuses its file store
    unless MLFLOW_ALLOW_FILE_STORE is set; before, the run went on untracked after one warning)."""
    from verlflow.flows.cli import main

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "store"
    uri = uri.format(port=_free_port(), tmp=tmp_path)  # nothing listens there
    args = tiny_overrides(tiny_kit, store, *ONE_RANK, "tracking.backends=[mlflow]", f"tracking.mlflow_uri={uri}")
    for verb in (["validate-blueprint"], ["run", "--run-id", "t1"]):
        rc = main([*verb, *args])
        err = capsys.readouterr().err
        assert rc != 0 and "tracking.mlflow_uri" in err and why in err and uri in err, err
    assert not store.exists()
