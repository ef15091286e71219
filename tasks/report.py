"""Run-level Prefect artifacts: a metrics table and a progress bar over iterations, a summary linking the promoted
policy, and a PNG of the reward/KL curves written into the artifact store (drawn with PIL, no plotting
dependency)."""

import base64
import io
import re

from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)

from verlflow.core.blueprint import Blueprint
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
        self._done: dict[str, StageResult] = {}  # the iteration's steps so far, by stage
        self.progress_id = create_progress_artifact(0.0, key=f"{self.key}-progress",
                                                    description=f"{run_id}: iterations done")

    def step_done(self, step, res: StageResult) -> None:
        """After each pipeline step: the iteration's row once its last step (its checkpoint, if it exports) is done."""
        if step.stage == "rollout":
            self._done = {}
        self._done[step.stage] = res
        last = "checkpoint" if isinstance(step.iteration, int) and exports_at(self.bp, step.iteration) else "update"
        if step.stage == last:
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
        png = plot_curves(self.rows)
        key = f"reports/{self.run_id}/curves.png"
        store.put_bytes(key, png)
        create_link_artifact(store.uri(key), link_text="reward / KL curves (PNG)", key=f"{self.key}-curves",
                             description=f"{self.run_id}: reward and KL per iteration, in the artifact store")
        create_markdown_artifact(f"### {self.run_id}: reward and KL per iteration\n\n"
                                 f"![curves](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
                                 f"Stored at [{store.uri(key)}]({store.uri(key)})", key=f"{self.key}-plot")


def plot_curves(rows: list[dict], w: int = 640, h: int = 220) -> bytes:
    """Two panels (reward mean with a ±std band, KL) over iterations, as PNG bytes."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, 2 * h), "white")
    d = ImageDraw.Draw(img)
    its = [r["iteration"] for r in rows]
    panels = [("reward mean ± std", "reward_mean", "reward_std", (31, 119, 180)), ("KL", "kl", None, (214, 39, 40))]
    for p, (title, key, band, color) in enumerate(panels):
        top, left, right, bottom = p * h + 24, 60, w - 20, (p + 1) * h - 28
        ys = [r.get(key) or 0.0 for r in rows]
        sd = [r.get(band) or 0.0 for r in rows] if band else [0.0] * len(rows)
        lo, hi = min(y - s for y, s in zip(ys, sd)), max(y + s for y, s in zip(ys, sd))
        hi = hi if hi > lo else lo + 1e-6
        x0, x1 = min(its), max(its) if max(its) > min(its) else min(its) + 1

        def xy(x, y):
            return (left + (right - left) * (x - x0) / (x1 - x0), bottom - (bottom - top) * (y - lo) / (hi - lo))

        d.rectangle([left, top, right, bottom], outline=(160, 160, 160))
        d.text((left, top - 18), title, fill=(0, 0, 0))
        d.text((4, top), f"{hi:.3g}", fill=(90, 90, 90))
        d.text((4, bottom - 10), f"{lo:.3g}", fill=(90, 90, 90))
        for x in its:
            d.text((xy(x, lo)[0] - 3, bottom + 4), str(x), fill=(90, 90, 90))
        if band and len(rows) > 1:
            poly = [xy(x, y + s) for x, y, s in zip(its, ys, sd)] + [xy(x, y - s) for x, y, s in
                                                                      reversed(list(zip(its, ys, sd)))]
            d.polygon(poly, fill=tuple(200 + c // 5 for c in color))
        pts = [xy(x, y) for x, y in zip(its, ys)]
        if len(pts) > 1:
            d.line(pts, fill=color, width=3)
        for x, y in pts:
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
