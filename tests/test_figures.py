"""The figures people read (core/orchestrate/figures.py): the run report's curves from a real store's manifests,
and `verlflow compare` through the real CLI. The training metrics are the reference run's (tests/reference.py);
the eval metrics are committed through the store's commit API under the evaluate stage's names (core/metrics.py)."""

import matplotlib.image
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

pytestmark = pytest.mark.stages

SOURCES = ("openai/gsm8k", "tiny/held")


def eval_metrics(it: int, shift: float = 0.0) -> dict:
    out = {}
    for j, src in enumerate(SOURCES):
        acc = round(0.1 * it + 0.05 * j + shift, 4)
        out.update({f"{src}/accuracy": acc, f"{src}/reward_mean": acc / 2, f"{src}/pass@1": acc,
                    f"{src}/pass@2": min(1.0, acc + 0.1), f"{src}/response_len_mean": 5.0 + it, f"{src}/samples": 8})
    out.update({"accuracy": round(0.1 * it + 0.025 + shift, 4), "samples": 16})
    return out


def commit_eval(store, run: str, it: int, shift: float = 0.0) -> None:
    store.commit(f"runs/{run}/{it}/evaluate", {"key": f"fed-eval-{run}-{it}", "metrics": eval_metrics(it, shift)}, {})


def clone_run(store, run: str, reward_shift: float, eval_shift: float, build: dict | None = None) -> None:
    """Run `run`: eq's rollout and update manifests with rewards + reward_shift, evaluations at 0, 1, 2 shifted by
    eval_shift, and `build` as its build manifest's fields (a chain's run records its place there)."""
    for it in (0, 1, 2):
        commit_eval(store, run, it, shift=eval_shift)
    for it in (1, 2):
        for stage in ("rollout", "update"):
            m = store.read_manifest(f"runs/eq/{it}/{stage}")
            metrics = {**m["metrics"], "reward_mean": m["metrics"].get("reward_mean", 0) + reward_shift} \
                if stage == "rollout" else m["metrics"]
            store.commit(f"runs/{run}/{it}/{stage}", {"key": f"{run}-{it}-{stage}", "metrics": metrics}, {})
    if build is not None:
        store.commit(f"runs/{run}/init/build", {"key": f"{run}-build", **build}, {})


def table_rows(text: str) -> list[list[str]]:
    """The data rows of `verlflow compare`'s table (below its header's rule), split at blanks."""
    lines = text.splitlines()
    rule = next(i for i, ln in enumerate(lines) if set(ln.strip()) == {"─"})
    return [ln.split() for ln in lines[rule + 1:] if ln.strip() and not ln.startswith("figure:")]


@pytest.fixture
def store(reference, tmp_path):
    """A copy of the reference store: run eq (2 iterations) with evaluations at 0, 1, 2, and run eq2, eq's rollout
    and update manifests with rewards +0.5 and evaluations shifted by 0.2."""
    from reference import copy_store

    from verlflow.core.store.artifacts import open_store

    bp, _ = copy_store(reference.bp, tmp_path)
    s = open_store(bp.storage)
    for it in (0, 1, 2):
        commit_eval(s, "eq", it)
    clone_run(s, "eq2", 0.5, 0.2)
    return s


def test_run_figure_has_a_labelled_panel_per_metric_and_a_line_per_eval_source(store, tmp_path):
    from verlflow.core.orchestrate import figures

    hist = figures.history(store, "eq")
    assert sorted(hist) == [0, 1, 2]
    fig = figures.run_figure(hist, "eq")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["Reward mean ± std (rollout)", "KL to the reference", "Policy entropy", "Gradient norm",
                      "Response length (rollout)", "Eval accuracy per data source", "Eval reward mean per data source"]
    for ax in fig.axes:
        assert ax.get_xlabel() == "iteration" and ax.get_ylabel()
        assert list(ax.get_xticks()) == [0, 1, 2]
        assert ax.get_lines() and ax.get_legend() is not None
    reward = fig.axes[0]
    assert list(reward.get_lines()[0].get_ydata()) == [store.read_manifest(f"runs/eq/{i}/rollout")["metrics"]
                                                       ["reward_mean"] for i in (1, 2)]
    assert len(reward.collections) == 1  # the ±std band
    acc = fig.axes[5]
    assert [ln.get_label() for ln in acc.get_lines()] == list(SOURCES)
    for ln, src in zip(acc.get_lines(), SOURCES):
        assert list(ln.get_xdata()) == [0, 1, 2]  # iteration 0: before training
        assert list(ln.get_ydata()) == [eval_metrics(i)[f"{src}/accuracy"] for i in (0, 1, 2)]

    out = tmp_path / "curves.png"
    out.write_bytes(figures.png(fig))
    img = matplotlib.image.imread(out)
    w, h = figures.PANEL_INCHES[0] * 2 * figures.DPI, figures.PANEL_INCHES[1] * 4 * figures.DPI
    assert img.shape[:2] == (round(h), round(w))
    assert img.std() > 0.01  # drawn, not blank

    rows = figures.eval_rows(hist)
    assert [(r["iteration"], r["data_source"]) for r in rows] == [(i, s) for i in (0, 1, 2) for s in SOURCES]
    assert list(rows[0]) == ["iteration", "data_source", "accuracy", "reward_mean", "pass@1", "pass@2",
                             "response_len_mean", "samples"]
    assert rows[3]["pass@2"] == eval_metrics(1)["tiny/held/pass@2"]


