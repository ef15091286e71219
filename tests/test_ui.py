"""The Prefect UI in headless Chromium (Debian's `chromium`; `make test` installs it): a deployment's run form
is the blueprint schema with the blueprint's values, and a finished flow run shows its artifacts and the metrics
table. Screenshots are kept under test-outputs/ (git-ignored)."""

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prefect_server import EVAL_SOURCES
from sysdeps import unavailable
from tinybp import ONE_RANK, tiny_blueprint

OUT = Path(__file__).resolve().parents[1] / "test-outputs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--virtual-time-budget=20000", "--window-size=1400,1600"]



@pytest.fixture(autouse=True)
def _chromium():
    if CHROMIUM is None:
        unavailable("chromium is not installed (`make test` installs it)")


def page(url: str, shot: str) -> str:
    """The rendered DOM of `url` (the SPA runs for the virtual-time budget); a screenshot goes to test-outputs/."""
    OUT.mkdir(exist_ok=True)
    r = subprocess.run([CHROMIUM, *FLAGS, f"--screenshot={OUT / shot}", "--dump-dom", url],
                       capture_output=True, text=True, timeout=90)
    assert (OUT / shot).is_file(), r.stderr[-2000:]
    return r.stdout


SNAPSHOT_JS = ("JSON.stringify([document.documentElement.outerHTML, Array.from(document.images)"
               ".filter(i => i.src.startsWith('data:image/png')).map(i => [i.complete, i.naturalWidth, i.naturalHeight])])")


