"""The Prefect UI in headless Chromium (Debian's `chromium`; `make test` installs it): a deployment's run form
is the blueprint schema with the blueprint's values, and a finished flow run shows its artifacts and the metrics
table. Screenshots are kept under test-outputs/ (git-ignored)."""

import base64
import json
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prefect_server import EVAL_SOURCES, api, wait_state, write_blueprint
from sysdeps import unavailable
from tinybp import ONE_RANK, tiny_blueprint

pytestmark = pytest.mark.system

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
    with browser(tmp_path, wait_s) as ws:
        return [_visit(ws, url, shot, marker, wait_s) for url, shot, marker in pages]


@contextmanager
def browser(tmp_path: Path, wait_s: float = 60.0):
    """A DevTools websocket to the one page of a headless Chromium."""
    from websockets.sync.client import connect

    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen([CHROMIUM, *FLAGS[:-2], "--window-size=1400,1600", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "about:blank"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with connect(_page_target(profile, wait_s), max_size=2**26) as ws:
            yield ws
    finally:
        proc.kill()
        proc.wait(timeout=30)


def js(ws, expression: str):
    out = _cdp(ws, "Runtime.evaluate", expression=expression, returnByValue=True)
    assert "exceptionDetails" not in out, (expression, out["exceptionDetails"])
    return out["result"].get("value")


def _visit(ws, url: str, shot: str, marker: str | None, wait_s: float) -> tuple[str, list]:
    _cdp(ws, "Page.navigate", url=url)
    deadline, dom, images = time.monotonic() + wait_s, "", []
    ready = (lambda: marker in dom) if marker else (lambda: any(i[0] and i[1] > 0 for i in images))
    while time.monotonic() < deadline and not ready():
        time.sleep(0.3)
        # one evaluation: an image decoded between two reads would leave `dom` without it (CI saw that)
        snapshot = _cdp(ws, "Runtime.evaluate", expression=SNAPSHOT_JS)["result"]
        if "value" in snapshot:  # none while the page navigates
            dom, images = json.loads(snapshot["value"])
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
    for key in ("flow1-metrics", "flow1-progress", "flow1-plot", "rollout[1]", "flow1-eval", "flow1-summary"):
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


# The Run form in Prefect's default UI (the page a person opens from the deployment): each field's label (a
# required one has no "(Optional)"), the page's text and the form's height in pixels.
FORM_JS = """JSON.stringify({
  labels: [...document.querySelectorAll('.schema-form-property__label')].map(l => l.innerText.trim()),
  text: document.body.innerText,
  height: Math.round(document.querySelector('form').getBoundingClientRect().height)})"""


def run_form(ws, url: str, shot: str) -> dict:
    _visit(ws, url, shot, "Nproc Per Node", 90.0)
    return json.loads(js(ws, FORM_JS))


def test_run_form_shows_what_a_person_fills_in(prefect_server, tiny_kit, tmp_path):
    """A local deployment's form has no slurm or kubernetes section and no internal field, marks the inputs a person
    must give as required, describes every flow parameter and shows `<run_id>` in run_id's help; a slurm
    deployment's form has the slurm section. Their field counts and heights go to test-outputs/run-form.json (the
    issue measured 194 fields and ~24,000 px for a local one, every field "(Optional)")."""
    from verlflow.flows.deploy import deploy

    deps = {b: deploy(tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, f"name=ui-form-{b}",
                                     f"resources.backend={b}")) for b in ("local", "slurm")}
    with browser(tmp_path) as ws:
        forms = {b: run_form(ws, f"{prefect_server.ui}/deployments/deployment/{d}/run", f"run-form-{b}.png")
                 for b, d in deps.items()}
    sizes = {b: {"fields": len(f["labels"]), "height_px": f["height"]} for b, f in forms.items()}
    (OUT / "run-form.json").write_text(json.dumps(sizes))
    print(f"\nrun form: {sizes}")
    local, slurm = forms["local"], forms["slurm"]
    labels = set(local["labels"])
    assert {"Blueprint", "Name", "Model", "Path", "Data", "Train Files", "Reward", "Function", "Storage",
            "Uri"} <= labels, sorted(labels)  # required: no "(Optional)"
    assert {"Dtype (Optional)", "Nproc Per Node (Optional)", "run_id (Optional)"} <= labels, sorted(labels)
    for absent in ("Partition", "Namespace", "Image Pull Policy", "Active Phase"):
        assert not [x for x in labels if x.startswith(absent)], absent
    assert "only for backend" not in local["text"].lower() and "leave it unset" not in local["text"]
    for text in ("runs/<run_id>/", "The run to create or resume", "A blueprint YAML to use instead of the form",
                 "Force a restart at this step", "AdamW learning rate of the policy", "Nucleus sampling"):
        assert text in local["text"], text
    assert "Partition (Optional)" in slurm["labels"] and "Namespace (Optional)" not in slurm["labels"]


def submit(ws, server, deployment_id: str, shot: str, fields: dict[str, str], run_name: str | None = None) -> str:
    """Fill the deployment's Run form as a person does (each field found by the start of its help; a set/none field
    set first), type the Run Name, click Submit; returns the id of the flow run it created."""
    def runs() -> set:
        return {r["id"] for r in api(server, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}})}

    before = runs()
    _visit(ws, f"{server.ui}/deployments/deployment/{deployment_id}/run", shot, "Nproc Per Node", 90.0)
    for help_text, value in fields.items():
        field = (f"[...document.querySelectorAll('.schema-form-property')].find(p => p.querySelector("
                 f"'.schema-form-property__description')?.innerText.startsWith({json.dumps(help_text)}))")
        js(ws, f"[...{field}.querySelectorAll('button')].find(b => b.innerText.trim() === 'set')?.click()")
        time.sleep(0.5)  # the set branch's input renders
        _type(ws, f"{field}.querySelector('input, textarea')", value)
    if run_name is not None:
        _type(ws, "document.querySelector('.flow-run-name-input input')", run_name)
    button = "[...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Submit')"
    deadline = time.monotonic() + 60
    while js(ws, f"{button}.disabled"):  # while the form loads
        assert time.monotonic() < deadline, "the Run form's Submit stayed disabled"
        time.sleep(0.3)
    js(ws, f"{button}.click()")
    deadline = time.monotonic() + 120  # the form validates the parameters through the API first
    while not (new := runs() - before):
        errors = "[...document.querySelectorAll('.p-label__message')].map(e => e.innerText).filter(t => t).join('; ')"
        assert time.monotonic() < deadline, f"no flow run 120 s after Submit; the form says: {js(ws, errors)}"
        time.sleep(0.5)
    (run,) = new
    return run


