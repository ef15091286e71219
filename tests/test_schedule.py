"""Recurring fine-tunes against Prefect's real scheduler: a `prefect server` with its scheduler service on (the
shared test server has it off) and `verlflow serve` running the deployment.

- The scheduler creates a deployment's upcoming runs in one batch, and Prefect's flow-run ids are time-ordered, so
  those runs share any prefix of their ids: each must still get its own run id, train, and (init_from: previous)
  warm-start from the last promoted policy (nights 2 and 3 fail the gate), in the order they were scheduled.
- Runs created through the API within one second, for the same start, get distinct run ids too (the start time
  alone does not make a run id: these ids are random, the random part of the id does).
- A schedule added in the UI survives a restart of `verlflow serve`.
- Runs of a deployment with init_from: previous take turns (flows/common.py: take_turn): the rules of who goes
  first, the deployment's concurrency limit, and three runs queued behind a long one under a process worker.
"""

import datetime as dt
import json
import time

import pyarrow.parquet as pq
import pytest
from tinybp import ONE_RANK, tiny_blueprint
from prefect_server import (PREFECT, ROOT, Served, _stop, api, manifest, start_polling, start_serve, start_server,
                           write_blueprint)

from verlflow.core.orchestrate.pipeline import run_pipeline
from verlflow.core.store.artifacts import open_store
from verlflow.flows.common import QUEUED

pytestmark = pytest.mark.system

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
    """Three nights the scheduler made in one batch, started out of order, each under its own run id, in order. The
    chain has a gate (promote.metric=update/step, mode min): nights 2 and 3 take as many steps as night 1, fail it
    and start from night 1's policy; the prompts run on across the epochs of an 8-row train file, each night has its
    own seed, and a rerun of a night reuses every stage."""
    train_file = tmp_path / "train8.parquet"
    pq.write_table(pq.read_table(tiny_kit["train_file"]).slice(0, 8), train_file)
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=nightly", "schedule.cron='0 3 * * *'",
                        "schedule.init_from=previous", "resources.warm_workers=true", "promote.metric=update/step",
                        "promote.mode=min", f"data.train_files={json.dumps([str(train_file)])}")
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
        # Bring nights 3 and 2 forward to now, and queue night 1 as Prefect queues a run the deployment's slot held
        # back (asking again in a minute): the runner starts a later night first, which must give its turn back to
        # night 1 and wait, and all must still go in the order they were scheduled.
        now = dt.datetime.now(dt.timezone.utc)
        for r, name, at in ((runs[2], "Scheduled", now), (runs[1], "Scheduled", now),
                            (runs[0], QUEUED, now + dt.timedelta(seconds=60))):
            api(sched_server, f"/flow_runs/{r['id']}/set_state", {"force": True, "state": {
                "type": "SCHEDULED", "name": name, "state_details": {"scheduled_time": at.isoformat()}}})
        done = wait_final(sched_server, [r["id"] for r in runs], timeout_s=400)
    finally:
        served.stop()
    assert [done[r["id"]]["state_type"] for r in runs] == ["COMPLETED"] * 3, served.log.read_text()[-3000:]
    waits = [s["message"] for r in runs[1:] for s in states(sched_server, r["id"]) if s["name"] == QUEUED]
    assert f"waiting for its turn after {runs[0]['name']}" in waits, waits  # a later night gave its turn back
    run_ids = [done[r["id"]]["name"] for r in runs]  # each flow run is named after the run id it used
    assert len(set(run_ids)) == 3, run_ids
    for run_id, r in zip(run_ids, runs):
        start = dt.datetime.fromisoformat(r["expected_start_time"]).astimezone(dt.timezone.utc)
        assert run_id == f"nightly-{start:%Y%m%dT%H%M%SZ}-{r['id'].replace('-', '')[-8:]}"
        assert manifest(bp, run_id, 1, "export") is not None  # each trained under its own run id
    builds = [manifest(bp, run_id, "init", "build") for run_id in run_ids]
    assert "warm_start" not in builds[0]["inputs"]  # nothing promoted before the first: the base model
    assert [b["inputs"]["warm_start"]["stage"] for b in builds[1:]] == [f"runs/{run_ids[0]}/1/update"] * 2
    assert [e["run_id"] for e in builds[2]["lineage"]] == run_ids[:1]  # base -> night 1 -> night 3
    assert all(f"the policy of run {run_ids[0]} iteration 1" in b["metrics"]["start"] for b in builds[1:])
    latest = open_store(bp.storage).get_pointer("blueprints/nightly/latest")
    assert [e["run_id"] for e in latest["history"]] == run_ids[:1]  # nights 2 and 3 failed the gate
    # the chain's prompts run on from night to night (4 an iteration; every row once an epoch), each its own seed
    assert [(b["metrics"]["chain_position"], b["metrics"]["data_cursor"]) for b in builds] == [(0, 0), (1, 4), (2, 8)]
    stream = [row for run_id in run_ids for row in trained_rows(bp, run_id)]
    assert sorted(stream[:8]) == list(range(8)) and len(set(stream[8:])) == 4, stream
    assert len({b["metrics"]["seed"] for b in builds}) == 3
    assert all(r.skipped for r in run_pipeline(bp, run_ids[1], on_line=lambda line: None))  # seed and place kept