def rendered(pages: list[tuple[str, str, str | None]], tmp_path: Path, wait_s: float = 60.0) -> list[tuple]:
    """For each (url, screenshot, marker) in one Chromium through the DevTools protocol: (DOM, [(complete,
    naturalWidth, naturalHeight)] of its PNG data images) once the DOM holds `marker` (None: once an image decoded,
    which --dump-dom cannot tell); screenshots to test-outputs/."""
    from websockets.sync.client import connect

    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen([CHROMIUM, *FLAGS[:-2], "--window-size=1400,1600", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "about:blank"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with connect(_page_target(profile, wait_s), max_size=2**26) as ws:
            return [_visit(ws, url, shot, marker, wait_s) for url, shot, marker in pages]
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _visit(ws, url: str, shot: str, marker: str | None, wait_s: float) -> tuple[str, list]:
    _cdp(ws, "Page.navigate", url=url)
    deadline, dom, images = time.monotonic() + wait_s, "", []
    ready = (lambda: marker in dom) if marker else (lambda: any(i[0] and i[1] > 0 for i in images))
    while time.monotonic() < deadline and not ready():
        time.sleep(0.3)
        # one evaluation: an image decoded between two reads would leave `dom` without it (CI saw that)
        dom, images = json.loads(_cdp(ws, "Runtime.evaluate", expression=SNAPSHOT_JS)["result"]["value"])
    OUT.mkdir(exist_ok=True)
    (OUT / shot).write_bytes(base64.b64decode(_cdp(ws, "Page.captureScreenshot")["data"]))
    return dom, images


def _page_target(profile: Path, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        port_file = profile / "DevToolsActivePort"
        if port_file.is_file() and port_file.read_text().strip():
            port = port_file.read_text().split()[0]
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                     if t["type"] == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.2)
    pytest.fail(f"Chromium opened no DevTools page within {wait_s:.0f} s")


def _cdp(ws, method: str, **params) -> dict:
    ws.send(json.dumps({"id": 1, "method": method, "params": params}))
    while True:
        msg = json.loads(ws.recv())
        if msg.get("id") == 1:
            assert "error" not in msg, msg
            return msg["result"]


def test_deployment_run_form_is_the_blueprint(prefect_server, tiny_kit, tmp_path):
    from verlflow.flows.deploy import deploy

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=ui-form", "algorithm.adv_estimator=rloo")
    dep_id = deploy(bp, cron="0 5 * * *")
    dom = page(f"{prefect_server.ui}/v2/deployments/deployment/{dep_id}/run", "deployment-run-form.png")
    for field in ("Adv Estimator", "Ppo Mini Batch Size", "Max New Tokens", "Nproc Per Node", "Init From"):
        assert field in dom, field
    assert "verl core_algos advantage estimator" in dom  # the field's description
    assert "ui-form" in dom and "rloo" in dom  # the deployment's blueprint values fill the form


def test_flow_run_artifacts_metrics_and_eval_tables_and_figure(prefect_server, tiny_flow_run, tmp_path):
    from verlflow.core.orchestrate import figures

    fr = str(tiny_flow_run.flow_run_id)
    dom = page(f"{prefect_server.ui}/v2/runs/flow-run/{fr}?tab=Artifacts", "flow-run-artifacts.png")
    for key in ("flow1-metrics", "flow1-progress", "flow1-plot", "rollout[1]", "flow1-eval", "flow1-eval-samples"):
        assert key in dom, key
    table = httpx.post(f"{prefect_server.url}/artifacts/filter", timeout=30,
                       json={"artifacts": {"key": {"any_": ["flow1-metrics"]}}}).json()[0]
    dom = page(f"{prefect_server.ui}/v2/artifacts/artifact/{table['id']}", "metrics-table.png")
    for col in ("reward_mean", "reward_std", "kl", "entropy", "clipfrac", "grad_norm", "rollout_tok_s", "update_s"):
        assert f">{col}<" in dom, col
    evals = httpx.post(f"{prefect_server.url}/artifacts/filter", timeout=30,
                       json={"artifacts": {"key": {"any_": ["flow1-eval"]}}}).json()[0]
    plot = httpx.post(f"{prefect_server.url}/artifacts/filter", timeout=30,
                      json={"artifacts": {"key": {"any_": ["flow1-plot"]}}}).json()[0]
    (dom, _), (plot_dom, images) = rendered([
        (f"{prefect_server.ui}/v2/artifacts/artifact/{evals['id']}", "eval-table.png", ">response_len_mean<"),
        (f"{prefect_server.ui}/v2/artifacts/artifact/{plot['id']}", "curves-plot.png", None)], tmp_path)
    for col in ("iteration", "data_source", "accuracy", "reward_mean", "pass@1", "response_len_mean"):
        assert f">{col}<" in dom, col
    for src in EVAL_SOURCES:  # a row per data source
        assert f">{src}<" in dom, src
    assert 'src="data:image/png;base64,' in plot_dom
    width = round(figures.PANEL_INCHES[0] * 2 * figures.DPI)  # two panels a row: the matplotlib figure's pixels
    assert any(done and w == width and h > 0 for done, w, h in images), images  # Chromium decoded it


def test_run_form_describes_every_flow_parameter_and_the_backend_sections(prefect_server, tiny_kit, tmp_path):
    from verlflow.flows.deploy import deploy

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=ui-form-help")
    dep_id = deploy(bp)
    dom = page(f"{prefect_server.ui}/v2/deployments/deployment/{dep_id}/run", "deployment-run-form-help.png")
    for text in ("The run to create or resume", "A blueprint YAML to use instead of the form",
                 "Force a restart at this step", "Only for backend: slurm", "Only for backend: kubernetes",
                 "AdamW learning rate of the policy", "Nucleus sampling"):
        assert text in dom, text


def test_a_reused_stage_shows_as_cached_in_the_task_list(prefect_server, tiny_flow_run):
    """A rerun of a finished run reuses every stage: the flow run's task list shows each as Cached."""
    from verlflow.flows.finetune import finetune

    # No test writes to the shared run's store (those that rerun it work on a copy): every stage is reused.
    state = finetune(blueprint=tiny_flow_run.bp, run_id=tiny_flow_run.run_id, return_state=True)
    assert state.is_completed(), state.message
    fr = str(state.state_details.flow_run_id)
    dom = page(f"{prefect_server.ui}/v2/runs/flow-run/{fr}?tab=TaskRuns", "flow-run-task-runs-cached.png")
    assert "Finished in state" not in dom  # the task list, not the logs
    for name in ("validate[init]", "build[init]", "rollout[1]", "update[1]", "checkpoint[1]"):
        assert name in dom, name
    assert dom.count("Cached") >= 5, dom.count("Cached")
