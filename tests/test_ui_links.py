"""What the Prefect UI gives a person to open or copy (tasks/report.py link/location, tasks/stages.py
summary_markdown), and how many cards a run leaves in its Artifacts tab (tasks/report.py RunReport: five, updated in
place). The UI is served over http, where a browser does nothing with a file:// link: a local location is a path to
copy, an S3 one its URI and an https link. A run's report is made by a real flow against the real Prefect server over
the reference run (every stage reused); a page is rendered in headless Chromium."""

import json
import re
import shutil
import subprocess

import pytest
from prefect_server import api
from sysdeps import unavailable

pytestmark = pytest.mark.system

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CARDS = ("progress", "metrics", "summary", "eval", "plot")


def _page(url: str, profile) -> str:
    """The DOM of `url` as headless Chromium renders it (the SPA runs for the virtual-time budget)."""
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        "--virtual-time-budget=20000", "--window-size=1400,1600", "--dump-dom", url],
                       capture_output=True, text=True, timeout=120)
    return r.stdout


def _commit_evals(store, run_id: str) -> None:
    """Evaluations at 0, 1, 2 under the evaluate stage's names (the reference run does not evaluate), with a sample
    response as the stage keeps them (metrics.report)."""
    for it in (0, 1, 2):
        sample = {"prompt": "What is 2+2?", "response": f"answer {it}", "reward": 1.0, "correct": True}
        store.commit(f"runs/{run_id}/{it}/evaluate", {"key": f"fed-eval-{it}", "metrics": {
            "tiny/held/accuracy": 0.1 * it, "tiny/held/reward_mean": 0.1 * it, "tiny/held/samples": 4,
            "accuracy": 0.1 * it, "samples": 4, "report": {"tiny/held": [sample]}}}, {})


def test_a_run_leaves_five_cards_updated_in_place_with_locations_to_copy(prefect_server, reference, tmp_path):
    """Two iterations reported: one artifact per card (a new version per update listed 1 + 6 per iteration), found
    by the run id in the Artifacts page's search, their store locations copyable paths, never file:// links."""
    from prefect import flow

    from verlflow.core.orchestrate.pipeline import run_pipeline
    from verlflow.core.store.artifacts import open_store
    from verlflow.tasks.report import RunReport

    bp, root = reference.copy(tmp_path)
    run_id = reference.run_id
    _commit_evals(open_store(bp.storage), run_id)

    @flow
    def reported() -> list[dict]:
        report = RunReport(bp, run_id)
        run_pipeline(bp, run_id, on_line=lambda line: None, on_step=report.step_done)
        return report.rows

    state = reported(return_state=True)
    assert [r["iteration"] for r in state.result()] == [1, 2]
    fr = str(state.state_details.flow_run_id)
    arts = api(prefect_server, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [fr]}}})
    assert sorted(a["key"] for a in arts) == sorted(f"{run_id}-{c}" for c in CARDS)  # one each, no versions
    card = {a["key"].rsplit("-", 1)[1]: a for a in arts}
    assert card["progress"]["data"] == 100
    assert [row["iteration"] for row in json.loads(card["metrics"]["data"])] == [1, 2]  # the last update's table
    ev = card["eval"]["data"]
    assert "| iteration | data_source | accuracy |" in ev and "| 2 | tiny/held | 0.2 |" in ev and "answer 2" in ev
    assert f"`{root}/reports/{run_id}/curves.png`" in card["plot"]["data"]
    assert f"`{root}/runs/{run_id}/2/export/hf`" in card["summary"]["data"]
    for a in arts:
        assert "file://" not in json.dumps(a["data"]), a["key"]
        assert a["description"].startswith(f"{run_id}: "), a  # the run id as written (a key is lowercased)
    found = api(prefect_server, "/artifacts/latest/filter",  # as the Artifacts page's search asks
                {"artifacts": {"key": {"exists_": True, "like_": run_id}}})
    assert {a["key"] for a in found} >= {a["key"] for a in arts}

    if CHROMIUM is None:
        unavailable("chromium is not installed (`make test` installs it)")
    dom = _page(f"{prefect_server.ui}/v2/artifacts/artifact/{card['summary']['id']}", tmp_path / "chromium")
    assert re.search(rf"<code[^>]*>{re.escape(str(root))}/runs/{run_id}/2/export/hf</code>", dom), dom[-3000:]
    assert 'href="file:' not in dom


@pytest.mark.parametrize("uri, endpoint, region, folder, file", [
    ("/data/store", None, None, "`/data/store/runs/r1/1/rollout`", "`/data/store/runs/r1/1/rollout/manifest.json`"),
    ("s3://bkt/pre", None, "eu-west-1",
     "([open in AWS console](https://s3.console.aws.amazon.com/s3/buckets/bkt?prefix=pre/runs/r1/1/rollout/"
     "&region=eu-west-1))",
     "([open in AWS console](https://s3.console.aws.amazon.com/s3/object/bkt?prefix=pre/runs/r1/1/rollout/"
     "manifest.json&region=eu-west-1))"),
    ("s3://bkt/pre", "http://127.0.0.1:9000", None,  # MinIO, moto: the endpoint's path-style URL
     "([open in http://127.0.0.1:9000](http://127.0.0.1:9000/bkt/pre/runs/r1/1/rollout/))",
     "([open in http://127.0.0.1:9000](http://127.0.0.1:9000/bkt/pre/runs/r1/1/rollout/manifest.json))")])
def test_a_stage_summary_gives_locations_to_copy_or_open(monkeypatch, uri, endpoint, region, folder, file):
    """A stage's card names its folder and manifest: a local path as code, an S3 URI as code with an https link."""
    from verlflow.core.orchestrate.runner import StageResult
    from verlflow.core.store.artifacts import ArtifactStore
    from verlflow.tasks.stages import summary_markdown

    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    store = ArtifactStore(uri, endpoint_url=endpoint, region=region)  # nothing is read: no server needed
    res = StageResult({"stage": "rollout", "run_id": "r1", "iteration": 1, "key": "k1", "metrics": {"samples": 8},
                       "timings": {"stage_s": 1.5}, "committed_at": "2026-12-06T06:00:00", "world_size": 1}, False, 1.5)
    md = summary_markdown("rollout[1]", res, store, "runs/r1/1/rollout")
    assert folder in md and file in md, md
    if uri.startswith("s3://"):
        assert "`s3://bkt/pre/runs/r1/1/rollout`" in md and "`s3://bkt/pre/runs/r1/1/rollout/manifest.json`" in md
    assert "file://" not in md and "](s3://" not in md
