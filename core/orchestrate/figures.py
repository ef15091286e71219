"""The figures and tables people read: a run's training and evaluation curves (the run report's PNG) and runs side
by side (`verlflow compare`). Every number is read through core/metrics.py's names from the stages' manifests;
drawn on the driver with matplotlib's Figure API, which renders a PNG with the Agg canvas (no display, and no
pyplot: the process's backend stays whatever it is)."""

from __future__ import annotations

import io
from dataclasses import dataclass

from matplotlib.figure import Figure

from verlflow.core import metrics
from verlflow.core.store.artifacts import ArtifactStore

History = dict[int, dict[str, float]]  # iteration -> named metrics (core/metrics.py)
EVAL_COLUMNS = ("accuracy", "reward_mean", "response_len_mean", "samples")  # then each pass@k
PANEL_INCHES, DPI = (5.0, 3.2), 110


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    lines: dict[str, str]  # legend label -> metric name
    band: str | None = None  # ±std around the one line


def run_iterations(store: ArtifactStore, run_id: str) -> list[int]:
    """The run's iterations with a stage folder in the store (0: the initial evaluation), ascending."""
    its = {int(p.split("/")[2]) for p in store.ls(f"runs/{run_id}") if p.count("/") >= 3 and p.split("/")[2].isdigit()}
    return sorted(its)


def history(store: ArtifactStore, run_id: str, iterations=None) -> History:
    """Named metrics per iteration (those with any), from the committed manifests."""
    its = run_iterations(store, run_id) if iterations is None else iterations
    out = {it: metrics.of_iteration(store, run_id, it) for it in its}
    return {it: m for it, m in out.items() if m}


def eval_sources(hist: History) -> list[str]:
    """The data sources the evaluations reported on their own (`eval/<source>/<metric>`)."""
    return sorted({name[len("eval/"):].rsplit("/", 1)[0] for m in hist.values() for name in m
                   if name.startswith("eval/") and name.count("/") >= 2})


def _pass_columns(hist: History) -> list[str]:
    found = {name.rsplit("/", 1)[1] for m in hist.values() for name in m if name.rsplit("/", 1)[1].startswith("pass@")}
    return sorted(found, key=lambda c: int(c.split("@")[1]))


def eval_rows(hist: History) -> list[dict]:
    """The eval table: one row per evaluated iteration and data source."""
    cols = [*EVAL_COLUMNS[:2], *_pass_columns(hist), *EVAL_COLUMNS[2:]]
    rows = []
    for it, m in sorted(hist.items()):
        for src in eval_sources(hist):
            if f"eval/{src}/accuracy" in m or f"eval/{src}/reward_mean" in m:
                rows.append({"iteration": it, "data_source": src, **{c: m.get(f"eval/{src}/{c}") for c in cols}})
    return rows


def _kl_name(hist: History) -> str:
    names = {n for m in hist.values() for n in m}
    return "update/kl_loss" if "update/kl_loss" in names else "update/ppo_kl"


def run_panels(hist: History) -> list[Panel]:
    """The panels of a run's figure that have data: training curves, then eval per data source."""
    sources = eval_sources(hist)
    panels = [Panel("Reward mean ± std (rollout)", "reward", {"reward mean": "rollout/reward_mean"},
                    band="rollout/reward_std"),
              Panel("KL to the reference", "KL", {"KL": _kl_name(hist)}),
              Panel("Policy entropy", "entropy (nats)", {"entropy": "update/entropy"}),
              Panel("Gradient norm", "grad norm", {"grad norm": "update/grad_norm"}),
              Panel("Response length (rollout)", "tokens", {"mean length": "rollout/response_len_mean"}),
              # algorithm.rollout_correction: how far the sampling policy (fp8, other kernels) is from the trained one
              Panel("Rollout vs trained policy", "KL (k3)", {"k3 KL": "update/rollout_corr/k3_kl"}),
              Panel("Eval accuracy per data source", "accuracy", {s: f"eval/{s}/accuracy" for s in sources}),
              Panel("Eval reward mean per data source", "reward", {s: f"eval/{s}/reward_mean" for s in sources})]
    names = {n for m in hist.values() for n in m}
    return [p for p in panels if any(n in names for n in p.lines.values())]


