"""The evaluate stage (issue 16 item 1): pass@k against hand-computed values; a real 6-iteration run (one rank, warm
workers) whose held-out evaluations, before training and at iterations 3 and 6, show the tiny task learning, per
data source; reruns reuse the committed evaluations, --from reruns one (and refuses one whose policy retention
pruned); bad eval input is refused before anything is written, naming the field and file."""

import json
from math import comb

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import copy_store, rekey
from tinybp import tiny_blueprint, tiny_overrides

from verlflow.core.blueprint import load_blueprint
from verlflow.core.ml.evaluate import pass_at_k
from verlflow.flows.cli import main
from verlflow.core.orchestrate.pipeline import run_pipeline

pytestmark = pytest.mark.stages

METRICS = ("reward_mean", "accuracy", "pass@1", "pass@4", "response_len_mean", "samples")
SOURCES = ("tiny_digits", "other_digits")
PROMPTS_PER_FILE, N = 16, 4


# ------------------------------------------------------------------------------------------------------ pass@k


@pytest.mark.parametrize("n,c,k,want", [
    (4, 1, 2, 1 / 2),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 1, 0.3),  # pass@1 is the share of correct samples
    (5, 0, 3, 0.0),  # nothing correct
    (5, 5, 3, 1.0),  # everything correct
    (5, 3, 3, 1.0),  # n - c < k: every 3 of the 5 hold a correct one
    (6, 4, 2, 14 / 15),  # n - c == k: 1 - C(2,2)/C(6,2) = 1 - 1/15
])
def test_pass_at_k_matches_the_hand_computed_value(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_floats():
    got = pass_at_k(2000, 3, 1000)  # C(2000, 1000) ~ 1e600
    assert got == pytest.approx(1 - comb(1997, 1000) / comb(2000, 1000), abs=1e-12) and 0.8 < got < 1


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


# ------------------------------------------------------------------------------------------------ a real run


def other_source_file(kit: dict, dst) -> str:
    """The test split's last rows under another data_source: a second held-out set."""
    t = pq.read_table(kit["test_file"])
    t = t.set_column(t.column_names.index("data_source"), "data_source", pa.array(["other_digits"] * t.num_rows))
    pq.write_table(t.slice(t.num_rows - PROMPTS_PER_FILE), dst)
    return str(dst)


def eval_overrides(kit: dict, root, other: str) -> list[str]:
    """6 GRPO iterations that learn (8 prompts x 4, lr 1e-2; tests/test_stages.py's learning test), one rank in a
    warm pool, an export at the last only; evaluated before training, at 3 and at 6 with 4 samples a prompt."""
    return tiny_overrides(kit, root, "resources.nproc_per_node=1", "resources.warm_workers=true", "iterations=6",
                          "data.batch_size=8", "algorithm.ppo_mini_batch_size=4", "algorithm.lr=1e-2",
                          "storage.export_every=6", f"eval.files=[{kit['test_file']},{other}]",
                          f"eval.max_prompts={PROMPTS_PER_FILE}", "eval.every=3", f"eval.n={N}",
                          "eval.temperature=1.0", "eval.pass_k=[1,4]", "eval.threshold=0.5", "eval.samples_shown=2")


@pytest.fixture(scope="module")
def evaluated(tiny_kit, tmp_path_factory):
    """(blueprint, store folder, results by step name) of the run; read only (a test that writes copies it)."""
    tmp = tmp_path_factory.mktemp("evaluated")
    bp = load_blueprint(None, eval_overrides(tiny_kit, tmp / "store", other_source_file(tiny_kit, tmp / "other.parquet")))
    lines = []
    results = run_pipeline(bp, "ev", on_line=lines.append)
    by_name = {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r for r in results}
    assert "evaluate[6]" in by_name, "\n".join(lines[-60:])
    return bp, tmp / "store", by_name


def test_the_held_out_split_improves_and_the_evaluation_shows_it(evaluated):
    bp, root, res = evaluated
    assert [n for n in res if n.startswith("evaluate")] == ["evaluate[0]", "evaluate[3]", "evaluate[6]"]
    first, mid, last = (res[f"evaluate[{i}]"].manifest["metrics"] for i in (0, 3, 6))
    # A random-init policy scores ~0.03 here; 6 iterations reach ~0.3 (0.1 is > 5 standard errors of a 128-sample
    # mean of rewards with std ~0.15)
    assert last["reward_mean"] - first["reward_mean"] > 0.1, (first, last)
    for m in (first, mid, last):
        for key in METRICS:
            assert all(f"{s}/{key}" in m for s in SOURCES) and key in m, (key, m)
        assert m["samples"] == 2 * PROMPTS_PER_FILE * N and all(m[f"{s}/samples"] == PROMPTS_PER_FILE * N
                                                                for s in SOURCES)
        assert m["pass@1"] == pytest.approx(m["accuracy"], abs=1e-6)  # every prompt has its n samples
        assert m["pass@4"] >= m["pass@1"]
        assert 0 < m["response_len_mean"] <= bp.rollout.max_new_tokens
        assert m["reward_mean"] == pytest.approx(sum(m[f"{s}/reward_mean"] for s in SOURCES) / 2, abs=1e-5)
    table = pq.read_table(root / "runs/ev/6/evaluate/samples.parquet").to_pylist()
    assert len(table) == 2 * PROMPTS_PER_FILE * N
    assert {(r["data_source"], r["file"]) for r in table} == {("tiny_digits", 0), ("other_digits", 1)}
    assert sorted({r["sample"] for r in table}) == list(range(N))
    assert sum(r["reward"] for r in table) / len(table) == pytest.approx(last["reward_mean"], abs=1e-5)
    assert all(r["correct"] == (r["reward"] >= bp.eval.threshold) for r in table)
    shown = last["report"]
    assert sorted(shown) == sorted(SOURCES) and all(len(v) == 2 for v in shown.values())
    assert shown["tiny_digits"][0]["response"] == table[0]["response"]
    first_prompt = pq.read_table(bp.eval.files[0]).to_pylist()[0]["prompt"][-1]["content"]
    assert shown["tiny_digits"][0]["prompt"] == first_prompt and shown["tiny_digits"][0]["row"] == 0
    # the warm pool's update, still in memory, is what evaluate[3] generated from (no checkpoint read back)
    assert mid["warm_cache_hits"] == ["infer", "policy"]
    # the export of the evaluated iteration names its evaluation among its inputs (promotion may read it)
    assert res["export[6]"].manifest["inputs"]["evaluate"]["stage"] == "runs/ev/6/evaluate"
    report = json.loads((root / "runs/ev/init/validate/report.json").read_text())
    row = next(r for r in report[0] if r["check"] == "eval_inputs")
    assert row["ok"] and "tiny_digits (16), other_digits (16)" in row["detail"], row


def test_a_rerun_reuses_every_evaluation_and_from_reruns_one(evaluated, tiny_kit, tmp_path, capsys):
    """Through the CLI, as a user resumes: `verlflow rerun`, `--from evaluate[3]`, `--from evaluate[6]`, `ls`."""
    bp, _, res = evaluated
    bp, root = copy_store(bp, tmp_path)
    rekey(bp, "ev")
    argv = ["rerun", "ev", *eval_overrides(tiny_kit, root, bp.eval.files[1])]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for it in (0, 3, 6):
        assert f"evaluate[{it}] is committed with the same key: reusing" in out, out
    assert " -> " not in out, out  # nothing launched
    assert "held-out evaluation" in out and f"{res['evaluate[6]'].manifest['metrics']['accuracy']:.4f}" in out
    # keep_last_checkpoints 2: update[3]'s policy is pruned, so evaluate[3] cannot run again; refused before anything
    assert main([*argv, "--from", "evaluate[3]"]) != 0
    err = capsys.readouterr().err
    assert "evaluate[3] needs" in err and "runs/ev/3/update" in err and "retention pruned" in err, err
    assert (root / "runs/ev/3/evaluate/manifest.json").is_file()
    assert main([*argv, "--from", "evaluate[6]"]) == 0
    out = capsys.readouterr().out
    ran = [line.split()[1] for line in out.splitlines() if line.startswith("[verlflow] ") and " -> " in line]
    assert ran == ["evaluate[6]", "export[6]"], out
    # the same seeds and weights: the same samples (the policy read back from its checkpoint this time)
    new, old = load_manifest(root, "runs/ev/6/evaluate")["metrics"], res["evaluate[6]"].manifest["metrics"]
    assert "warm_cache_hits" not in new and {k: v for k, v in old.items() if k != "warm_cache_hits"} == new
    assert main(["ls", *argv[2:], "--run", "ev"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed[:4] == ["validate[init]", "build[init]", "evaluate[0]", "rollout[1]"], listed
    assert listed[-4:] == ["rollout[6]", "update[6]", "evaluate[6]", "export[6]"], listed


def load_manifest(root, key: str) -> dict:
    return json.loads((root / key / "manifest.json").read_text())


def test_an_evaluation_keeps_its_key_when_only_the_rollout_sampling_changes(evaluated, tmp_path):
    """evaluate[0] reads the build alone: a changed rollout.temperature reruns training, not that evaluation."""
    from verlflow.core.orchestrate.pipeline import plan, steps_that_run
    from verlflow.core.store.artifacts import open_store

    bp, _, _ = evaluated
    bp, _ = copy_store(bp, tmp_path)
    rekey(bp, "ev")
    hot = bp.model_copy(deep=True)
    hot.rollout.temperature = 0.7
    steps = plan(hot, "ev")
    runs = steps_that_run(open_store(hot.storage), hot, "ev", steps, [False] * len(steps))
    assert {s.name: r for s, r in zip(steps, runs)}["evaluate[0]"] is False
    assert {s.name: r for s, r in zip(steps, runs)}["rollout[1]"] is True
    later = bp.model_copy(deep=True)
    later.eval.every = 2  # another cadence: the evaluations that exist again keep their keys
    steps = plan(later, "ev")
    runs = steps_that_run(open_store(later.storage), later, "ev", steps, [False] * len(steps))
    assert {s.name: r for s, r in zip(steps, runs) if s.stage == "evaluate"} == {
        "evaluate[0]": False, "evaluate[2]": True, "evaluate[4]": True, "evaluate[6]": False}


# ------------------------------------------------------------------------------------------------- bad input


def _run_cli(argv, capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def write_rows(path, n: int, drop: str | None = None) -> str:
    from tinybp import prompt_rows

    cols = prompt_rows(max(n, 1))
    table = pa.table(cols).slice(0, n)
    if drop:
        table = table.drop_columns([drop])
    pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize("case", ["missing-file", "missing-column", "missing-prompt-key", "no-rows", "pass-k-over-n",
                                  "unknown-reward"])
def test_bad_eval_input_is_refused_before_anything_is_written(tiny_kit, tmp_path, capsys, case):
    good = tiny_kit["test_file"]
    overrides, want = {
        "missing-file": ([f"eval.files=[{good},{tmp_path}/nope.parquet]"],
                         ["eval.files[1]", "nope.parquet does not exist"]),
        "missing-column": ([f"eval.files=[{good},{write_rows(tmp_path / 'bad.parquet', 3, 'reward_model')}]"],
                           ["eval.files[1]", "bad.parquet", "lacks column(s) ['reward_model']"]),
        "missing-prompt-key": ([f"eval.files=[{good}]", "eval.prompt_key=question"],
                               ["eval.files[0]", "test.parquet", "lacks column(s) ['question']", "eval.prompt_key"]),
        "no-rows": ([f"eval.files=[{write_rows(tmp_path / 'empty.parquet', 0)}]"],
                    ["eval.files[0]", "empty.parquet", "has no rows"]),
        "pass-k-over-n": ([f"eval.files=[{good}]", "eval.n=2", "eval.temperature=1.0", "eval.pass_k=[1,4]"],
                          ["eval.pass_k [4] must be between 1 and eval.n=2"]),
        "unknown-reward": ([f"eval.files=[{good}]", "eval.reward=no_such_reward"],
                           ["eval.reward", "unknown reward function 'no_such_reward'"]),
    }[case]
    store = tmp_path / "store"
    rc, err = _run_cli(["run", *tiny_overrides(tiny_kit, store), *overrides], capsys)
    assert rc != 0 and "verlflow run: error:" in err and all(w in err for w in want), err
    assert "Traceback" not in err and not store.exists()


def test_validate_blueprint_names_the_eval_data_sources(tiny_kit, tmp_path, capsys):
    other = other_source_file(tiny_kit, tmp_path / "other.parquet")
    rc = main(["validate-blueprint", *tiny_overrides(tiny_kit, tmp_path / "store"),
               f"eval.files=[{tiny_kit['test_file']},{other}]", "eval.max_prompts=10"])
    out = capsys.readouterr().out
    assert rc == 0 and "eval.files: 20 prompts, data sources tiny_digits (10), other_digits (10)" in out, out
    assert "eval/tiny_digits/accuracy" in out