def _type(ws, element: str, value: str) -> None:
    js(ws, f"(() => {{ const e = {element}; e.focus(); e.value = {json.dumps(value)}; "
           "e.dispatchEvent(new Event('input', {bubbles: true})); e.dispatchEvent(new Event('change', {bubbles: true})) })()")


def test_a_typed_run_name_is_kept_and_a_refused_blueprint_fails_once_with_its_error(prefect_server, serve, tiny_kit,
                                                                                  tmp_path):
    """Submitted from a served deployment's Run form: a Run Name typed there stays the flow run's name (a bad
    from_step then fails the run after it is named); a blueprint the model refuses (rollout.n 1 with grpo) fails
    once, before any task, with no traceback: its state message is the one paragraph that names the field and
    says that a Retry, which the UI offers on every failed run, cannot succeed."""
    from prefect.client.orchestration import get_client

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=ui-submit")
    serve(write_blueprint(bp, tmp_path / "ui-submit.yaml"))
    dep = api(prefect_server, "/deployments/name/finetune/ui-submit")["id"]
    with browser(tmp_path) as ws:
        refused = submit(ws, prefect_server, dep, "run-form-refused.png",
                         {"Samples per prompt (the GRPO group size)": "1"})
        named = submit(ws, prefect_server, dep, "run-form-named.png", {"Force a restart at this step": "nonsense"},
                       run_name="typed-by-hand")
        state = wait_state(refused, timeout_s=120)
        page = _visit(ws, f"{prefect_server.ui}/runs/flow-run/{refused}", "flow-run-refused.png",
                      "cannot succeed unchanged", 60.0)[0]
    assert state.is_failed(), state
    assert "blueprint parameter: algorithm.adv_estimator=grpo needs rollout.n >= 2" in state.message, state.message
    assert "cannot succeed unchanged" in state.message and "Traceback" not in state.message, state.message
    assert "cannot succeed unchanged" in page and "Retry" in page  # the UI shows the message beside its Retry
    with get_client(sync_client=True) as client:
        states = [s.name for s in client.read_flow_run_states(refused)]
        assert states.count("Failed") == 1 and not {"AwaitingRetry", "Retrying"} & set(states), states
        assert client.read_flow_run(refused).run_count == 1
    assert api(prefect_server, "/task_runs/filter", {"flow_runs": {"id": {"any_": [refused]}}}) == []
    logs = api(prefect_server, "/logs/filter", {"logs": {"flow_run_id": {"any_": [refused]}}, "limit": 200})
    assert not [x["message"] for x in logs if "Traceback" in x["message"]]

    state = wait_state(named, timeout_s=120)
    assert state.is_failed() and "nonsense" in state.message, state
    run = api(prefect_server, f"/flow_runs/{named}")
    assert run["name"] == "typed-by-hand"
    resources = run["parameters"]["blueprint"]["resources"]  # the sections the form hides ride along unchanged
    assert resources["slurm"] == bp.resources.slurm.model_dump(mode="json") and "kubernetes" in resources


def test_a_reused_stage_shows_as_cached_in_the_task_list(prefect_server, tiny_flow_run):
    """A rerun of a finished run reuses every stage: the flow run's task list shows each as Cached."""
    from verlflow.flows.finetune import finetune

    # No test writes to the shared run's store (those that rerun it work on a copy): every stage is reused.
    state = finetune(blueprint=tiny_flow_run.bp, run_id=tiny_flow_run.run_id, return_state=True)
    assert state.is_completed(), state.message
    fr = str(state.state_details.flow_run_id)
    dom = page(f"{prefect_server.ui}/v2/runs/flow-run/{fr}?tab=TaskRuns", "flow-run-task-runs-cached.png")
    assert "Finished in state" not in dom  # the task list, not the logs
    for name in ("validate[init]", "build[init]", "rollout[1]", "update[1]", "export[1]"):
        assert name in dom, name
    assert dom.count("Cached") >= 5, dom.count("Cached")