def test_compare_prints_the_manifests_numbers_and_draws_a_line_per_run(store, tmp_path, capsys):
    from verlflow.core.orchestrate import figures
    from verlflow.flows.cli import main

    out, names = tmp_path / "cmp" / "ab.png", ["rollout/reward_mean", "eval/openai/gsm8k/accuracy"]
    rc = main(["compare", "eq", "eq2", "--store", store.root_uri, "--metrics", ",".join(names), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    header = text.split("─")[0]
    assert header.split() == ["rollout/", "eval/", "iteration", "run", "reward_mean", "openai/gsm8k/accuracy"]
    table = {(int(row[0]), row[1]): row[2:] for row in table_rows(text)}  # a row per iteration and run
    assert sorted(table) == [(it, r) for it in (0, 1, 2) for r in ("eq", "eq2")]
    for it in (1, 2):
        r = store.read_manifest(f"runs/eq/{it}/rollout")["metrics"]["reward_mean"]
        assert float(table[it, "eq"][0]) == pytest.approx(r) and float(table[it, "eq2"][0]) == pytest.approx(r + 0.5)
    assert table[0, "eq"][0] == "-"  # no rollout before training
    for it in (0, 1, 2):
        assert float(table[it, "eq"][1]) == eval_metrics(it)["openai/gsm8k/accuracy"]
        assert float(table[it, "eq2"][1]) == eval_metrics(it, 0.2)["openai/gsm8k/accuracy"]
    assert matplotlib.image.imread(out).shape[2] == 4

    fig = figures.compare_runs(store, ["eq", "eq2"], names).figure
    assert [ax.get_title() for ax in fig.axes] == names
    for ax in fig.axes:
        assert [ln.get_label() for ln in ax.get_lines()] == ["eq", "eq2"]


LONG = [f"nightly-qwen2.5-grpo-20261202T0{h}0000Z-9f3c2b7{h}" for h in range(4)]  # the scheduler's run ids


def test_four_runs_fit_the_terminal_and_nothing_in_the_figure_is_clipped_or_covered(store, tmp_path, capsys,
                                                                                     monkeypatch):
    """`verlflow compare` of 4 runs with the scheduler's long ids: the table is as wide as the terminal (by letter
    with a key when the ids do not fit); in the figure every text is inside it and the one legend covers no panel."""
    from verlflow.core.orchestrate import figures
    from verlflow.flows.cli import main

    for k, run in enumerate(LONG):
        clone_run(store, run, 0.1 * k, 0.05 * k)
    out = tmp_path / "four.png"
    for columns in (80, 200):
        monkeypatch.setenv("COLUMNS", str(columns))
        assert main(["compare", *LONG, "--store", store.root_uri, "--out", str(out)]) == 0
        text = capsys.readouterr().out
        assert max(len(line) for line in text.splitlines() if not line.startswith("figure:")) <= columns, text
        by_letter = columns == 80  # 4 ids of 45 characters and 3 metrics do not fit 80 columns
        assert all((f"run {'ABCD'[k]}: {run}" in text) == by_letter for k, run in enumerate(LONG)), text
        rows = {(row[0], row[1]): row[2:] for row in table_rows(text)}
        for k, run in enumerate(LONG):
            reward = store.read_manifest(f"runs/eq/2/rollout")["metrics"]["reward_mean"] + 0.1 * k
            assert float(rows["2", "ABCD"[k] if by_letter else run][0]) == pytest.approx(reward, abs=1e-5)

    fig = figures.compare_runs(store, LONG).figure
    FigureCanvasAgg(fig).draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert any(LONG[0] in t.get_text() for t in texts)  # the runs are named (in the legend)
    for t in texts:
        e = t.get_window_extent(renderer)
        assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0 and e.y1 <= box.y1 + 1, t.get_text()
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert not legend.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        for line in ax.get_lines():
            for x, y in line.get_xydata():
                px, py = ax.transData.transform((x, y))
                assert not legend.contains(px, py), (ax.get_title(), line.get_label(), x)


def test_compare_shows_the_promotion_metric_by_default(store, tmp_path, capsys):
    """The default panels are reward, KL and eval accuracy, and the metric that decides promotion: the one a run's
    pointer was moved by, and the blueprint's promote.metric."""
    from verlflow.core.orchestrate import figures
    from verlflow.flows.cli import main

    pointer = store.get_pointer("runs/eq/latest")
    store.set_pointer("runs/eq/latest", {**pointer, "metric": "eval/tiny/held/accuracy", "value": 0.25})
    result = figures.compare_runs(store, ["eq", "eq2"])
    assert result.names == ["rollout/reward_mean", "update/kl_loss", "eval/accuracy", "eval/tiny/held/accuracy"]
    assert result.figure.axes[3].get_title() == "eval/tiny/held/accuracy (promote.metric)"
    out = tmp_path / "p.png"
    assert main(["compare", "eq2", "promote.metric=rollout/reward_max", "--store", store.root_uri,
                 "--out", str(out)]) == 0
    header = capsys.readouterr().out.split("─")[0].split()
    assert header[-1] == "reward_max" and "accuracy" in header  # the blueprint's, after the defaults


def test_a_chain_of_recurring_runs_is_laid_end_to_end(store, tmp_path, capsys):
    """Runs of one blueprint's chain (their builds record their place): by default one iteration axis across the
    chain, in the chain's order whatever the order given; --axis run restarts each at 1; a chain of other runs is
    refused naming the fix."""
    from verlflow.core.orchestrate import figures
    from verlflow.flows.cli import main

    for k, run in enumerate(("night-a", "night-b", "night-c")):
        clone_run(store, run, 0.1 * k, 0.05 * k, build={"blueprint_name": "nightly", "metrics": {"chain_position": k}})
    out = tmp_path / "chain.png"
    assert main(["compare", "night-c", "night-a", "night-b", "--store", store.root_uri, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "runs of nightly's chain end to end" in text
    rows = [(int(r[0]), int(r[1]), r[2]) for r in table_rows(text)]
    assert rows == [(0, 0, "night-a"), (1, 1, "night-a"), (2, 2, "night-a"), (2, 0, "night-b"), (3, 1, "night-b"),
                    (4, 2, "night-b"), (4, 0, "night-c"), (5, 1, "night-c"), (6, 2, "night-c")]
    fig = figures.compare_runs(store, ["night-c", "night-a", "night-b"]).figure
    reward, acc = fig.axes[0], fig.axes[2]
    runs = lambda ax: [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]  # noqa: E731 (not the rules)
    assert [(ln.get_label(), list(ln.get_xdata())) for ln in runs(reward)] == [
        ("night-a", [1, 2]), ("night-b", [3, 4]), ("night-c", [5, 6])]
    assert [list(ln.get_xdata()) for ln in runs(acc)] == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    assert reward.get_xlabel() == "iteration across the chain"
    assert sorted({ln.get_xdata()[0] for ln in reward.get_lines() if ln.get_label().startswith("_")}) == [2, 4]

    per_run = figures.compare_runs(store, ["night-c", "night-a", "night-b"], axis="run").figure
    assert [list(ln.get_xdata()) for ln in per_run.axes[0].get_lines()] == [[1, 2]] * 3
    assert main(["compare", "eq", "eq2", "--axis", "chain", "--store", store.root_uri, "--out", str(out)]) != 0
    assert "not runs of one blueprint's recurring chain" in capsys.readouterr().err


def test_compare_refuses_an_unknown_run_or_metric_naming_what_there_is(store, tmp_path, capsys):
    from verlflow.flows.cli import main

    out = tmp_path / "x.png"
    assert main(["compare", "eq", "nope", "--store", store.root_uri, "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "nope" in err and "eq, eq2" in err
    assert main(["compare", "eq", "--store", store.root_uri, "--metrics", "eval/acuracy", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "eval/acuracy" in err and "eval/openai/gsm8k/accuracy" in err and "rollout/reward_mean" in err
    assert not out.exists()
