"""The Prefect UI in headless Chromium (Debian's `chromium`; `make test` installs it): a deployment's run form
is the blueprint schema with the blueprint's values, and a finished flow run shows its artifacts and the metrics
table. Screenshots are kept under test-outputs/ (git-ignored)."""

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
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


def test_deployment_run_form_is_the_blueprint(prefect_server, tiny_kit, tmp_path):
    from verlflow.flows.deploy import deploy

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "name=ui-form", "algorithm.adv_estimator=rloo")
    dep_id = deploy(bp, cron="0 5 * * *")
    dom = page(f"{prefect_server.ui}/v2/deployments/deployment/{dep_id}/run", "deployment-run-form.png")
    for field in ("Adv Estimator", "Ppo Mini Batch Size", "Max New Tokens", "Nproc Per Node", "Init From"):
        assert field in dom, field
    assert "verl core_algos advantage estimator" in dom  # the field's description
    assert "ui-form" in dom and "rloo" in dom  # the deployment's blueprint values fill the form


def test_flow_run_artifacts_and_metrics_table(prefect_server, tiny_flow_run):
    fr = str(tiny_flow_run.flow_run_id)
    dom = page(f"{prefect_server.ui}/v2/runs/flow-run/{fr}?tab=Artifacts", "flow-run-artifacts.png")
    for key in ("flow1-metrics", "flow1-progress", "flow1-plot", "rollout[1]"):
        assert key in dom, key
    table = httpx.post(f"{prefect_server.url}/artifacts/filter", timeout=30,
                       json={"artifacts": {"key": {"any_": ["flow1-metrics"]}}}).json()[0]
    dom = page(f"{prefect_server.ui}/v2/artifacts/artifact/{table['id']}", "metrics-table.png")
    for col in ("reward_mean", "reward_std", "kl", "entropy", "clipfrac", "grad_norm", "rollout_tok_s", "update_s"):
        assert f">{col}<" in dom, col
    plot = httpx.post(f"{prefect_server.url}/artifacts/filter", timeout=30,
                      json={"artifacts": {"key": {"any_": ["flow1-plot"]}}}).json()[0]
    dom = page(f"{prefect_server.ui}/v2/artifacts/artifact/{plot['id']}", "reward-kl-plot.png")
    assert 'src="data:image/png;base64,' in dom


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
