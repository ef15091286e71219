"""Run-level Prefect artifacts: a metrics table and a progress bar over iterations, a summary linking the promoted
policy, an eval table (iteration x data source) with sample responses, and a PNG of the training and eval curves
(core/orchestrate/figures.py) written into the artifact store and embedded in a markdown artifact."""

import base64
import re

from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)

from verlflow.core import metrics
from verlflow.core.blueprint import Blueprint
from verlflow.core.orchestrate import figures
from verlflow.core.orchestrate.pipeline import exports_at
from verlflow.core.orchestrate.runner import StageResult, open_store
from verlflow.core.store.artifacts import ArtifactStore, stage_key
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
            "reused": ",".join(n for n, s in (("rollout", rollout), ("update", update), ("checkpoint", checkpoint))
                               if s is not None and s.skipped)}


def _policy_line(store: ArtifactStore, bp: Blueprint, run_id: str, done: int) -> str:
    exported = [i for i in range(1, done + 1) if exports_at(bp, i)]
    if not exported:
        first = next(i for i in range(1, bp.iterations + 1) if exports_at(bp, i))
        return f"- No policy exported yet: the first export is at iteration {first} (storage.export_every)"
    it = exported[-1]
    pointer = store.get_pointer(f"runs/{run_id}/latest") or {}
    # a checkpoint committing in a warm pool's background is promoted when it lands (the run ends after that)
    state = "promoted" if pointer.get("iteration") == it else "promoted when its checkpoint's background commit lands"
    hf = f"{stage_key(run_id, it, 'checkpoint')}/hf"
    return f"- Policy of iteration {it} (HF folder), {state}: {location(store, hf)}"


def link(uri: str) -> str:
    return f"[{uri}]({uri})"


def location(store: ArtifactStore, key: str) -> str:
    """A store location as a link, and for a local store the path to open on this machine."""
    path = store.local_path(key)
    return link(store.uri(key)) + (f" (local path `{path}`)" if path is not None else "")


def run_summary(store: ArtifactStore, bp: Blueprint, run_id: str, rows: list[dict]) -> str:
    """Where the run's promoted policy is (the latest exported iteration's) and how far the run got."""
    return "\n".join([
        f"### {run_id}: {len(rows)} of {bp.iterations} iterations done", "",
        _policy_line(store, bp, run_id, rows[-1]["iteration"]),
        f"- Pointer: {link(store.uri(f'pointers/runs/{run_id}/latest.json'))} (the blueprint's: "
        f"{link(store.uri(f'pointers/blueprints/{bp.name}/latest.json'))})",
        *summary_lines(store, run_id),  # the MLflow run (verlflow.core.tracking)
        f"- Reward mean per iteration: {', '.join(str(r.get('reward_mean')) for r in rows)}"])


class RunReport:
    """Created at the start of a flow run; `step_done` (`iteration_done`) refreshes the table, progress and plot."""

    def __init__(self, bp: Blueprint, run_id: str):
        self.bp, self.run_id, self.key, self.rows = bp, run_id, artifact_key(run_id), []
        self.history: figures.History = {}  # named metrics per iteration done (0: the evaluation before training)
        self._done: dict[str, StageResult] = {}  # the iteration's steps so far, by stage
        self.progress_id = create_progress_artifact(0.0, key=f"{self.key}-progress",
                                                    description=f"{run_id}: iterations done")

    def step_done(self, step, res: StageResult) -> None:
        """After each pipeline step: the iteration's row once its last step (checkpoint, else evaluate, else update)."""
        if step.stage == "rollout":
            self._done = {}
        self._done[step.stage] = res
        if step.stage == _last_stage(step.bp or self.bp, step.iteration):  # a phased run: its rl phase's
            d = self._done
            self.iteration_done(iteration_row(step.iteration, d["rollout"], d["update"], d.get("checkpoint")))

    def iteration_done(self, row: dict) -> None:
        self.rows.append(row)
        create_table_artifact([{c: row.get(c) for c in COLUMNS} for row in self.rows], key=f"{self.key}-metrics",
                              description=f"{self.run_id}: metrics per iteration")
        update_progress_artifact(self.progress_id, 100.0 * len(self.rows) / self.bp.iterations)
        store = open_store(self.bp)
        create_markdown_artifact(run_summary(store, self.bp, self.run_id, self.rows), key=f"{self.key}-summary",
                                 description=f"{self.run_id}: the promoted policy")
        self._read_history(store, row["iteration"])
        self._eval_artifacts(store)
        self._figure_artifacts(store)

    def _read_history(self, store: ArtifactStore, iteration: int) -> None:
        for it in ([0] if len(self.rows) == 1 else []) + [iteration]:  # 0: before training
            if found := metrics.of_iteration(store, self.run_id, it):
                self.history[it] = found

    def _eval_artifacts(self, store: ArtifactStore) -> None:
        rows = figures.eval_rows(self.history)
        if not rows:
            return
        create_table_artifact(rows, key=f"{self.key}-eval",
                              description=f"{self.run_id}: held-out evaluation per iteration and data source")
        last = max(r["iteration"] for r in rows)
        create_markdown_artifact(eval_samples_markdown(self.run_id, last, figures.eval_samples(store, self.run_id, last)),
                                 key=f"{self.key}-eval-samples", description=f"{self.run_id}: eval sample responses")

    def _figure_artifacts(self, store: ArtifactStore) -> None:
        png = figures.png(figures.run_figure(self.history, self.run_id))
        key = f"reports/{self.run_id}/curves.png"
        store.put_bytes(key, png)
        create_link_artifact(store.uri(key), link_text="training and eval curves (PNG)", key=f"{self.key}-curves",
                             description=f"{self.run_id}: reward, KL and eval per iteration, in the artifact store")
        create_markdown_artifact(f"### {self.run_id}: training and evaluation per iteration\n\n"
                                 f"![curves](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
                                 f"Stored at [{store.uri(key)}]({store.uri(key)})", key=f"{self.key}-plot")


def _last_stage(bp: Blueprint, iteration) -> str | None:
    """The step after which an iteration's row is complete: its checkpoint, else its evaluation, else its update."""
    if not isinstance(iteration, int) or iteration < 1:
        return None
    if exports_at(bp, iteration):
        return "checkpoint"
    return "evaluate" if bp.evaluates_at(iteration) else "update"


def eval_samples_markdown(run_id: str, iteration: int, samples: dict[str, list[dict]]) -> str:
    """A few sample responses of the latest evaluation, per data source."""
    lines = [f"### {run_id}: sample responses of the evaluation at iteration {iteration}", ""]
    if not samples:
        lines.append("_No sample responses recorded by this evaluation._")
    for src, shown in sorted(samples.items()):
        lines += [f"#### {src}", ""]
        for s in shown:
            lines += [f"- reward {s.get('reward')}: prompt `{_one_line(s.get('prompt'))}`", "",
                      "  ```", *(f"  {t}" for t in str(s.get("response", "")).splitlines()), "  ```", ""]
    return "\n".join(lines)


def _one_line(text, limit: int = 200) -> str:
    flat = " ".join(str(text or "").split()).replace("`", "'")
    return flat if len(flat) <= limit else flat[:limit] + "..."