def _series(hist: History, name: str) -> tuple[list[int], list[float]]:
    pts = [(it, m[name]) for it, m in sorted(hist.items()) if name in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw(ax, panel: Panel, hist: History, its: list[int]) -> None:
    for label, name in panel.lines.items():
        xs, ys = _series(hist, name)
        if not xs:
            continue
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        if panel.band:
            bx, sd = _series(hist, panel.band)
            lo = [ys[xs.index(x)] - s for x, s in zip(bx, sd) if x in xs]
            hi = [ys[xs.index(x)] + s for x, s in zip(bx, sd) if x in xs]
            ax.fill_between([x for x in bx if x in xs], lo, hi, color=line.get_color(), alpha=0.2, label="± std")
    _axes(ax, panel.title, panel.ylabel, its)


def _axes(ax, title: str, ylabel: str, its: list[int]) -> None:
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_xticks(its)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _grid(n: int, title: str) -> tuple[Figure, list]:
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), dpi=DPI, layout="constrained")
    fig.suptitle(title)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def run_figure(hist: History, run_id: str) -> Figure:
    """One panel per metric over the run's iterations (iteration 0: the evaluation before training)."""
    panels = run_panels(hist)
    fig, axes = _grid(max(len(panels), 1), f"{run_id}: training and evaluation per iteration")
    its = sorted(hist)
    for ax, panel in zip(axes, panels):
        _draw(ax, panel, hist, its)
    return fig


def available(hists: dict[str, History]) -> list[str]:
    return sorted({n for h in hists.values() for m in h.values() for n in m})


def compare_figure(hists: dict[str, History], names: list[str]) -> Figure:
    """One panel per metric, one line per run."""
    fig, axes = _grid(len(names), f"{' vs '.join(hists)}")
    its = sorted({it for h in hists.values() for it, m in h.items() if any(n in m for n in names)})
    for ax, name in zip(axes, names):
        for run_id, hist in hists.items():
            xs, ys = _series(hist, name)
            if xs:
                ax.plot(xs, ys, marker="o", label=run_id)
        _axes(ax, name, name.rsplit("/", 1)[1], its)
    return fig


def compare_rows(hists: dict[str, History], names: list[str]) -> list[dict]:
    """Rows = iteration, columns = `run:metric`."""
    its = sorted({it for h in hists.values() for it in h})
    return [{"iteration": it, **{f"{r}:{n}": h.get(it, {}).get(n) for r, h in hists.items() for n in names}}
            for it in its]


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def eval_samples(store: ArtifactStore, run_id: str, iteration: int) -> dict[str, list[dict]]:
    """The sample responses an evaluation kept (eval.samples_shown per data source): its manifest's
    metrics.report, {source: [{"prompt", "response", "ground_truth", "reward", "correct", ...}]}; none: {}."""
    from verlflow.core.store.artifacts import stage_key

    manifest = store.read_manifest(stage_key(run_id, iteration, "evaluate")) or {}
    samples = manifest.get("metrics", {}).get("report")
    return samples if isinstance(samples, dict) else {}


DEFAULT_COMPARED = ("rollout/reward_mean", "update/kl_loss", "eval/accuracy")


@dataclass(frozen=True)
class Comparison:
    names: list[str]
    rows: list[dict]
    figure: Figure

    def table(self) -> str:
        """The rows as fixed-width text: iteration, then one column per run and metric."""
        cols = list(self.rows[0]) if self.rows else ["iteration"]
        width = [max(len(c), 10) for c in cols]
        cell = lambda v: "-" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))  # noqa: E731
        lines = ["  ".join(c.rjust(w) for c, w in zip(cols, width))]
        lines += ["  ".join(cell(r[c]).rjust(w) for c, w in zip(cols, width)) for r in self.rows]
        return "\n".join(lines)


def compare_runs(store: ArtifactStore, runs: list[str], names: list[str] | None = None) -> Comparison:
    """Runs side by side; an unknown run or metric is refused with what the store holds."""
    from verlflow.core.errors import VerlflowError

    known = sorted({p.split("/")[1] for p in store.ls("runs") if p.count("/") > 1})
    if missing := [r for r in runs if r not in known]:
        raise VerlflowError(f"run(s) {', '.join(missing)}: not in {store.root_uri}; its runs: "
                            f"{', '.join(known) or '(none)'}")
    hists = {r: history(store, r) for r in runs}
    have = available(hists)
    names = list(names or [n for n in DEFAULT_COMPARED if n in have] or have[:3])
    if unknown := [n for n in names if n not in have]:
        raise VerlflowError(f"--metrics: unknown metric(s) {', '.join(unknown)}; the runs record: {', '.join(have)}")
    return Comparison(names, compare_rows(hists, names), compare_figure(hists, names))
