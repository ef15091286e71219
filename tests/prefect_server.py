"""A real local Prefect server for tests (a pytest plugin, listed in tests/conftest.py's `pytest_plugins`).

Fixtures:
  prefect_server  (session) -> PrefectServer(url, ui, home, env): `prefect server start` on 127.0.0.1 with a
                               temporary PREFECT_HOME (SQLite there), telemetry and analytics off; this process
                               and its children talk to it (os.environ and Prefect's settings context).
  tiny_flow_run   (session) -> FinishedRun: the whole tiny pipeline (1 iteration, 1 rank, a warm pool) as a flow run.
  serve           (session) -> start(blueprint_file, **env) -> Served: `verlflow serve` in a subprocess.

Helpers: api(server, path, body), wait_state(flow_run_id, done), manifest(bp, run_id, it, stage),
start_server(home, **settings) (another server, e.g. with the scheduler service on), start_serve(server, ...).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")
VERLFLOW = str(Path(sys.executable).parent / "verlflow")
QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
         "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false", "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
         "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false", "HF_HUB_OFFLINE": "1"}


@dataclass
class PrefectServer:
    url: str  # the API, http://127.0.0.1:PORT/api
    ui: str  # http://127.0.0.1:PORT
    home: Path
    env: dict  # what a subprocess needs to reach this server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_server(home: Path, **server_env: str) -> tuple[subprocess.Popen, PrefectServer]:
    """`prefect server start` on a free port with its SQLite database under `home`; `server_env` adds settings
    (e.g. turns a service back on). Returns once /health answers; stop it with _stop(proc).

    A server that dies during its start-up is started once more, on a new port with a new database, and the first
    death is a warning (pytest's summary shows it): one CI run (session 17) saw a server die ~10 s in, after its
    banner and before /health, without the "Server stopped!" Prefect prints on any exit (so a signal); its cause is
    not known. A second death, or no answer in 60 s, fails."""
    proc, server, died = _start(home, server_env)
    if server is None:
        (home / "server.log").rename(home / "server.first.log")
        for db in home.glob("prefect.db*"):  # it may have died migrating it
            db.unlink()
        proc, server, again = _start(home, server_env)
        if server is None:
            pytest.fail(f"prefect server died twice during its start ({died}; {again}):\n"
                        f"{(home / 'server.log').read_text()[-3000:]}")
        warnings.warn(f"prefect server: started on the second try; the first {died}", stacklevel=2)
    return proc, server


def _start(home: Path, server_env: dict) -> tuple[subprocess.Popen, PrefectServer | None, str]:
    """(the process, the server once /health answers or None if it died, how it died)."""
    port = _free_port()
    ui, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = {**QUIET, "PREFECT_HOME": str(home), "PREFECT_API_URL": url}
    full_env = {**{k: v for k, v in {**os.environ, **env}.items() if k != "PREFECT_API_URL"},
                "PREFECT_UI_API_URL": url, "PREFECT_LOGGING_LEVEL": "WARNING",  # the UI's API: this port
                # services no test needs (cron runs are made through the schedule API): less SQLite contention
                **{f"PREFECT_SERVER_SERVICES_{s}_ENABLED": "false" for s in (
                    "SCHEDULER", "LATE_RUNS", "FOREMAN", "TRIGGERS", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP",
                    "DB_VACUUM")}, **server_env}
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()  # the child has its own copy
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, PrefectServer(url, ui, home, env), ""
        except OSError:
            pass
        if (code := proc.poll()) is not None:
            return proc, None, f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        if time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"prefect server did not answer /health in 60 s:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(0.3)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    proc, server = start_server(tmp_path_factory.mktemp("prefect-home"))
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)  # threads and subprocesses; the settings context below for this thread
    try:
        with temporary_settings({PREFECT_API_URL: server.url, PREFECT_HOME: str(server.home)}), \
                _for_every_thread():
            yield server
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        _stop(proc)


@contextmanager
def _for_every_thread():
    """The settings just applied also for threads that have no settings context of their own (what Prefect's own
    test harness does): a warm pool's output thread logs to the API, and Prefect's log and event services start
    on whichever thread first needs them. Without this they read the settings of import time, start a temporary
    server of their own and send task runs and logs there."""
    from prefect.context import SettingsContext, _temporary_global_settings_context

    with _temporary_global_settings_context(SettingsContext.get()):
        yield


def api(server: PrefectServer, path: str, body=None, method: str | None = None):
    """A call to the server's REST API: GET without a body, POST with one (or `method`); a 503 (SQLite busy) is
    retried as Prefect's client does."""
    import httpx

    method = method or ("GET" if body is None else "POST")
    for attempt in range(6):
        r = httpx.request(method, f"{server.url}{path}", json=body, timeout=30)
        if r.status_code != 503:
            break
        time.sleep(0.5 * 2 ** attempt)
    r.raise_for_status()
    return r.json() if r.content else None


def manifest(bp, run_id: str, iteration, stage: str) -> dict | None:
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import stage_key

    return open_store(bp.storage).read_manifest(stage_key(run_id, iteration, stage))


def wait_state(flow_run_id, done=lambda s: s.is_final(), timeout_s: float = 240.0):
    """Poll the flow run until `done(state)`; returns the state (fails the test on timeout)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and done(state):
                return state
            if time.monotonic() > deadline:
                pytest.fail(f"flow run {flow_run_id} still {state.type if state else None} after {timeout_s:.0f} s")
            time.sleep(0.5)


@dataclass
class FinishedRun:
    bp: object
    run_id: str
    flow_run_id: object
    state: object
    wall_s: float


EVAL_SOURCES = ("openai/gsm8k", "tiny/held")


def eval_files(kit: dict, folder) -> list[str]:
    """The tiny task's held-out split as two eval files, each under its own data_source (one with a slash, as verl's
    names have), 4 prompts each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(kit["test_file"])
    files = []
    for i, src in enumerate(EVAL_SOURCES):
        part = table.slice(4 * i, 4)
        part = part.set_column(part.column_names.index("data_source"), "data_source", pa.array([src] * 4))
        files.append(str(folder / f"eval{i}.parquet"))
        pq.write_table(part, files[-1])
    return files


