"""Recurring fine-tunes against Prefect's real scheduler: a `prefect server` with its scheduler service on (the
shared test server has it off) and `verlflow serve` running the deployment.

- The scheduler creates a deployment's upcoming runs in one batch, and Prefect's flow-run ids are time-ordered, so
  those runs share any prefix of their ids: each must still get its own run id, train, and (init_from: previous)
  warm-start from the previous run's promoted policy, in the order they were scheduled.
- Runs created through the API within one second, for the same start, get distinct run ids too (the start time
  alone does not make a run id: these ids are random, the random part of the id does).
- A schedule added in the UI survives a restart of `verlflow serve`.
"""

import datetime as dt
import time

import pytest
from tinybp import ONE_RANK, tiny_blueprint
from prefect_server import _stop, api, manifest, start_serve, start_server, write_blueprint

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


@pytest.fixture(scope="module")
def sched_server(tmp_path_factory):
    svc = "PREFECT_SERVER_SERVICES_SCHEDULER"
    # The recent-deployments loop schedules a deployment within a second of its registration; MIN_RUNS is how
    # many upcoming runs it creates at once (Prefect's default, spelled out because the test relies on it).
    proc, server = start_server(tmp_path_factory.mktemp("sched-home"), **{
        f"{svc}_ENABLED": "true", f"{svc}_RECENT_DEPLOYMENTS_LOOP_SECONDS": "1", f"{svc}_MIN_RUNS": "3"})
    yield server
    _stop(proc)


def deployment_runs(server, dep_id: str) -> list[dict]:
    runs = api(server, "/flow_runs/filter", {"deployments": {"id": {"any_": [dep_id]}}})
    return sorted(runs, key=lambda r: (r["expected_start_time"], r["id"]))