def trained_rows(bp, run_id: str) -> list[int]:
    """The train file's rows a run's first rollout sampled, in its batch's order."""
    samples = pq.read_table(f"{bp.storage.uri}/runs/{run_id}/1/rollout/samples.parquet").to_pylist()
    return [row for _, row in sorted({s["group"]: s["row"] for s in samples}.items())]


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


@pytest.mark.slow(
    reason="covered by test_schedule::test_a_scheduled_batch_gets_three_run_ids_that_train_and_warm_start_in_order")
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


def test_a_run_goes_after_earlier_runs_that_run_or_wait_for_their_first_turn(sched_server, tiny_kit, tmp_path):
    """The rules of `take_turn`: an earlier run goes first while it runs, is queued for the deployment's slot,
    is due (a runner at its --limit may hold it back: it starts first once a process is free) or gave its turn
    back. Runs scheduled later, an earlier run that has ended before (a Retry of it keeps the warm start its
    build recorded, queued or not) and one moved to a later start hold nobody up. And of `pass_turn`: a run that
    ends makes the earliest queued run that has not had its turn due at once."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from verlflow.flows.common import pass_turn, runs_ahead
    from verlflow.flows.deploy import finetune_deployment

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=order")
    now = dt.datetime.now(dt.timezone.utc)
    with temporary_settings({PREFECT_API_URL: sched_server.url}):
        dep_id = str(finetune_deployment(bp).apply())

    def run(hours_ago: float, *states: str, due_in_s: float = 0) -> str:
        """A run scheduled `hours_ago`, then taken through `states` (a Scheduled one due in `due_in_s`)."""
        at = (now - dt.timedelta(hours=hours_ago)).isoformat()
        r = api(sched_server, f"/deployments/{dep_id}/create_flow_run",
                {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": at}}})
        for name in states:
            due = {"scheduled_time": (now + dt.timedelta(seconds=due_in_s)).isoformat()}
            kind = "SCHEDULED" if name in ("Scheduled", "AwaitingRetry", QUEUED) else name.upper()
            api(sched_server, f"/flow_runs/{r['id']}/set_state", {"force": True, "state": {
                "type": kind, "name": name, "state_details": due if kind == "SCHEDULED" else {}}})
        return r["id"]

    running = run(5, "Running")
    queued = run(4.5, QUEUED, due_in_s=60)  # asks for the slot again in a minute
    due_now = run(4, "Scheduled")  # its runner is about to start it
    gave_back = run(3.5, "Running", QUEUED, due_in_s=60)
    run(3, "Running", "Failed", "AwaitingRetry")
    run(2.5, "Running", "Failed", "AwaitingRetry", QUEUED, due_in_s=60)  # a Retry queued for the slot
    held_back = run(2.2, "Scheduled", due_in_s=-90)
    run(2, "Scheduled", due_in_s=86400)  # moved to tomorrow
    run(1.5, "Running", "Completed")
    me = run(1, "Running")
    run(0.5, QUEUED, due_in_s=60)  # scheduled after me
    with temporary_settings({PREFECT_API_URL: sched_server.url}), get_client(sync_client=True) as client:
        ahead = [str(r.id) for r in runs_ahead(client.read_flow_run(me), client)]
        assert ahead == [running, queued, due_now, gave_back, held_back]
        # my run ends: the earliest queued run that has not had its turn is due at once, the other queued ones not
        pass_turn(None, client.read_flow_run(me), None)
        due = {i: client.read_flow_run(i).next_scheduled_start_time for i in (queued, gave_back)}
    assert due[queued] <= dt.datetime.now(dt.timezone.utc) < due[gave_back], due


def test_deploy_gives_a_recurring_deployment_one_slot_that_queues_and_takes_it_back(sched_server, tiny_kit, tmp_path):
    """`verlflow deploy` of a blueprint with schedule.init_from: previous: a concurrency limit of one run with the
    ENQUEUE strategy (its other runs wait as Scheduled); deployed again with init_from: base, the limit goes."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from verlflow.flows.deploy import deploy

    def limit(init_from: str):
        bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=turns", f"schedule.init_from={init_from}")
        with temporary_settings({PREFECT_API_URL: sched_server.url}):
            dep = api(sched_server, f"/deployments/{deploy(bp)}")
        gcl = dep["global_concurrency_limit"]
        return gcl and (gcl["limit"], dep["concurrency_options"]["collision_strategy"])

    assert limit("previous") == (1, "ENQUEUE")
    assert limit("base") is None