@pytest.fixture(scope="session")
def tiny_flow_run(prefect_server, tiny_kit, tmp_path_factory) -> FinishedRun:
    from verlflow.flows.finetune import finetune

    from tinybp import ONE_RANK, tiny_blueprint

    # A warm pool, as the demo runs (one job for every stage; fresh jobs are the stage and fault tests' subject).
    evals = eval_files(tiny_kit, tmp_path_factory.mktemp("eval-files"))
    bp = tiny_blueprint(tiny_kit, tmp_path_factory.mktemp("store-inproc"), *ONE_RANK, "name=tiny-flow",
                        "resources.warm_workers=true", f"eval.files={json.dumps(evals)}")
    t0 = time.perf_counter()
    state = finetune(blueprint=bp, run_id="flow1", return_state=True)
    return FinishedRun(bp, "flow1", state.state_details.flow_run_id, state, time.perf_counter() - t0)


@dataclass
class Served:
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        _stop(self.proc, 20.0)


def start_polling(cmd: list[str], log: Path, env: dict, ready: str) -> Served:
    """A long-lived Prefect poller (`verlflow serve`, `prefect worker start`) started in its own session, its
    output in `log`; returns once `ready` is logged."""
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **env})
    out.close()
    served = Served(proc, log)
    deadline = time.monotonic() + 60
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            served.stop()
            pytest.fail(f"{' '.join(cmd[:3])} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return served


def start_serve(server: PrefectServer, blueprint_file, *args: str, log: Path, **env: str) -> Served:
    """`verlflow serve BLUEPRINT ARGS` against `server`, polling every second; returns once it polls."""
    return start_polling([VERLFLOW, "serve", str(blueprint_file), *args], log,
                         {**server.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1", **env}, "polling for scheduled runs")


@pytest.fixture(scope="session")
def serve(prefect_server):
    """start(blueprint_file, *args, **env): `verlflow serve` polling every second; stopped at the end."""
    started = []

    def start(blueprint_file, *args: str, **env: str) -> Served:
        log = Path(blueprint_file).with_suffix(f".serve{len(started)}.log")
        started.append(start_serve(prefect_server, blueprint_file, *args, log=log, **env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def write_blueprint(bp, path: Path) -> Path:
    path.write_text(yaml.safe_dump(bp.model_dump(mode="json"), sort_keys=False))
    return path
