"""Run-level Prefect artifacts, five per run updated in place (RunReport): a progress bar and a metrics table over
iterations, a summary naming the promoted policy and where it is, an eval card (iteration x data source, with
sample responses), and a PNG of the training and eval curves (core/orchestrate/figures.py) written into the
artifact store and embedded. Store locations are written for the http UI (link/location): copyable paths and
URIs, https links for S3."""

import base64
import os
import re
from pathlib import PurePosixPath
from urllib.parse import quote, urlencode
from uuid import UUID

from prefect import get_client
from prefect.artifacts import Artifact, MarkdownArtifact, ProgressArtifact, TableArtifact
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.context import FlowRunContext

from verlflow.core import metrics
from verlflow.core.blueprint import Blueprint
from verlflow.core.orchestrate import figures
from verlflow.core.orchestrate.pipeline import exports_at
from verlflow.core.orchestrate.runner import StageResult
from verlflow.core.store.artifacts import open_store
from verlflow.core.store.artifacts import ArtifactStore, carries_credentials, stage_key
from verlflow.core.store.promote import PromotePolicy, export_of, promotion_status
from verlflow.core.tracking import summary_lines

COLUMNS = ("iteration", "reward_mean", "reward_std", "kl", "entropy", "clipfrac", "grad_norm", "rollout_tok_s",
           "update_tok_s", "rollout_s", "update_s", "checkpoint_s", "reused")


