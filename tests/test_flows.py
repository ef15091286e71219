"""Prefect orchestration against a real local server (tests/prefect_server.py): the pipeline as a flow run with
its artifacts, a changed field, retries by failure class, deployments with a cron schedule run by `verlflow
serve`, a failure in update resumed by the UI's Retry, a warm start from the previous run, and cancellation."""

import datetime as dt
import os
import time
from pathlib import Path

import psutil
import pytest
from reference import copy_store
from tinybp import FRESH_JOBS, ONE_RANK, tiny_blueprint
from prefect_server import api, manifest, wait_state, write_blueprint

from verlflow.core.orchestrate.launcher import FailureKind, StageFailure

pytestmark = pytest.mark.system

CRON = "0 */12 * * *"  # two occurrences a day: each test run backfills one past occurrence at a time


def task_runs(server, flow_run_id) -> dict:
    runs = api(server, "/task_runs/filter", {"flow_runs": {"id": {"any_": [str(flow_run_id)]}}})
    return {r["name"]: r for r in runs}


def logs(server, flow_run_id, want: str, timeout_s: float = 20) -> list[str]:
    """Log messages of the flow run, waiting until one contains `want` (the API log handler batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = {"logs": {"flow_run_id": {"any_": [str(flow_run_id)]}}, "limit": 200, "sort": "TIMESTAMP_DESC"}
        msgs = [x["message"] for x in api(server, "/logs/filter", body)]
        if any(want in m for m in msgs) or time.monotonic() > deadline:
            return msgs
        time.sleep(0.5)


def run_id_of(name: str, run: dict) -> str:
    """The default run id of a flow run (as the API returns it)."""
    from prefect.client.schemas.objects import FlowRun

    from verlflow.flows.common import run_id_for

    return run_id_for(name, FlowRun.model_validate(run))


def committed_at(bp, run_id, it, stage) -> str:
    m = manifest(bp, run_id, it, stage)
    assert m is not None, f"{run_id}/{it}/{stage} is not committed"
    return m["committed_at"]


# -- in-process flow runs -------------------------------------------------------------------------------------


def test_retries_follow_the_failure_class(prefect_server, tiny_kit, tmp_path, monkeypatch):
    """A collective timeout is retried; a NaN is not (the launcher's classification decides)."""
    from prefect import flow

    from verlflow.core.orchestrate.runner import StageResult
    import verlflow.tasks.stages as ts

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK)
    calls = []

    def flaky(kind):
        def run_stage(ctx, stage, iteration, inputs, **kw):
            calls.append(kind)
            if len(calls) == 1:
                raise StageFailure(kind, "injected")
            return StageResult({"key": "k", "metrics": {}, "timings": {}}, False, 0.0)
        return run_stage

    @flow
    def one(kind: str):
        monkeypatch.setattr(ts, "run_stage", flaky(FailureKind(kind)))
        return ts.stage_task("rollout", 1, bp).with_options(retry_delay_seconds=0)("rollout", 1, {}, bp, "r", True)

    assert one("collective_timeout").key == "k" and calls == [FailureKind.COLLECTIVE_TIMEOUT] * 2
    calls.clear()
    with pytest.raises(StageFailure, match="NONFINITE"):
        one("nonfinite")
    assert calls == [FailureKind.NONFINITE]


