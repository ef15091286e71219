"""The figures and tables people read: a run's training and evaluation curves (the run report's PNG) and runs side
by side (`verlflow compare`: a rich table as wide as the terminal, a recurring chain's runs end to end). Every
number is read through core/metrics.py's names from the stages' manifests; drawn on the driver with matplotlib's
Figure API, which renders a PNG with the Agg canvas (no display, and no pyplot: the process's backend stays
whatever it is)."""

from __future__ import annotations

import io
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from verlflow.core import metrics
from verlflow.core.store.artifacts import ArtifactStore

History = dict[int, dict[str, float]]  # iteration -> named metrics (core/metrics.py)
EVAL_COLUMNS = ("accuracy", "reward_mean", "response_len_mean", "samples")  # then each pass@k
PANEL_INCHES, DPI = (5.0, 3.2), 110
MAX_TICKS = 12


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


def phase_steps(store: ArtifactStore, run_id: str) -> dict[str, int]:
    """A phased run's step numbers by iteration (evaluate[base] -> 0, ..., core/metrics.step_numbers of its recorded
    plan: the numbers its trackers logged at); {} for a run without named steps."""
    from verlflow.core.orchestrate.pipeline import recorded_plan

    recorded = recorded_plan(store, run_id)
    numbers = metrics.step_numbers((stage, it) for stage, it in recorded["steps"]) if recorded else {}
    return numbers if any(not it.isdigit() for it in numbers) else {}


def history(store: ArtifactStore, run_id: str, iterations=None) -> History:
    """Named metrics per iteration (those with any), from the committed manifests; a phased run's per step number
    (phase_steps)."""
    numbers = phase_steps(store, run_id) if iterations is None else {}
    if numbers:
        out = {n: metrics.of_iteration(store, run_id, it) for it, n in numbers.items()}
    else:
        its = run_iterations(store, run_id) if iterations is None else iterations
        out = {it: metrics.of_iteration(store, run_id, it) for it in its}
    return {it: m for it, m in out.items() if m}


def step_labels(store: ArtifactStore, run_id: str) -> dict[int, str]:
    """A phased run's step number -> its iteration's name (base, sft.1, 1); {} for a run without named steps."""
    return {n: it for it, n in phase_steps(store, run_id).items()}


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
              # a phased run's supervised phases, one point per epoch
              Panel("SFT / DPO loss (phases)", "loss", {"sft loss": "sft/sft_loss", "dpo loss": "dpo/dpo_loss"}),
              Panel("Eval accuracy per data source", "accuracy", {s: f"eval/{s}/accuracy" for s in sources}),
              Panel("Eval reward mean per data source", "reward", {s: f"eval/{s}/reward_mean" for s in sources})]
    names = {n for m in hist.values() for n in m}
    return [p for p in panels if any(n in names for n in p.lines.values())]


