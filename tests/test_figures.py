"""The figures people read (core/orchestrate/figures.py): the run report's curves from a real store's manifests,
and `verlflow compare` through the real CLI. The training metrics are the reference run's (tests/reference.py);
the eval metrics are committed through the store's commit API under the evaluate stage's names (core/metrics.py)."""

import matplotlib.image
import pytest

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


@pytest.fixture
def store(reference, tmp_path):
    """A copy of the reference store: run eq (2 iterations) with evaluations at 0, 1, 2, and run eq2, eq's rollout
    and update manifests with rewards +0.5 and evaluations shifted by 0.2."""
    from reference import copy_store

    from verlflow.core.orchestrate.runner import open_store

    bp, _ = copy_store(reference.bp, tmp_path)
    s = open_store(bp)
    for it in (0, 1, 2):
        commit_eval(s, "eq", it)
        commit_eval(s, "eq2", it, shift=0.2)
    for it in (1, 2):
        for stage in ("rollout", "update"):
            m = s.read_manifest(f"runs/eq/{it}/{stage}")
            metrics = {**m["metrics"], "reward_mean": m["metrics"].get("reward_mean", 0) + 0.5} \
                if stage == "rollout" else m["metrics"]
            s.commit(f"runs/eq2/{it}/{stage}", {"key": f"eq2-{it}-{stage}", "metrics": metrics}, {})
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
    from verlflow.core.orchestrate.cli import main

    out, names = tmp_path / "cmp" / "ab.png", ["rollout/reward_mean", "eval/openai/gsm8k/accuracy"]
    rc = main(["compare", "eq", "eq2", "--store", store.root_uri, "--metrics", ",".join(names), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.splitlines()
    header = lines[0].split()
    assert header == ["iteration", *(f"{r}:{n}" for r in ("eq", "eq2") for n in names)]
    table = {int(ln.split()[0]): ln.split()[1:] for ln in lines[1:4]}
    assert sorted(table) == [0, 1, 2]
    for it in (1, 2):
        r = store.read_manifest(f"runs/eq/{it}/rollout")["metrics"]["reward_mean"]
        assert float(table[it][0]) == pytest.approx(r) and float(table[it][2]) == pytest.approx(r + 0.5)
    assert table[0][0] == "-"  # no rollout before training
    for it in (0, 1, 2):
        assert float(table[it][1]) == eval_metrics(it)["openai/gsm8k/accuracy"]
        assert float(table[it][3]) == eval_metrics(it, 0.2)["openai/gsm8k/accuracy"]
    assert matplotlib.image.imread(out).shape[2] == 4

    fig = figures.compare_runs(store, ["eq", "eq2"], names).figure
    assert [ax.get_title() for ax in fig.axes] == names
    for ax in fig.axes:
        assert [ln.get_label() for ln in ax.get_lines()] == ["eq", "eq2"]


def test_compare_refuses_an_unknown_run_or_metric_naming_what_there_is(store, tmp_path, capsys):
    from verlflow.core.orchestrate.cli import main

    out = tmp_path / "x.png"
    assert main(["compare", "eq", "nope", "--store", store.root_uri, "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "nope" in err and "eq, eq2" in err
    assert main(["compare", "eq", "--store", store.root_uri, "--metrics", "eval/acuracy", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "eval/acuracy" in err and "eval/openai/gsm8k/accuracy" in err and "rollout/reward_mean" in err
    assert not out.exists()