def test_pipeline_flow_run_with_artifacts(prefect_server, tiny_flow_run):
    run = tiny_flow_run
    assert run.state.is_completed(), run.state.message
    names = task_runs(prefect_server, run.flow_run_id)
    assert set(names) == {"validate[init]", "build[init]", "evaluate[0]", "rollout[1]", "update[1]", "evaluate[1]",
                          "export[1]"}
    assert all(r["state_type"] == "COMPLETED" for r in names.values())
    arts = api(prefect_server, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [str(run.flow_run_id)]}}})
    by_key = {a["key"]: a for a in arts if a["key"]}
    table = by_key["flow1-metrics"]
    assert table["type"] == "table" and '"reward_mean"' in table["data"] and '"grad_norm"' in table["data"]
    assert by_key["flow1-progress"]["type"] == "progress" and by_key["flow1-progress"]["data"] == 100
    assert "data:image/png;base64," in by_key["flow1-plot"]["data"]
    assert "reports/flow1/curves.png" in by_key["flow1-plot"]["data"]
    stage_md = [a for a in arts if a["type"] == "markdown" and not a["key"]]
    assert sorted(a["description"] for a in stage_md) == sorted(names)
    root = run.bp.storage.uri.removeprefix("file://")
    assert any(f"`{root}/runs/flow1/" in a["data"] and "committed" in a["data"] for a in stage_md)
    png = (run.bp.storage.uri.removeprefix("file://") + "/reports/flow1/curves.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # torchrun output reached the task runs' logs, rank-prefixed
    assert any(m.startswith("[rank0]") for m in logs(prefect_server, run.flow_run_id, "[rank0]"))
    # Prefect's own cost: the flow's wall time against the stage jobs it ran
    jobs = sum(r["total_run_time"] for r in names.values())
    print(f"\nflow wall {run.wall_s:.1f} s, task run time {jobs:.1f} s, Prefect overhead {run.wall_s - jobs:.1f} s "
          f"({(run.wall_s - jobs) / len(names):.2f} s per task)")


def test_changed_field_reruns_its_stage_and_later_ones(prefect_server, tiny_flow_run, tmp_path, capsys):
    """`verlflow rerun RUN --prefect` with rollout.temperature changed: build is reused, rollout on rerun."""
    from verlflow.flows.cli import main

    bp, _ = copy_store(tiny_flow_run.bp, tmp_path)  # the shared run stays as it was
    before = {s: committed_at(bp, "flow1", it, s)
              for it, s in (("init", "build"), (1, "rollout"), (1, "update"), (1, "export"))}
    f = write_blueprint(bp, tmp_path / "bp.yaml")
    assert main(["rerun", "flow1", str(f), "rollout.temperature=0.7", "--prefect"]) == 0
    out = capsys.readouterr().out
    assert "reused=-" in out  # nothing of iteration 1 was reused
    assert "latest policy (HF folder): " in out and "runs/flow1/1/export/hf" in out
    assert committed_at(bp, "flow1", "init", "build") == before["build"]
    for s in ("rollout", "update", "export"):
        assert committed_at(bp, "flow1", 1, s) != before[s], s


def test_from_step_forces_a_restart_there(prefect_server, tiny_flow_run, tmp_path):
    from verlflow.flows.finetune import finetune

    bp, _ = copy_store(tiny_flow_run.bp, tmp_path)  # the shared run stays as it was
    before = {s: committed_at(bp, "flow1", 1, s) for s in ("rollout", "update", "export")}
    out = finetune(blueprint=bp, run_id="flow1", from_step="export[1]")
    assert out["iterations"][0]["reused"] == "rollout,update"
    assert committed_at(bp, "flow1", 1, "update") == before["update"]
    assert committed_at(bp, "flow1", 1, "export") != before["export"]


def test_in_process_validate_flow_is_cancelled_through_the_api(prefect_server, tiny_kit, tmp_path):
    """A flow run started in a plain process (no runner to SIGTERM it) still stops its job on Cancel: the task
    watches its flow run's state. The blueprint comes from a file (blueprint_file)."""
    import contextvars
    import threading

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from verlflow.flows.validate import validate

    f = write_blueprint(tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=vcancel"), tmp_path / "v.yaml")
    result = {}
    ctx = contextvars.copy_context()  # this thread's Prefect settings (the test server), as a CLI process has
    t = threading.Thread(target=ctx.run, args=(lambda: result.update(
        state=validate(blueprint_file=str(f), return_state=True)),))
    t.start()
    deadline, job = time.monotonic() + 60, []
    while not job:
        assert time.monotonic() < deadline and t.is_alive(), "the validate job never started"
        job = _stage_job(os.getpid(), "validate")
        time.sleep(0.2)
    run = api(prefect_server, "/flow_runs/filter", {"flows": {"name": {"any_": ["validate"]}},
                                                    "flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}})[0]
    assert run["name"] == run_id_of("vcancel", run)  # the default run id, shown as the flow run's name
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run["id"], Cancelling())
    assert psutil.wait_procs(job, timeout=15)[1] == []
    t.join(30)
    assert result["state"].is_cancelled(), result["state"]


def test_lr_change_keeps_validate_build_and_rollout_keys(tiny_kit, tmp_path):
    """algorithm.lr is read by update only (optimizer hyperparameters are re-applied after every load)."""
    from verlflow.core.orchestrate.runner import compute_key

    a = tiny_blueprint(tiny_kit, tmp_path, *ONE_RANK)
    b = tiny_blueprint(tiny_kit, tmp_path, *ONE_RANK, "algorithm.lr=0.01")
    for stage, it in (("validate", "init"), ("build", "init"), ("rollout", 1), ("export", 1)):
        assert compute_key(stage, a, it, {}) == compute_key(stage, b, it, {}), stage
    assert compute_key("update", a, 1, {}) != compute_key("update", b, 1, {})
    c = tiny_blueprint(tiny_kit, tmp_path, *ONE_RANK, "algorithm.adv_estimator=gae")  # a critic: build changes
    assert compute_key("build", a, "init", {}) != compute_key("build", c, "init", {})


def test_deploy_to_a_busy_server_says_which_server_and_what_to_do(prefect_server, tiny_kit, tmp_path, capsys):
    """A server that keeps answering 503 to the deployment (SQLite busy under load): `verlflow deploy` exits 2 with
    one message naming the server, the deployment, the answer and the fix, not Prefect's traceback."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from verlflow.flows.cli import main

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=busy")
    proxy = FlakyApi(prefect_server.url, failing=False, busy="/deployments/")
    try:
        with temporary_settings({PREFECT_API_URL: proxy.url, PREFECT_CLIENT_MAX_RETRIES: 1}):
            code = main(["deploy", str(write_blueprint(bp, tmp_path / "bp.yaml"))])
    finally:
        proxy.close()
    err = capsys.readouterr().err
    assert code == 2 and proxy.errors == 2, (code, proxy.errors, err)  # the first answer and Prefect's one retry
    assert err.startswith(f"verlflow deploy: error: the Prefect server at {proxy.url} did not take deployment "
                          "finetune/busy"), err
    assert "503 Service Unavailable" in err and "run the command again" in err and "Traceback" not in err, err


def test_deploy_creates_a_work_pool_deployment_with_the_blueprint(prefect_server, tiny_kit, tmp_path):
    from verlflow.flows.cli import main

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=nightly", "algorithm.lr=0.004")
    assert main(["deploy", str(write_blueprint(bp, tmp_path / "bp.yaml")), "--cron", "0 4 * * *"]) == 0
    dep = api(prefect_server, "/deployments/name/finetune/nightly")
    assert dep["work_pool_name"] == "verlflow" and dep["entrypoint"] == "verlflow.flows.finetune.finetune"
    assert dep["parameters"]["blueprint"] == bp.model_dump(mode="json")  # the full object: the form shows it
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 4 * * *"]
    assert api(prefect_server, "/work_pools/verlflow")["type"] == "process"
    schema = dep["parameter_openapi_schema"]
    assert "blueprint" in schema["properties"] and "AlgorithmSpec" in schema["definitions"]


# -- served deployments: schedule, failure, the UI's Retry, warm start, cancel --------------------------------


def backfill(server, deployment_id, start: dt.datetime, end: dt.datetime) -> dict:
    """Have the server create the cron occurrences in [start, end) (the scheduler's own code path)."""
    body = {"start_time": start.isoformat(), "end_time": end.isoformat(), "min_runs": 0, "max_runs": 5}
    api(server, f"/deployments/{deployment_id}/schedule", body)
    runs = api(server, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}},
                                            "flow_runs": {"expected_start_time": {"before_": end.isoformat(),
                                                                                  "after_": start.isoformat()}}})
    assert len(runs) == 1 and runs[0]["auto_scheduled"], runs
    return runs[0]


@pytest.fixture(scope="module")
def sched(prefect_server, tiny_kit, tmp_path_factory):
    d = tmp_path_factory.mktemp("sched")
    bp = tiny_blueprint(tiny_kit, d / "store", *ONE_RANK, FRESH_JOBS, "name=sched",
                        "schedule.init_from=previous")  # Cancel kills a stage's own job
    return {"bp": bp, "file": write_blueprint(bp, d / "sched.yaml"), "now": dt.datetime.now(dt.timezone.utc)}


@pytest.mark.slow(reason="covered by test_flows::test_retries_follow_the_failure_class and test_schedule's nights")
def test_scheduled_run_fails_in_update_and_the_ui_retry_resumes(prefect_server, serve, tiny_kit, tmp_path):
    """A deployment of its own (blueprint `sched-retry`): no other test's server may pick up its runs."""
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry

    now = dt.datetime.now(dt.timezone.utc)
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=sched-retry", "schedule.init_from=previous")
    bp_file = write_blueprint(bp, tmp_path / "sched-retry.yaml")
    served = serve(bp_file, "--cron", CRON, VERLFLOW_FAULT="nan_loss")  # this server's jobs all hit a NaN
    dep = api(prefect_server, "/deployments/name/finetune/sched-retry")
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == [CRON]
    run = backfill(prefect_server, dep["id"], now - dt.timedelta(hours=24), now - dt.timedelta(hours=12))
    state = wait_state(run["id"])
    assert state.is_failed() and "NONFINITE" in (state.message or "") + served.log.read_text()
    run_id = run_id_of("sched-retry", run)
    scheduled = dt.datetime.fromisoformat(run["expected_start_time"]).astimezone(dt.timezone.utc)
    assert run_id.startswith(f"sched-retry-{scheduled:%Y%m%dT%H%M%SZ}-")  # the occurrence it was scheduled for
    assert api(prefect_server, f"/flow_runs/{run['id']}")["name"] == run_id
    rollout_at = committed_at(bp, run_id, 1, "rollout")
    assert manifest(bp, run_id, 1, "update") is None
    served.stop()

    fixed = serve(bp_file, "--cron", CRON)  # a fixed server (no fault) now serves the deployment
    with get_client(sync_client=True) as client:  # what the UI's Retry button sends
        client.set_flow_run_state(run["id"], AwaitingRetry(message="Retry from the UI"))
    state = wait_state(run["id"], lambda s: s.is_final() and not s.is_failed(), timeout_s=180)
    assert state.is_completed(), state.message
    assert api(prefect_server, f"/flow_runs/{run['id']}")["name"] == run_id  # the Retry kept its run id
    assert committed_at(bp, run_id, 1, "rollout") == rollout_at  # rollout was not run again
    assert manifest(bp, run_id, 1, "export") is not None
    assert any("rollout[1] is committed with the same key: reusing" in m
               for m in logs(prefect_server, run["id"], "reusing"))
    fixed.stop()


@pytest.fixture(scope="module")
def sched_served(serve, sched):
    return serve(sched["file"], "--cron", CRON)


@pytest.fixture(scope="module")
def sched_previous(sched, reference) -> str:
    """The run id of a promoted earlier run of blueprint `sched`, for the next scheduled run to warm-start from:
    the reference run's first iteration cloned into sched's store and promoted (whichever tests ran before)."""
    from reference import clone_stages, promote_clone

    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import ArtifactStore

    steps = [("init", "build"), (1, "rollout"), (1, "update"), (1, "export")]
    clone_stages(ArtifactStore(reference.root), reference.run_id, "sched-previous", steps,
                 dst_store=open_store(sched["bp"].storage))
    promote_clone(sched["bp"], "sched-previous", 1)
    return "sched-previous"


def _stage_job(root_pid: int, stage: str) -> list[psutil.Process]:
    """The torchrun process running `verlflow.core.stages.<stage>` below root_pid, with its workers."""
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if "torch.distributed.run" in " ".join(p.cmdline()) and f"verlflow.core.stages.{stage}" in p.cmdline():
                workers = p.children(recursive=True)
                if workers:
                    return [p, *workers]
        except psutil.Error:
            pass
    return []


@pytest.mark.slow(reason="covered by test_schedule::test_a_scheduled_batch_gets_three_run_ids_that_train_and_warm_start"
                         "_in_order and test_cancel_ui::test_cancel_in_the_ui_of_a_served_run_under_load")
def test_next_scheduled_run_warm_starts_and_cancel_kills_its_job(prefect_server, sched, sched_served,
                                                                  sched_previous):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    bp, now, first = sched["bp"], sched["now"], sched_previous
    dep = api(prefect_server, "/deployments/name/finetune/sched")
    run = backfill(prefect_server, dep["id"], now - dt.timedelta(hours=12), now)
    run_id = run_id_of("sched", run)
    assert run_id != first  # a scheduled run is its own run: nothing is fully cached
    deadline, job = time.monotonic() + 180, []
    while not job:
        assert time.monotonic() < deadline, "the rollout job never started"
        job = _stage_job(sched_served.proc.pid, "rollout")
        time.sleep(0.2)
    build = manifest(bp, run_id, "init", "build")
    assert build["inputs"]["warm_start"]["stage"] == f"runs/{first}/1/update"
    assert build["lineage"][-1]["run_id"] == first

    t0 = time.monotonic()
    with get_client(sync_client=True) as client:  # what the UI's Cancel button sends
        client.set_flow_run_state(run["id"], Cancelling())
    gone = psutil.wait_procs(job, timeout=30)[1] == []
    took = time.monotonic() - t0
    assert gone, f"still alive 30 s after cancel: {[p.pid for p in job if p.is_running()]}"
    assert wait_state(run["id"], timeout_s=60).is_cancelled()
    assert manifest(bp, run_id, 1, "rollout") is None  # nothing half-written was committed
    assert took < 15
    deadline = time.monotonic() + 20  # the cancelled task gave its device slots back
    while api(prefect_server, "/v2/concurrency_limits/verlflow-cpu-slots")["active_slots"]:
        assert time.monotonic() < deadline, "the cancelled run still holds its device slots"
        time.sleep(0.5)
    print(f"\ncancel -> job gone in {took:.1f} s, slots released {time.monotonic() - t0:.1f} s after the cancel")


# -- the blueprint from a URI; the cancel watcher when the API fails ---------------------------------------------


def test_s3_blueprint_file_paths_are_relative_to_its_folder_and_leave_no_temp_file(s3_bucket, tiny_kit, tmp_path,
                                                                                   monkeypatch):
    import tempfile

    import yaml

    from verlflow.core.blueprint import Blueprint
    from verlflow.core.errors import BlueprintError
    from verlflow.flows.common import resolve_blueprint

    spill = tmp_path / "tmp"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))  # where a temp copy of the file would land
    text = yaml.safe_dump({"name": "from-s3", "model": {"path": tiny_kit["model_dir"]},
                           "data": {"train_files": ["../data/train.parquet"]}, "storage": {"uri": "artifacts"}})
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key="exp/bp.yaml", Body=text.encode())
    bp = resolve_blueprint(Blueprint(), f"{s3_bucket.uri}/exp/bp.yaml")
    assert bp.name == "from-s3"
    assert bp.storage.uri == f"{s3_bucket.uri}/exp/artifacts"  # relative to the file's folder, not /tmp
    assert bp.data.train_files == [f"{s3_bucket.uri}/data/train.parquet"]
    assert bp.model.path == tiny_kit["model_dir"]  # an absolute local path stays as it is
    assert list(spill.iterdir()) == []
    with pytest.raises(BlueprintError, match=r"exp/nope.yaml: no such blueprint file"):
        resolve_blueprint(Blueprint(), f"{s3_bucket.uri}/exp/nope.yaml")