def _series(hist: History, name: str) -> tuple[list[int], list[float]]:
    pts = [(it, m[name]) for it, m in sorted(hist.items()) if name in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw(ax, panel: Panel, hist: History, its: list[int], labels: dict[int, str]) -> None:
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
    _axes(ax, panel.title, panel.ylabel, its, xlabel="step" if labels else "iteration", labels=labels)


def _axes(ax, title: str, ylabel: str, its: list[int], legend: bool = True, xlabel: str = "iteration",
          labels: dict[int, str] | None = None) -> None:
    """`labels`: a phased run's step names under its step numbers (evaluate[base] at 0: `base`)."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if labels and len(its) <= MAX_TICKS:
        ax.set_xticks(its, [labels.get(i, str(i)) for i in its], rotation=30, fontsize="small")
    elif len(its) <= MAX_TICKS:
        ax.set_xticks(its)
    else:  # a long run or chain: a tick per iteration would overlap
        ax.xaxis.set_major_locator(MaxNLocator(nbins=MAX_TICKS, integer=True))
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="small")


def _grid(n: int, title: str) -> tuple[Figure, list]:
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), dpi=DPI, layout="constrained")
    fig.suptitle(title)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def run_figure(hist: History, run_id: str, labels: dict[int, str] | None = None) -> Figure:
    """One panel per metric over the run's iterations (iteration 0: the evaluation before training); a phased run's
    over its steps, named by `labels` (step_labels)."""
    panels = run_panels(hist)
    fig, axes = _grid(max(len(panels), 1), f"{run_id}: training and evaluation per {'step' if labels else 'iteration'}")
    its = sorted(hist)
    for ax, panel in zip(axes, panels):
        _draw(ax, panel, hist, its, labels or {})
    return fig


def available(hists: dict[str, History]) -> list[str]:
    return sorted({n for h in hists.values() for m in h.values() for n in m})


def compare_figure(hists: dict[str, History], names: list[str], title: str, offsets: dict[str, int] | None = None,
                   promote: set[str] = frozenset()) -> Figure:
    """One panel per metric, one line per run and one legend for them all, below the panels (a legend per panel
    covers points). `offsets`: a chain's runs laid end to end, run r's iteration i drawn at offsets[r] + i, a dotted
    line where each run starts."""
    fig, axes = _grid(len(names), title)
    off = offsets or dict.fromkeys(hists, 0)
    its = sorted({off[r] + it for r, h in hists.items() for it, m in h.items() if any(n in m for n in names)})
    for ax, name in zip(axes, names):
        for run_id, hist in hists.items():
            xs, ys = _series(hist, name)
            if xs:
                ax.plot([off[run_id] + x for x in xs], ys, marker="o", label=run_id)
        for start in sorted(set(off.values()))[1:] if offsets else ():
            ax.axvline(start, color="grey", linestyle=":", linewidth=1)
        _axes(ax, f"{name} (promote.metric)" if name in promote else name, name.rsplit("/", 1)[1], its,
              legend=False, xlabel="iteration across the chain" if offsets else "iteration")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=_legend_columns(fig, labels), fontsize="small")
    return fig


def _legend_columns(fig: Figure, labels: list[str]) -> int:
    """As many entries a row as fit the figure's width (a label's width estimated from its characters)."""
    points = fig.get_figwidth() * 72
    entry = max((len(label) for label in labels), default=1) * 5.2 + 40  # small font: ~5.2 pt a character
    return max(1, min(len(labels), int(points // entry)))


DEFAULT_COMPARED = ("rollout/reward_mean", "update/kl_loss", "eval/accuracy")


def default_metrics(have: list[str], promote: list[str]) -> list[str]:
    """Reward mean, KL (kl_loss, else ppo_kl) and eval accuracy where recorded, then each metric that decided the
    runs' promotion (promote.metric)."""
    kl = "update/kl_loss" if "update/kl_loss" in have else "update/ppo_kl"
    names = [n for n in (DEFAULT_COMPARED[0], kl, *DEFAULT_COMPARED[2:]) if n in have]
    names += [m for m in dict.fromkeys(promote) if m in have and m not in names]
    return names or have[:3]


def promote_metrics(store: ArtifactStore, runs: list[str]) -> list[str]:
    """The metric each run's `latest` pointer was moved by (core/store/promote.py records it), if any."""
    pointers = (store.get_pointer(f"runs/{r}/latest") or {} for r in runs)
    return [m for m in dict.fromkeys(p.get("metric") for p in pointers) if m]


def chain_order(store: ArtifactStore, runs: list[str]) -> tuple[str, list[str]] | None:
    """(blueprint name, the runs in the chain's order) when every run is one blueprint's recurring run
    (schedule.init_from: previous): its build records its blueprint and its position in the chain; else None."""
    from verlflow.core.store.artifacts import stage_key

    builds = {r: store.read_manifest(stage_key(r, "init", "build")) or {} for r in runs}
    names = {m.get("blueprint_name") for m in builds.values()}
    places = {r: m.get("metrics", {}).get("chain_position") for r, m in builds.items()}
    if len(names) != 1 or None in names or any(p is None for p in places.values()):
        return None
    return names.pop(), sorted(runs, key=lambda r: places[r])


def chain_offsets(hists: dict[str, History], order: list[str]) -> dict[str, int]:
    """Run k starts where run k-1 ended: the sum of the earlier runs' iterations."""
    offsets, at = {}, 0
    for r in order:
        offsets[r] = at
        at += max(hists[r], default=0)
    return offsets


