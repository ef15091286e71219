"""The production stack for real: Prefect server on PostgreSQL (Debian's postgresql, a fresh cluster started here),
a deployment made by `verlflow deploy` on the process work pool, its cron occurrence executed by a real
`prefect worker start --pool verlflow --type process`. Nothing of tests/prefect_server.py's SQLite server is used.

The cluster runs as the `postgres` system user when the test runs as root (postgres refuses root); its data and
unix socket live in a temporary directory that is removed at the end, with the server, postgres and the worker.
"""

import asyncio
import datetime as dt
import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sysdeps import unavailable
from tinybp import ONE_RANK, tiny_blueprint
from prefect_server import PREFECT, QUIET, ROOT, VERLFLOW, _free_port, _stop, manifest, \
    write_blueprint

pytestmark = pytest.mark.system

DB, USER, PW = "prefect", "verlflow", "pg-test-pw"


def _pg_bin() -> Path | None:
    for d in [os.environ.get("VERLFLOW_PG_BIN"), *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]:
        if d and all((Path(d) / b).exists() for b in ("initdb", "pg_ctl", "postgres")):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found and shutil.which("pg_ctl") else None


@dataclass
class PgStack:
    url: str  # the Prefect API
    env: dict  # what a client subprocess needs
    pg_port: int
    home: Path
    timings: dict


def _as_pg_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