class FlakyApi:
    """An HTTP proxy in front of the Prefect server that answers 500 to every GET while `failing` is set, and 503
    (what the server answers while its SQLite database is busy) to every POST to `busy` (a path under /api)."""

    def __init__(self, upstream: str, failing: bool = True, busy: str | None = None):
        import http.server
        import threading

        import httpx

        flaky = self
        self.failing, self.errors = failing, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if flaky.failing:
                    flaky.errors += 1
                    self.answer(500, b'{"detail": "injected"}', "application/json")
                else:
                    self.forward()

            def do_POST(self):
                if busy is not None and self.path == "/api" + busy:
                    flaky.errors += 1
                    self.answer(503, b'{"exception_message": "Service Unavailable"}', "application/json")
                else:
                    self.forward()

            do_PATCH = do_PUT = do_DELETE = do_POST

            def forward(self):
                n = int(self.headers.get("content-length") or 0)
                r = httpx.request(self.command, upstream + self.path.removeprefix("/api"), timeout=30,
                                  content=self.rfile.read(n) if n else None,
                                  headers={k: v for k, v in self.headers.items() if k.lower() == "content-type"})
                self.answer(r.status_code, r.content, r.headers.get("content-type", ""))

            def answer(self, status, body, kind):
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_cancel_watcher_logs_an_api_error_once_and_still_sees_the_cancel(prefect_server, caplog):
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from verlflow.tasks.stages import cancel_requested

    flow_id = api(prefect_server, "/flows/", {"name": "cancel-watch"})["id"]
    run = api(prefect_server, "/flow_runs/", {"flow_id": flow_id, "state": {"type": "RUNNING"}})
    proxy = FlakyApi(prefect_server.url)
    try:
        with temporary_settings({PREFECT_API_URL: proxy.url, PREFECT_CLIENT_MAX_RETRIES: 0}), \
                cancel_requested(every_s=0.1, flow_run_id=run["id"]) as cancel:
            deadline = time.monotonic() + 30
            while proxy.errors < 5:
                assert time.monotonic() < deadline, "the watcher stopped asking"
                time.sleep(0.1)
            proxy.failing = False  # the API recovers; then the UI's Cancel
            api(prefect_server, f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
            assert cancel.wait(30), "the watcher never saw the cancel after the API recovered"
    finally:
        proxy.close()
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "cancel watcher" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "500" in warned[0].getMessage() and run["id"] in warned[0].getMessage()


def test_summaries_link_final_locations_and_the_policy_and_a_rerun_shows_cached(prefect_server, tiny_kit, tmp_path):
    """Warm workers with background commits: the flow takes the device slots once for its pool (a stage task never
    waits for slots while an idle pool holds the devices), the stages run warm, and all is given back at the end;
    every stage summary links the stage's final location (never an empty link), the checkpoint's and the run's
    summaries link the promoted policy (URI and local path); a rerun of the same run id reuses every stage and its
    task runs end in the state named Cached, the flow still gets results."""
    from verlflow.flows.finetune import finetune
    from verlflow.tasks.slots import limit_name

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=tiny-links", "resources.warm_workers=true")
    first = finetune(blueprint=bp, run_id="links1", return_state=True)
    assert first.is_completed(), first.message
    fr = first.state_details.flow_run_id
    msgs = logs(prefect_server, fr, "warm pool")
    assert any("warm workers: the flow holds 1 slot(s)" in m for m in msgs)  # ONE_RANK: 1 rank
    assert not any("needs 1 slot(s)" in m for m in msgs)  # no per-task slot requests
    waits = [manifest(bp, "links1", 1, st)["timings"]["launch_to_worker_s"] for st in ("rollout", "update", "export")]
    assert max(waits) < 0.5, waits
    assert api(prefect_server, f"/v2/concurrency_limits/{limit_name('cpu')}")["active_slots"] == 0
    left = [p for p in psutil.Process().children(recursive=True) if "verlflow.core.stages" in " ".join(p.cmdline())]
    assert not left, "the warm pool outlived its flow"
    arts = api(prefect_server, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [str(fr)]}}})
    stage_md = {a["description"]: a["data"] for a in arts if a["type"] == "markdown" and not a["key"]}
    assert "in the warm pool's background" in stage_md["update[1]"]  # the case that linked the server's root
    root = bp.storage.uri.removeprefix("file://")
    for name, md in stage_md.items():  # paths to copy: the http UI ignores file:// links (tests/test_ui_links.py)
        assert "``" not in md and "file://" not in md, name
        stage, it = name.rstrip("]").split("[")
        path = f"{root}/runs/links1/{it}/{stage}"
        assert f"`{path}`" in md and f"`{path}/manifest.json`" in md, (name, md)
    hf = f"{root}/runs/links1/1/export/hf"
    pointer = f"`{root}/pointers/runs/links1/latest.json`"
    assert f"`{hf}`" in stage_md["export[1]"] and pointer in stage_md["export[1]"]
    # the last version, written once the background commits landed, says what the pointer names then
    summary = max((a for a in arts if a["key"] == "links1-summary"), key=lambda a: a["created"])["data"]
    assert "- Promoted policy: iteration 1; HF folder:" in summary, summary
    assert f"`{hf}`" in summary and pointer in summary
    assert (Path(hf) / "config.json").is_file() and open_store_pointer(bp, "links1")["hf_uri"] == f"file://{hf}"

    again = finetune(blueprint=bp, run_id="links1", return_state=True)
    assert again.is_completed(), again.message
    assert again.result()["iterations"][0]["reused"] == "rollout,update,export"
    names = task_runs(prefect_server, again.state_details.flow_run_id)
    assert {n: r["state_name"] for n, r in names.items()} == {n: "Cached" for n in names}, names
    assert {r["state_type"] for r in names.values()} == {"COMPLETED"}