def compare_rows(hists: dict[str, History], names: list[str], offsets: dict[str, int] | None = None,
                 labels: dict[str, dict[int, str]] | None = None) -> list[dict]:
    """A row per run and iteration, by iteration (a chain's: across the chain, then the run's own), then the runs
    in the given order. `labels`: each phased run's step names (step_labels), in a `step` column."""
    order = list(hists)
    named = labels and any(labels.values())
    rows = [{**({"chain iteration": offsets[r] + it} if offsets else {}), "iteration": it,
             **({"step": labels[r].get(it, str(it))} if named else {}), "run": r,
             **{n: m.get(n) for n in names}} for r, h in hists.items() for it, m in h.items()]
    return sorted(rows, key=lambda row: (row.get("chain iteration", row["iteration"]), order.index(row["run"])))


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


@dataclass(frozen=True)
class Comparison:
    names: list[str]
    rows: list[dict]
    figure: Figure
    chain: str | None = None  # the blueprint whose chain the runs were laid end to end for

    def table(self, width: int = 80) -> str:
        """The rows as a text table at most `width` characters wide: the runs by id, or when their ids would not
        fit, by letter with a key above the table."""
        runs = list(dict.fromkeys(row["run"] for row in self.rows))
        table = self._table({r: r for r in runs})
        if _width(table) > width:
            labels = {r: _label(i) for i, r in enumerate(runs)}
            return "\n".join([*(f"run {labels[r]}: {r}" for r in runs), _render(self._table(labels), width)])
        return _render(table, width)

    def _table(self, labels: dict[str, str]):
        from rich import box
        from rich.table import Table

        cols = list(self.rows[0]) if self.rows else ["iteration", "run", *self.names]
        group = "run" if self.chain else "iteration"  # a rule between iterations, or between a chain's runs
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for c in cols:  # a metric's name wraps after its stage (rollout/, eval/)
            table.add_column(c.replace("/", "/\n", 1), justify="left" if c == "run" else "right", overflow="fold")
        for row, after in zip(self.rows, self.rows[1:] + [None]):
            table.add_row(*(labels[row[c]] if c == "run" else _cell(row[c]) for c in cols),
                          end_section=after is not None and after[group] != row[group])
        return table


def _label(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else str(i + 1)


def _width(table) -> int:
    from rich.console import Console

    return Console(width=10_000, file=io.StringIO()).measure(table).maximum


def _render(table, width: int) -> str:
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines()).strip("\n")


def _cell(v) -> str:
    return "-" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def compare_runs(store: ArtifactStore, runs: list[str], names: list[str] | None = None, *,
                 promote: str | None = None, axis: str = "auto") -> Comparison:
    """Runs side by side; an unknown run or metric is refused with what the store holds. `promote`: a blueprint's
    promote.metric, compared by default with the metric each run was promoted by. `axis`: run (each run from
    iteration 1), chain (one blueprint's recurring runs end to end) or auto (chain when they are one)."""
    from verlflow.core.errors import VerlflowError

    known = sorted({p.split("/")[1] for p in store.ls("runs") if p.count("/") > 1})
    if missing := [r for r in runs if r not in known]:
        raise VerlflowError(f"run(s) {', '.join(missing)}: not in {store.root_uri}; its runs: "
                            f"{', '.join(known) or '(none)'}")
    chain = chain_order(store, runs) if axis == "chain" or axis == "auto" and len(runs) > 1 else None
    if axis == "chain" and chain is None:
        raise VerlflowError(f"--axis chain: {', '.join(runs)} are not runs of one blueprint's recurring chain (their "
                            "builds record no chain position of one blueprint: schedule.init_from previous); use "
                            "--axis run")
    order = chain[1] if chain else runs
    hists = {r: history(store, r) for r in order}
    labels = {r: step_labels(store, r) for r in order}  # a phased run's steps by name
    have = available(hists)
    promoted = [m for m in (promote, *promote_metrics(store, runs)) if m]
    names = list(names or default_metrics(have, promoted))
    if unknown := [n for n in names if n not in have]:
        raise VerlflowError(f"--metrics: unknown metric(s) {', '.join(unknown)}; the runs record: {', '.join(have)}")
    offsets = chain_offsets(hists, order) if chain else None
    title = (f"{chain[0]}: {len(order)} run(s) of the chain, end to end" if chain else
             f"{len(order)} run{'s' if len(order) > 1 else ''}: one line per run")
    return Comparison(names, compare_rows(hists, names, offsets, labels),
                      compare_figure(hists, names, title, offsets, set(promoted)), chain[0] if chain else None)