def start_worker(server, pool: str, log, *args: str) -> Served:
    """`prefect worker start --pool POOL` against `server`, polling every second; returns once it polls."""
    return start_polling([PREFECT, "worker", "start", "--pool", pool, *args], log,
                         {**server.env, "PREFECT_WORKER_QUERY_SECONDS": "1",
                          "PYTHONPATH": str(ROOT / "tests")}, "started!")  # the flow's module, turnflow


def states(server, run_id: str) -> list[dict]:
    return sorted(api(server, "/flow_run_states/?flow_run_id=" + run_id), key=lambda s: at(s["timestamp"]))


def at(iso: str) -> dt.datetime:
    return dt.datetime.fromisoformat(iso)


def test_three_runs_queued_behind_a_long_one_wait_as_scheduled_and_each_runs_in_order(sched_server, tmp_path):
    """Runs of a deployment with schedule.init_from: previous take turns on the SQLite server: three runs come due
    (out of creation order, two at the same second) while a long one holds the turn, and a process worker
    (`verlflow deploy`'s setup) at its --limit of two runs them. While waiting none is Pending or Running (no
    process, no polling);
    every one of them runs, none crashes, and each starts after the one scheduled before it has ended. The runs
    take their turn as `finetune` does and then hold it (tests/turnflow.py): a training each would cost minutes."""
    from prefect.deployments.runner import EntrypointType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from turnflow import RECURRING, turns

    from verlflow.flows.common import turn_limit
    from verlflow.flows.deploy import ensure_process_pool

    with temporary_settings({PREFECT_API_URL: sched_server.url}):
        ensure_process_pool("turns")
        dep_id = str(turns.to_deployment("queue", work_pool_name="turns", entrypoint_type=EntrypointType.MODULE_PATH,
                                         concurrency_limit=turn_limit(RECURRING)).apply())
    worker = start_worker(sched_server, "turns", tmp_path / "worker.log", "--limit", "2")

    def create(at: dt.datetime, hold_s: float) -> str:
        return api(sched_server, f"/deployments/{dep_id}/create_flow_run", {
            "parameters": {"hold_s": hold_s},
            "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": at.isoformat()}}})["id"]

    def snapshot() -> dict[str, dict]:
        return {r["id"]: r for r in api(sched_server, "/flow_runs/filter",
                                        {"deployments": {"id": {"any_": [dep_id]}}})}

    try:
        long = create(dt.datetime.now(dt.timezone.utc), hold_s=10)
        deadline = time.monotonic() + 120
        while api(sched_server, f"/flow_runs/{long}")["state_type"] != "RUNNING":
            assert time.monotonic() < deadline, "the long run never started"
            time.sleep(0.5)
        soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3)
        # created latest first, a pair due at the same second (their order: by id); with the long one, more runs
        # than the worker's --limit (five cost 18 CPU-s more: a flow process each)
        queued = [create(soon + dt.timedelta(seconds=s), hold_s=0) for s in (1, 0, 0)]
        deadline, seen = time.monotonic() + 400, []
        while not all((runs := snapshot())[i]["state_type"] in FINAL for i in [long, *queued]):
            assert time.monotonic() < deadline, {i: r["state_name"] for i, r in runs.items()}
            seen.append(runs)
            time.sleep(1)
    finally:
        worker.stop()
    order = sorted(queued, key=lambda i: (at(runs[i]["expected_start_time"]), i))
    assert [runs[i]["state_name"] for i in [long, *order]] == ["Completed"] * 4, worker.log.read_text()[-3000:]
    for snap in seen:
        active = sorted(r["name"] for r in snap.values() if r["state_type"] in ("PENDING", "RUNNING", "CANCELLING"))
        assert len(active) <= 1, active  # one run holds the turn; the others wait as Scheduled
        if snap[long]["state_type"] == "RUNNING":
            assert all(snap[i]["state_type"] == "SCHEDULED" for i in queued if i in snap)
    assert any(r["state_name"] == "AwaitingConcurrencySlot" for snap in seen for r in snap.values())
    ended = None
    for i in [long, *order]:  # each run's turn (its last Running) starts after the previous one has ended
        hist = states(sched_server, i)
        turn = [at(s["timestamp"]) for s in hist if s["type"] == "RUNNING"][-1]
        assert ended is None or turn >= ended, (runs[i]["name"], turn, ended)
        ended = [at(s["timestamp"]) for s in hist if s["type"] == "COMPLETED"][-1]