def open_store_pointer(bp, run_id: str) -> dict:
    from verlflow.core.store.artifacts import open_store

    return open_store(bp.storage).get_pointer(f"runs/{run_id}/latest")


def test_every_flow_parameter_of_the_run_form_has_a_description():
    """The run form: the flow's own parameters (from its docstring) and every blueprint field, at any depth."""
    from prefect.utilities.callables import parameter_schema
    from test_blueprint import undescribed

    from verlflow.flows.finetune import finetune

    schema = parameter_schema(finetune.fn).model_dump()
    assert set(schema["properties"]) == {"blueprint", "run_id", "blueprint_file", "from_step"}
    assert undescribed(schema) == []
    for name in ("run_id", "blueprint_file", "from_step"):  # a set/none toggle in the form, not str/None
        assert [b.get("title") for b in schema["properties"][name]["anyOf"]] == ["set", "none"], name


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.slow(
    reason="covered by test_flows::test_summaries_link_final_locations_and_the_policy_and_a_rerun_shows_cached")
def test_one_warm_pool_rule_drives_the_runner_and_the_flow_slots(prefect_server, tiny_kit, tmp_path, monkeypatch,
                                                                 pooled):
    """ResourcesSpec.warm_pool alone decides whether a stage runs in the warm pool (the runner) and who holds the
    device slots (the flow for a pool, else the stage task): set against warm_workers, both follow it."""
    from prefect import flow

    from verlflow.core.blueprint import ResourcesSpec
    from verlflow.core.orchestrate.pool import warm_pools
    from verlflow.tasks.slots import limit_name
    import verlflow.tasks.stages as ts

    monkeypatch.setattr(ResourcesSpec, "warm_pool", property(lambda self: pooled))
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, f"name=rule-{str(pooled).lower()}",
                        f"resources.warm_workers={str(not pooled).lower()}")

    @flow
    def one() -> int:
        with warm_pools() as pools, ts.pipeline_slots(bp):
            held = api(prefect_server, f"/v2/concurrency_limits/{limit_name('cpu')}")["active_slots"]
            ts.stage_task("validate", "init", bp)("validate", "init", {}, bp, "rule", True, pools=pools)
        return held

    state = one(return_state=True)
    assert state.is_completed(), state.message
    msgs = logs(prefect_server, state.state_details.flow_run_id, "validate[init] -> ")
    launch = next(m for m in msgs if "validate[init] -> " in m)
    assert ("warm pool" in launch) == pooled, launch
    assert (state.result() == bp.resources.nproc_per_node) == pooled  # the flow holds the pool's slots
    assert any("needs 1 slot(s)" in m for m in msgs) == (not pooled)  # else the task takes its own