def artifact_key(run_id: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")


def _job_s(res: StageResult) -> float:
    t = res.manifest.get("timings", {})
    return round(t.get("stage_s", 0.0) + t.get("launch_to_worker_s", 0.0), 2)


def iteration_row(it: int, rollout: StageResult, update: StageResult, checkpoint: StageResult | None) -> dict:
    """One iteration's metrics; `checkpoint` None: the iteration exports nothing (storage.export_every)."""
    r, u = rollout.manifest["metrics"], update.manifest["metrics"]
    return {"iteration": it, "reward_mean": r.get("reward_mean"), "reward_std": r.get("reward_std"),
            "kl": u.get("kl_loss", u.get("ppo_kl")), "entropy": u.get("entropy"), "clipfrac": u.get("pg_clipfrac"),
            "grad_norm": u.get("grad_norm"), "rollout_tok_s": r.get("tokens_per_s"),
            "update_tok_s": u.get("tokens_per_s"), "rollout_s": _job_s(rollout), "update_s": _job_s(update),
            "checkpoint_s": _job_s(checkpoint) if checkpoint is not None else None,
            "reused": ",".join(n for n, s in (("rollout", rollout), ("update", update), ("export", checkpoint))
                               if s is not None and s.skipped)}


def _policy_line(store: ArtifactStore, bp: Blueprint, run_id: str, done: int) -> str:
    """What the run's latest pointer names now; an export still committing in a warm pool's background is the
    gate's to decide when it lands (RunReport.finished says the outcome once every commit has landed)."""
    exported = [i for i in range(1, done + 1) if exports_at(bp, i)]
    if not exported:
        first = next(i for i in range(1, bp.iterations + 1) if exports_at(bp, i))
        return f"- No policy exported yet: the first export is at iteration {first} (storage.export_every)"
    line = f"- {promotion_status(store, PromotePolicy.of(bp), run_id)}"
    if pointer := store.get_pointer(f"runs/{run_id}/latest"):
        line += f"; HF folder: {location(store, export_of(pointer) + '/hf')}"
    if store.read_manifest(stage_key(run_id, exported[-1], "export")) is None:
        line += (f". The export of iteration {exported[-1]} is still committing in the background: the promotion "
                 "gate decides on it when its commit lands")
    return line


AWS_CONSOLE = "https://s3.console.aws.amazon.com/s3"


def link(uri: str, endpoint_url: str | None = None, region: str | None = None) -> str:
    """A URI as a person can use it from the Prefect UI (served over http, where a browser ignores a file:// link):
    a local path as copyable text; an s3:// URI as text and a link that opens it over https (the AWS console, or
    for a custom endpoint such as MinIO, the endpoint's path-style URL); an http(s) URI as a link. A folder is a key
    whose last segment has no suffix (stage folders, hf/), a file one with (manifest.json, latest.json, curves.png)."""
    scheme, _, path = uri.partition("://")
    if scheme == "file":
        return _code(path)
    if scheme != "s3":
        return f"[{uri}]({uri})"
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and carries_credentials(endpoint):  # never into an artifact
        return _code(uri)
    bucket, _, key = path.partition("/")
    folder = not PurePosixPath(key).suffix
    if endpoint:
        where, name = f"{endpoint.rstrip('/')}/{bucket}/{quote(key)}{'/' if folder and key else ''}", endpoint
    else:
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        query = {"prefix": f"{key}/" if folder and key else key, **({"region": region} if region else {})}
        view = "buckets" if folder else "object"
        where, name = f"{AWS_CONSOLE}/{view}/{bucket}?{urlencode(query, safe='/', quote_via=quote)}", "AWS console"
    return f"{_code(uri)} ([open in {name}]({where}))"


def location(store: ArtifactStore, key: str) -> str:
    """A store location (link): the path on this machine for a local store, the URI and its https form for S3."""
    fs = store.fs  # s3fs keeps the store's endpoint_url and region (client_kwargs)
    return link(store.uri(key), getattr(fs, "endpoint_url", None),
                getattr(fs, "client_kwargs", {}).get("region_name"))


def _code(text: str) -> str:
    """A markdown code span (copyable text), also around a backtick."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def run_summary(store: ArtifactStore, bp: Blueprint, run_id: str, rows: list[dict]) -> str:
    """Which policy the run's pointer names (or why none) and where it is, and how far the run got."""
    blueprint = store.get_pointer(f"blueprints/{bp.name}/latest")
    names = f"run {blueprint['run_id']} iteration {blueprint['iteration']}" if blueprint else "no policy"
    return "\n".join([
        f"### {run_id}: {len(rows)} of {bp.iterations} iterations done", "",
        _policy_line(store, bp, run_id, rows[-1]["iteration"]),
        f"- Pointer: {location(store, f'pointers/runs/{run_id}/latest.json')} (the blueprint's, naming {names}: "
        f"{location(store, f'pointers/blueprints/{bp.name}/latest.json')})",
        *summary_lines(store, run_id),  # the MLflow run (verlflow.core.tracking)
        f"- Reward mean per iteration: {', '.join(str(r.get('reward_mean')) for r in rows)}"])


class RunReport:
    """Created at the start of a flow run; `step_done` (`iteration_done`) refreshes the run's five cards: progress,
    metrics (table), summary, eval and plot (markdown), keyed `<artifact_key(run_id)>-<card>`, each created once
    and then updated in place. A new version per update would list one card per iteration and card in the flow
    run's Artifacts tab (the Artifacts page shows a key's latest only). Each description starts with the run id as
    written: a key cannot hold '.' or capitals, and the UI's search matches keys case-insensitively. A UI Retry (the
    same flow run again) updates the cards its earlier attempt made."""

    def __init__(self, bp: Blueprint, run_id: str):
        self.bp, self.run_id, self.key, self.rows = bp, run_id, artifact_key(run_id), []
        self.history: figures.History = {}  # named metrics per iteration done (0: the evaluation before training)
        self._done: dict[str, StageResult] = {}  # the iteration's steps so far, by stage
        self._ids: dict[str, UUID] = {}  # card -> the artifact it updates
        self._publish("progress", "iterations done", ProgressArtifact(progress=0.0))

    def step_done(self, step, res: StageResult) -> None:
        """After each pipeline step: the iteration's row once its last step (checkpoint, else evaluate, else update)."""
        if step.stage == "rollout":
            self._done = {}
        self._done[step.stage] = res
        if step.stage == _last_stage(step.bp or self.bp, step.iteration):  # a phased run: its rl phase's
            d = self._done
            self.iteration_done(iteration_row(step.iteration, d["rollout"], d["update"], d.get("export")))

    def iteration_done(self, row: dict) -> None:
        self.rows.append(row)
        self._publish("metrics", "metrics per iteration",
                      TableArtifact(table=[{c: row.get(c) for c in COLUMNS} for row in self.rows]))
        self._publish("progress", "iterations done",
                      ProgressArtifact(progress=100.0 * len(self.rows) / self.bp.iterations))
        store = open_store(self.bp.storage)
        self._summary(store)
        self._read_history(store, row["iteration"])
        self._eval_artifacts(store)
        self._figure_artifacts(store)

    def finished(self) -> None:
        """After the pipeline returned (every background commit landed, the gate decided on it): the summary again,
        with what the pointers name now."""
        if self.rows:
            self._summary(open_store(self.bp.storage))

    def _summary(self, store: ArtifactStore) -> None:
        self._publish("summary", "the promoted policy",
                      MarkdownArtifact(markdown=run_summary(store, self.bp, self.run_id, self.rows)))

    def _publish(self, card: str, what: str, artifact: Artifact) -> None:
        """The run's `card`: created the first time, then its data replaced (the Artifacts page's collection too).
        `_sync`: as prefect.artifacts' own create_* and update_progress_artifact call these."""
        key = f"{self.key}-{card}"
        if card not in self._ids and (earlier := _flow_run_artifact(key)) is not None:
            self._ids[card] = earlier
        if card in self._ids:
            get_client(sync_client=True).update_artifact(self._ids[card],
                                                         ArtifactUpdate(data=artifact.format(_sync=True)))
            return
        artifact.key, artifact.description = key, f"{self.run_id}: {what}"
        self._ids[card] = artifact.create(_sync=True).id

    def _read_history(self, store: ArtifactStore, iteration: int) -> None:
        for it in ([0] if len(self.rows) == 1 else []) + [iteration]:  # 0: before training
            if found := metrics.of_iteration(store, self.run_id, it):
                self.history[it] = found

    def _eval_artifacts(self, store: ArtifactStore) -> None:
        rows = figures.eval_rows(self.history)
        if not rows:
            return
        last = max(r["iteration"] for r in rows)
        md = eval_markdown(self.run_id, rows, last, figures.eval_samples(store, self.run_id, last))
        self._publish("eval", "held-out evaluation per iteration and data source, sample responses",
                      MarkdownArtifact(markdown=md))

    def _figure_artifacts(self, store: ArtifactStore) -> None:
        # a phased run's curves are over its named steps (the base and tuned evaluations, sft's and dpo's epochs)
        labels = figures.step_labels(store, self.run_id) if self.bp.phases else {}
        hist = figures.history(store, self.run_id) if labels else self.history
        png = figures.png(figures.run_figure(hist, self.run_id, labels))
        key = f"reports/{self.run_id}/curves.png"
        store.put_bytes(key, png)
        self._publish("plot", "reward, KL and eval per iteration", MarkdownArtifact(markdown=(
            f"### {self.run_id}: training and evaluation per iteration\n\n"
            f"![curves](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
            f"The PNG in the artifact store: {location(store, key)}")))


def _flow_run_artifact(key: str) -> UUID | None:
    """This flow run's artifact `key` from an earlier attempt of it, if any."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    found = get_client(sync_client=True).read_artifacts(artifact_filter=ArtifactFilter(
        key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[ctx.flow_run.id])), limit=1)
    return found[0].id if found else None


def _last_stage(bp: Blueprint, iteration) -> str | None:
    """The step after which an iteration's row is complete: its checkpoint, else its evaluation, else its update."""
    if not isinstance(iteration, int) or iteration < 1:
        return None
    if exports_at(bp, iteration):
        return "export"
    return "evaluate" if bp.evaluates_at(iteration) else "update"


def eval_markdown(run_id: str, rows: list[dict], iteration: int, samples: dict[str, list[dict]]) -> str:
    """The eval card: a row per evaluated iteration and data source (figures.eval_rows), then a few sample
    responses of the latest evaluation per data source."""
    cols = list(rows[0])
    lines = [f"### {run_id}: held-out evaluation per iteration and data source", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
             *("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows), "",
             f"### Sample responses of the evaluation at iteration {iteration}", ""]
    if not samples:
        lines.append("_No sample responses recorded by this evaluation._")
    for src, shown in sorted(samples.items()):
        lines += [f"#### {src}", ""]
        for s in shown:
            lines += [f"- reward {s.get('reward')}: prompt `{_one_line(s.get('prompt'))}`", "",
                      "  ```", *(f"  {t}" for t in str(s.get("response", "")).splitlines()), "  ```", ""]
    return "\n".join(lines)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v).replace("|", "\\|")


def _one_line(text, limit: int = 200) -> str:
    flat = " ".join(str(text or "").split()).replace("`", "'")
    return flat if len(flat) <= limit else flat[:limit] + "..."