def _sql(port: int, query: str, *args, db: str = DB):
    import asyncpg

    async def go():
        conn = await asyncpg.connect(host="127.0.0.1", port=port, user=USER, password=PW, database=db)
        try:
            return await conn.fetch(query, *args)
        finally:
            await conn.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def pg_prefect():
    pg_bin = _pg_bin()
    if pg_bin is None:
        unavailable("PostgreSQL server binaries (initdb, pg_ctl, postgres) not found")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root and there is no `postgres` user to run the cluster as")
        if not shutil.which("runuser"):
            unavailable("running as root and runuser is missing")
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        unavailable("asyncpg (a Prefect server dependency) is not installed")

    timings = {}
    tmp = Path(tempfile.mkdtemp(prefix="verlflow-pg-"))  # under /tmp: reachable by the postgres user
    data, sock, pwfile = tmp / "data", tmp / "sock", tmp / "pwfile"
    sock.mkdir()
    pwfile.write_text(PW + "\n")
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        for p in (tmp, sock, pwfile):
            os.chown(p, pg.pw_uid, pg.pw_gid)
    pg_port = _free_port()
    pg_log = tmp / "postgres.log"
    pg_started = server = log = None
    home = tmp / "prefect-home"
    try:
        t0 = time.monotonic()
        subprocess.run(_as_pg_user([str(pg_bin / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}",
                                    "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                                    "--locale=C"]), check=True, capture_output=True, text=True)
        subprocess.run(_as_pg_user([str(pg_bin / "pg_ctl"), "-D", str(data), "-l", str(pg_log), "-w", "-t", "60",
                                    "-o", f"-h 127.0.0.1 -p {pg_port} -k {sock} -c fsync=off", "start"]),
                       check=True, capture_output=True, text=True)
        pg_started = True
        _sql(pg_port, f"CREATE DATABASE {DB}", db="postgres")
        timings["postgres_s"] = time.monotonic() - t0

        home.mkdir()
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        db_url = f"postgresql+asyncpg://{USER}:{PW}@127.0.0.1:{pg_port}/{DB}"
        server_env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, **QUIET,
                      "PREFECT_HOME": str(home), "PREFECT_API_DATABASE_CONNECTION_URL": db_url,
                      "PREFECT_UI_API_URL": url, "PREFECT_LOGGING_LEVEL": "WARNING"}
        log = open(home / "server.log", "w")
        t0 = time.monotonic()
        server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prefect server on postgres did not start:\n{(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.3)
        timings["server_start_s"] = time.monotonic() - t0
        client_home = home / "client"
        client_home.mkdir()
        env = {**QUIET, "PREFECT_API_URL": url, "PREFECT_HOME": str(client_home)}
        yield PgStack(url, env, pg_port, home, timings)
    finally:
        if server is not None:
            _stop(server, 20.0)
        if log is not None:
            log.close()
        if pg_started:
            subprocess.run(_as_pg_user([str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _api(stack: PgStack, path: str, body: dict | None = None):
    r = httpx.post(f"{stack.url}{path}", json=body, timeout=30) if body is not None else \
        httpx.get(f"{stack.url}{path}", timeout=30)
    r.raise_for_status()
    return r.json() if r.content else None


@pytest.mark.slow(reason="the same flow on SQLite: covered by test_flows::test_pipeline_flow_run_with_artifacts")
def test_scheduled_run_executes_through_a_process_worker_on_postgres(pg_prefect, tiny_kit, tmp_path):
    stack = pg_prefect
    # a daily cron whose occurrence today was a minute ago: the backfill below makes exactly that run
    occ = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)).replace(second=0, microsecond=0)
    cron = f"{occ.minute} {occ.hour} * * *"
    store = tmp_path / "store"
    bp = tiny_blueprint(tiny_kit, store, *ONE_RANK, "name=pg-nightly", "resources.warm_workers=true")
    bp_file = write_blueprint(bp, tmp_path / "bp.yaml")
    env = {**os.environ, **stack.env}
    out = subprocess.run([VERLFLOW, "deploy", str(bp_file), "--name", "pg-nightly", "--cron", cron], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    dep = _api(stack, "/deployments/name/finetune/pg-nightly")
    assert dep["work_pool_name"] == "verlflow" and dep["entrypoint"] == "verlflow.flows.finetune.finetune"
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == [cron]
    assert _api(stack, "/work_pools/verlflow")["type"] == "process"

    worker_log = tmp_path / "worker.log"
    wlog = open(worker_log, "w")
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "verlflow", "--type", "process"], cwd=ROOT,
                              env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_HEARTBEAT_SECONDS": "10"},
                              stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start, end = occ - dt.timedelta(seconds=1), occ + dt.timedelta(seconds=1)
        t_sched = time.monotonic()
        _api(stack, f"/deployments/{dep['id']}/schedule",
             {"start_time": start.isoformat(), "end_time": end.isoformat(), "min_runs": 0, "max_runs": 5})
        runs = _api(stack, "/flow_runs/filter", {"deployments": {"id": {"any_": [dep["id"]]}},
                                                  "flow_runs": {"expected_start_time": {"before_": end.isoformat(),
                                                                                        "after_": start.isoformat()}}})
        assert len(runs) == 1 and runs[0]["auto_scheduled"], runs
        fr = runs[0]
        deadline, state, seen = time.monotonic() + 240, None, {}
        while True:
            state = _api(stack, f"/flow_runs/{fr['id']}")["state"]
            seen.setdefault(state["type"], time.monotonic() - t_sched)
            if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"flow run still {state['type']} after 240 s; worker log:\n{worker_log.read_text()[-4000:]}")
            if worker.poll() is not None:
                pytest.fail(f"the worker exited ({worker.returncode}):\n{worker_log.read_text()[-4000:]}")
            time.sleep(0.5)
        assert state["type"] == "COMPLETED", (state, worker_log.read_text()[-4000:])
    finally:
        _stop(worker, 20.0)
        wlog.close()

    from prefect.client.schemas.objects import FlowRun

    from verlflow.flows.common import run_id_for

    run_id = run_id_for("pg-nightly", FlowRun.model_validate(_api(stack, f"/flow_runs/{fr['id']}")))
    assert (store / "runs" / run_id / "1" / "export" / "manifest.json").exists(), sorted(store.rglob("*"))[:50]
    assert manifest(bp, run_id, 1, "export") is not None

    # the server really used postgres: the flow run, its deployment and its state history are rows there
    rows = _sql(stack.pg_port, "SELECT f.id, f.state_type, f.name, d.name AS dep FROM flow_run f "
                               "JOIN deployment d ON d.id = f.deployment_id WHERE f.id = $1::uuid", fr["id"])
    assert len(rows) == 1 and rows[0]["state_type"] == "COMPLETED" and rows[0]["dep"] == "pg-nightly", rows
    assert rows[0]["name"] == run_id  # name_flow_run renamed it through the API: that write landed in postgres too
    history = _sql(stack.pg_port, "SELECT type, timestamp FROM flow_run_state WHERE flow_run_id = $1::uuid "
                                  "ORDER BY timestamp", fr["id"])
    types = [h["type"] for h in history]
    assert types[0] == "SCHEDULED" and "RUNNING" in types and types[-1] == "COMPLETED", types
    ts = {}
    for h in history:
        ts.setdefault(h["type"], h["timestamp"])
    secs = lambda a, b: (ts[b] - ts[a]).total_seconds() if a in ts and b in ts else float("nan")
    print(f"\npostgres up {stack.timings['postgres_s']:.1f} s, prefect server on postgres "
          f"{stack.timings['server_start_s']:.1f} s to /health; states {types}; "
          f"scheduled->pending {secs('SCHEDULED', 'PENDING'):.1f} s, pending->running {secs('PENDING', 'RUNNING'):.1f} s, "
          f"running->completed {secs('RUNNING', 'COMPLETED'):.1f} s; "
          f"test saw {', '.join(f'{k} at +{v:.1f} s' for k, v in seen.items())} after the backfill")