def wait_final(server, run_ids: list[str], timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = {i: api(server, f"/flow_runs/{i}") for i in run_ids}
        if all(r["state_type"] in FINAL for r in runs.values()):
            return runs
        assert time.monotonic() < deadline, {i: r["state_name"] for i, r in runs.items()}
        time.sleep(1)


def test_a_scheduled_batch_gets_three_run_ids_that_train_and_warm_start_in_order(sched_server, tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=nightly", "schedule.cron='0 3 * * *'",
                        "schedule.init_from=previous", "resources.warm_workers=true")
    served = start_serve(sched_server, write_blueprint(bp, tmp_path / "nightly.yaml"), log=tmp_path / "serve.log")
    try:
        dep = api(sched_server, "/deployments/name/finetune/nightly")
        deadline = time.monotonic() + 60
        while len(runs := deployment_runs(sched_server, dep["id"])) < 3:
            assert time.monotonic() < deadline, f"the scheduler made {len(runs)} run(s) in 60 s"
            time.sleep(0.5)
        runs = runs[:3]  # the next three nights, made by the scheduler service in one batch
        assert all(r["auto_scheduled"] for r in runs)
        assert len({r["id"][:8] for r in runs}) == 1  # what the old run id `<name>-<id[:8]>` was made of
        # Bring the three nights forward to now, the latest first: the runner then starts them all at once, the
        # last one first, and they must still go in the order they were scheduled.
        for r in reversed(runs):
            api(sched_server, f"/flow_runs/{r['id']}/set_state", {"force": True, "state": {
                "type": "SCHEDULED", "name": "Scheduled",
                "state_details": {"scheduled_time": dt.datetime.now(dt.timezone.utc).isoformat()}}})
        done = wait_final(sched_server, [r["id"] for r in runs], timeout_s=400)
    finally:
        served.stop()
    assert [done[r["id"]]["state_type"] for r in runs] == ["COMPLETED"] * 3, served.log.read_text()[-3000:]
    run_ids = [done[r["id"]]["name"] for r in runs]  # each flow run is named after the run id it used
    assert len(set(run_ids)) == 3, run_ids
    for run_id, r in zip(run_ids, runs):
        start = dt.datetime.fromisoformat(r["expected_start_time"]).astimezone(dt.timezone.utc)
        assert run_id == f"nightly-{start:%Y%m%dT%H%M%SZ}-{r['id'].replace('-', '')[-8:]}"
        assert manifest(bp, run_id, 1, "checkpoint") is not None  # each trained under its own run id
    builds = [manifest(bp, run_id, "init", "build") for run_id in run_ids]
    assert "warm_start" not in builds[0]["inputs"]  # nothing promoted before the first: the base model
    for prev, build in zip(run_ids, builds[1:]):
        assert build["inputs"]["warm_start"]["stage"] == f"runs/{prev}/1/update"
    assert [e["run_id"] for e in builds[2]["lineage"]] == run_ids[:2]  # base -> night 1 -> night 2 -> night 3


def test_runs_created_in_the_same_second_through_the_api_get_distinct_run_ids(sched_server, tiny_kit, tmp_path):
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from verlflow.flows.common import run_id_for
    from verlflow.flows.deploy import finetune_deployment

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=adhoc")
    with temporary_settings({PREFECT_API_URL: sched_server.url}):
        dep_id = str(finetune_deployment(bp).apply())
    at = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=30)).replace(microsecond=0).isoformat()
    body = {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": at}}}  # nobody runs them
    runs = [api(sched_server, f"/deployments/{dep_id}/create_flow_run", body) for _ in range(3)]
    run_ids = {run_id_for(bp.name, FlowRun.model_validate(r)) for r in runs}
    assert len(run_ids) == 3 and len({i.rsplit("-", 1)[0] for i in run_ids}) == 1, run_ids  # same second


def test_serve_restart_keeps_schedules_added_in_the_ui(sched_server, tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=keep", "schedule.cron='0 3 * * *'")
    f = write_blueprint(bp, tmp_path / "keep.yaml")

    def schedules() -> set:
        dep = api(sched_server, "/deployments/name/finetune/keep")
        return {(s["schedule"]["cron"], s["active"]) for s in dep["schedules"]}

    start_serve(sched_server, f, log=tmp_path / "serve0.log").stop()
    dep = api(sched_server, "/deployments/name/finetune/keep")
    (ours,) = dep["schedules"]
    # what the UI sends: a new schedule, and a pause of the blueprint's
    ui_schedule = {"cron": "30 5 * * 1", "timezone": "UTC"}
    api(sched_server, f"/deployments/{dep['id']}/schedules",
        [{"slug": None, "active": True, "parameters": {}, "schedule": ui_schedule}])
    api(sched_server, f"/deployments/{dep['id']}/schedules/{ours['id']}", {"active": False}, method="PATCH")
    assert schedules() == {("0 3 * * *", False), ("30 5 * * 1", True)}

    start_serve(sched_server, f, log=tmp_path / "serve1.log").stop()
    assert schedules() == {("0 3 * * *", False), ("30 5 * * 1", True)}  # kept, the pause too, nothing doubled
    start_serve(sched_server, f, "schedule.cron=null", log=tmp_path / "serve2.log").stop()
    assert schedules() == {("30 5 * * 1", True)}  # the blueprint's own goes with its cron; the UI's stays


def test_a_run_waits_only_for_earlier_runs_that_are_running_or_about_to_start(sched_server, tiny_kit, tmp_path):
    """The rules that keep the order without a deadlock: runs scheduled later, an earlier run awaiting a Retry
    (its build keeps its warm start) and a due run the runner has not started for a minute hold nobody up."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from verlflow.flows.common import START_GRACE_S, earlier_unfinished_runs
    from verlflow.flows.deploy import finetune_deployment

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=order")
    now = dt.datetime.now(dt.timezone.utc)
    with temporary_settings({PREFECT_API_URL: sched_server.url}):
        dep_id = str(finetune_deployment(bp).apply())

    def run(hours_ago: float, *states: str, due_s_ago: float = 0) -> str:
        """A run scheduled `hours_ago`, then taken through `states` ("Scheduled" is due `due_s_ago`)."""
        at = (now - dt.timedelta(hours=hours_ago)).isoformat()
        r = api(sched_server, f"/deployments/{dep_id}/create_flow_run",
                {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": at}}})
        for name in states:
            due = {"scheduled_time": (now - dt.timedelta(seconds=due_s_ago)).isoformat()}
            kind = "SCHEDULED" if name in ("Scheduled", "AwaitingRetry") else name.upper()
            api(sched_server, f"/flow_runs/{r['id']}/set_state", {"force": True, "state": {
                "type": kind, "name": name, "state_details": due if kind == "SCHEDULED" else {}}})
        return r["id"]

    running = run(5, "Running")
    due_now = run(4, "Scheduled")  # due, never ran: the runner is about to start it
    awaiting_retry = run(3, "Running", "Failed", "AwaitingRetry")
    run(2, "Scheduled", due_s_ago=START_GRACE_S + 30)  # due long ago and not started: held back by a limit
    run(1.5, "Running", "Completed")
    me = run(1, "Running")
    run(0.5, "Running")  # scheduled after me
    with temporary_settings({PREFECT_API_URL: sched_server.url}), get_client(sync_client=True) as client:
        assert client.read_flow_run(awaiting_retry).run_count == 1
        waits_for = [str(r.id) for r in earlier_unfinished_runs(client.read_flow_run(me), client)]
    assert waits_for == [running, due_now]
