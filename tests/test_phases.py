"""Phases (issue 19): sft -> dpo -> rl declared in one blueprint, on the tiny kit in one warm pool of two ranks.

One module run of blueprints/tiny-phases.yaml: evaluate the base model, sft (1 epoch), dpo (2 epochs), evaluate the
tuned policy, rl (1 iteration), tracked in MLflow (its embedded store) and TensorBoard.
Its first attempt has rank 1 SIGKILLed in dpo's second epoch; the rerun of the same run id resumes there.
"""

import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verlflow.core.blueprint import Blueprint, load_blueprint
from verlflow.core.errors import BlueprintError
from verlflow.core.orchestrate.launcher import StageFailure
from verlflow.core.orchestrate.pipeline import checked_plan, plan, run_pipeline, steps_that_run
from verlflow.core.store.artifacts import open_store

pytestmark = pytest.mark.stages

RUN = "ph"
REPO = Path(__file__).resolve().parents[1]


TRACKED = "tracking.backends=[mlflow, tensorboard]"  # both in the artifact root's tracking/: MLflow's embedded store


def mlflow_client(bp):
    from mlflow.tracking import MlflowClient

    from verlflow.core.tracking.places import embedded_mlflow_uri

    return MlflowClient(tracking_uri=embedded_mlflow_uri(open_store(bp.storage)))


def phased_blueprint(kit: dict, folder: Path, *more: str):
    """blueprints/tiny-phases.yaml beside a `tiny/` folder that is the kit, so its relative paths reach the kit."""
    (folder / "blueprints").mkdir(parents=True)
    (folder / "tiny").mkdir()
    (folder / "tiny/qwen2").symlink_to(Path(kit["model_dir"]).parent)
    shutil.copy(REPO / "blueprints/tiny-phases.yaml", folder / "blueprints")
    return load_blueprint(folder / "blueprints/tiny-phases.yaml", [f"storage.uri={folder / 'store'}",
                                                                    "tracking.backends=[]", *more])


@pytest.fixture(scope="module")
def phased(tiny_kit, tmp_path_factory):
    """(blueprint, store, results by step name, the failed first attempt's lines)."""
    folder = tmp_path_factory.mktemp("phases")
    bp, store = phased_blueprint(tiny_kit, folder, "storage.keep_last_checkpoints=1", TRACKED), folder / "store"
    killed: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERLFLOW_FAULT", "kill_rank1_in_dpo_epoch2")
        with pytest.raises(StageFailure):
            run_pipeline(bp, RUN, on_line=killed.append)
    lines: list[str] = []
    results = run_pipeline(bp, RUN, on_line=lines.append)
    by_name = {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r for r in results}
    assert "export[1]" in by_name, "\n".join(lines[-40:])
    return bp, store, by_name, killed


def test_the_plan_runs_each_phase_from_the_previous_ones_policy(phased):
    bp, _, res, _ = phased
    assert list(res) == ["validate[init]", "build[init]", "evaluate[base]", "sft[sft.1]", "dpo[dpo.1]", "dpo[dpo.2]",
                         "evaluate[tuned]", "build[rl]", "rollout[1]", "update[1]", "evaluate[1]", "export[1]"]
    inputs = {n: {k: v["stage"] for k, v in r.manifest["inputs"].items()} for n, r in res.items()}
    assert inputs["evaluate[base]"]["policy"] == f"runs/{RUN}/init/build"
    assert inputs["sft[sft.1]"]["policy"] == f"runs/{RUN}/init/build"
    assert inputs["dpo[dpo.1]"]["policy"] == f"runs/{RUN}/sft.1/sft"
    assert inputs["dpo[dpo.2]"] == {"build": f"runs/{RUN}/init/build", "policy": f"runs/{RUN}/dpo.1/dpo",
                                    "reference": f"runs/{RUN}/dpo.1/dpo"}
    assert inputs["evaluate[tuned]"]["policy"] == f"runs/{RUN}/dpo.2/dpo"
    # the rl phase's reference is its start policy: a build of its own from dpo's
    assert inputs["build[rl]"] == {"warm_start": f"runs/{RUN}/dpo.2/dpo"}
    assert inputs["rollout[1]"] == {"build": f"runs/{RUN}/rl/build", "policy": f"runs/{RUN}/rl/build"}


def test_lineage_records_the_phase_that_made_each_policy(phased, tmp_path):
    _, store, res, _ = phased
    made_by = {n: [(e.get("phase"), e["stage"]) for e in r.manifest.get("lineage", [])] for n, r in res.items()}
    sft, dpo = ("sft", f"runs/{RUN}/sft.1/sft"), ("dpo", f"runs/{RUN}/dpo.2/dpo")
    assert made_by["sft[sft.1]"] == [] and made_by["evaluate[base]"] == []  # the base model
    assert made_by["dpo[dpo.1]"] == made_by["dpo[dpo.2]"] == [sft]  # dpo's second epoch continues its own phase
    assert made_by["build[rl]"] == made_by["update[1]"] == made_by["export[1]"] == [sft, dpo]
    pointer = json.loads((store / "pointers/runs" / RUN / "latest.json").read_text())
    assert [e.get("phase") for e in pointer["lineage"]] == ["sft", "dpo"]  # what the promoted policy came from


def test_sft_lowers_its_loss_and_the_tuned_policy_beats_the_base(phased):
    _, _, res, _ = phased
    sft = res["sft[sft.1]"].manifest["metrics"]
    assert sft["sft_loss"] < 0.5 * sft["sft_loss_first"], sft
    base, tuned = (res[f"evaluate[{n}]"].manifest["metrics"]["reward_mean"] for n in ("base", "tuned"))
    # the random-init policy scores ~0.03 on the held-out prompts
    assert tuned > base + 0.2, (base, tuned)
    # and the rl phase starts from it: its first rollout samples the tuned policy (at the rollout's settings, not the
    # evaluation's: a looser bound; ~0.24 here)
    assert res["rollout[1]"].manifest["metrics"]["reward_mean"] > base + 0.1


def test_dpo_raises_the_margin_and_accuracy_from_its_reference(phased):
    _, _, res, _ = phased
    first, last = (res[f"dpo[dpo.{e}]"].manifest["metrics"] for e in (1, 2))
    step0 = first["steps"][0]  # the policy is the reference at the first step: margins 0, accuracy 0 (ties)
    assert step0["rewards/margins"] == pytest.approx(0, abs=1e-5) and step0["rewards/accuracies"] == 0
    tail = last["steps"][-4:]
    assert sum(s["rewards/margins"] for s in tail) / 4 > 0.3, tail
    assert sum(s["rewards/accuracies"] for s in tail) / 4 > 0.7, tail
    assert all(s["rewards/chosen"] > s["rewards/rejected"] for s in tail)


def test_a_kill_in_dpo_resumes_there_from_the_artifacts(phased):
    _, _, res, killed = phased
    assert any("SIGKILL in dpo_epoch2" in line for line in killed)
    reused = {n for n, r in res.items() if r.skipped}
    assert {"validate[init]", "build[init]", "evaluate[base]", "sft[sft.1]", "dpo[dpo.1]"} <= reused
    assert not reused & {"dpo[dpo.2]", "build[rl]", "rollout[1]", "update[1]"}


# -- a phased run in the trackers, `compare`, the curves and promotion (issue 38) --------------------------------------

# The plan's step numbers (core/metrics.step_numbers): each iteration with metrics in plan order, the rl one's
# stages at one number.
NUMBERED = {"evaluate[base]": 0, "sft[sft.1]": 1, "dpo[dpo.1]": 2, "dpo[dpo.2]": 3, "evaluate[tuned]": 4,
            "rollout[1]": 5, "update[1]": 5, "evaluate[1]": 5}
NAMES = {0: "evaluate[base]", 1: "sft[sft.1]", 2: "dpo[dpo.1]", 3: "dpo[dpo.2]", 4: "evaluate[tuned]",
         5: "rollout[1] update[1] evaluate[1]"}


def _expected_points(res) -> dict[str, list]:
    """Each tracked step's manifest metrics (core/metrics.py's names) at its number: what a tracker must hold."""
    from verlflow.core.metrics import flat

    want: dict[str, list] = {}
    for name, step in NUMBERED.items():
        m = res[name].manifest
        for metric, value in flat(m["stage"], m["metrics"]).items():
            want.setdefault(metric, []).append((step, value))
    return {k: sorted(v) for k, v in want.items()}


def test_a_phased_run_is_tracked_at_numbered_steps_each_named(phased):
    """MLflow (read back from its embedded store) and TensorBoard (its event reader) hold every step's metrics at its
    number, each step once although the killed first attempt logged half of them, and each number's step names (a
    tag, a text). Before: both trackers were dropped at evaluate[base] (int('base')): no rollout/reward_mean."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verlflow.core.metrics import PREFIX
    from verlflow.core.tracking.mlflow_backend import mlflow_name

    bp, store, res, _ = phased
    assert {n for n, r in res.items() if r.manifest["stage"] in PREFIX} == set(NUMBERED)
    want = _expected_points(res)
    assert {"rollout/reward_mean", "update/pg_loss", "eval/reward_mean", "sft/sft_loss",
            "dpo/rewards/margins"} <= set(want)

    client = mlflow_client(bp)
    (run,) = client.search_runs([client.get_experiment_by_name(bp.name).experiment_id])  # both attempts: one run
    assert run.info.status == "FINISHED" and run.data.tags["verlflow.run_id"] == RUN
    for name, points in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_name(name)))
        assert got == [(step, pytest.approx(v)) for step, v in points], name
    assert {k: v for k, v in run.data.tags.items() if k.startswith("verlflow.step.")} == \
        {f"verlflow.step.{n}": names for n, names in NAMES.items()}
    params = run.data.params
    assert (params["phases.0.kind"], params["phases.0.name"], params["phases.2.epochs"]) == ("evaluate", "base", "2")

    events = EventAccumulator(str(store / "tracking/tensorboard" / RUN), purge_orphaned_data=False,
                              size_guidance={"tensors": 0})
    events.Reload()
    for name, points in want.items():
        assert [(e.step, e.value) for e in events.Scalars(name)] == \
            [(step, pytest.approx(v, rel=1e-6)) for step, v in points], name
    texts = events.Tensors("verlflow/step/text_summary")
    assert {e.step: e.tensor_proto.string_val[0].decode() for e in texts} == NAMES


def test_compare_and_the_curves_show_a_phased_run_step_by_step(phased, tmp_path, capsys):
    """`verlflow compare` and the curves read a phased run at the trackers' step numbers, named: the base and tuned
    evaluations, sft's and dpo's epochs, the rl iteration. Before: its named steps were left out (iteration 1 only)."""
    from verlflow.core.orchestrate import figures
    from verlflow.flows.cli import main

    bp, store, res, _ = phased
    hist = figures.history(open_store(bp.storage), RUN)
    want = _expected_points(res)
    assert {name: sorted((n, m[name]) for n, m in hist.items() if name in m) for name in want} == want
    labels = figures.step_labels(open_store(bp.storage), RUN)
    assert labels == {0: "base", 1: "sft.1", 2: "dpo.1", 3: "dpo.2", 4: "tuned", 5: "1"}
    fig = figures.run_figure(hist, RUN, labels)
    loss = next(ax for ax in fig.axes if ax.get_title() == "SFT / DPO loss (phases)")
    assert [t.get_text() for t in loss.get_xticklabels()] == list(labels.values())

    out = tmp_path / "compare.png"
    assert main(["compare", RUN, "--store", str(store), "--metrics", "eval/reward_mean,rollout/reward_mean",
                 "--out", str(out)]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.split()[2:3] == [RUN]]
    tuned, rl = res["evaluate[tuned]"].manifest["metrics"], res["rollout[1]"].manifest["metrics"]
    assert [r[:3] for r in rows] == [[str(n), label, RUN] for n, label in labels.items()], rows
    assert rows[4][3:] == [f"{tuned['reward_mean']:.6g}", "-"], rows
    assert rows[5][4] == f"{rl['reward_mean']:.6g}", rows
    assert out.stat().st_size > 10_000


def test_a_run_ending_in_dpo_promotes_its_export_by_a_dpo_metric(phased, tmp_path):
    """The phases up to dpo alone (their steps reused from a copy of the phased run's store) export dpo's last epoch
    and the gate promotes it by promote.metric=dpo/rewards/accuracies, that epoch's. Before: validate refused the
    name, and the gate found no metric at export[dpo]."""
    bp, store, res, _ = phased
    shutil.copytree(store, tmp_path / "store")
    data = bp.model_dump(mode="json")
    data["phases"] = data["phases"][:3]
    data["storage"]["uri"], data["tracking"]["backends"] = str(tmp_path / "store"), []
    data["promote"]["metric"] = "dpo/rewards/accuracies"
    # one rank: the export reshards dpo's 2-rank checkpoint (no stage but validate keys the resources) and the
    # gate is the subject; a 2-rank pool for one export step cost a rank start
    data["resources"]["nproc_per_node"] = 1
    lines: list[str] = []
    results = run_pipeline(Blueprint.model_validate(data), RUN, on_line=lines.append)
    done = {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r for r in results}
    assert not done["export[dpo]"].skipped, "\n".join(lines[-30:])
    assert all(done[n].skipped for n in ("evaluate[base]", "sft[sft.1]", "dpo[dpo.1]", "dpo[dpo.2]"))
    pointer = json.loads((tmp_path / "store/pointers/runs" / RUN / "latest.json").read_text())
    assert (pointer["iteration"], pointer["metric"]) == ("dpo", "dpo/rewards/accuracies")
    assert pointer["value"] == pytest.approx(res["dpo[dpo.2]"].manifest["metrics"]["rewards/accuracies"])


def test_each_phase_keeps_its_last_epochs_checkpoint(phased):
    """keep_last_checkpoints=1: dpo's first epoch loses its policy once the second is committed (its reference
    log-probs stay: no checkpoint); each phase's last epoch, which later phases read, stays."""
    _, store, _, _ = phased
    read = lambda key: json.loads((store / "runs" / RUN / key / "manifest.json").read_text())  # noqa: E731
    first = read("dpo.1/dpo")
    assert first["pruned"] and any(f.startswith("policy/") for f in first["pruned_files"])
    assert not (store / "runs" / RUN / "dpo.1/dpo/policy").exists()
    assert (store / "runs" / RUN / "dpo.1/dpo/reference.safetensors").is_file()
    for key in ("sft.1/sft", "dpo.2/dpo"):
        assert not read(key).get("pruned") and (store / "runs" / RUN / key / "policy/dcp/.metadata").is_file()


@pytest.mark.parametrize("change, first_rerun", [
    ("phases.2.algorithm.beta", "dpo[dpo.1]"),  # dpo's beta: dpo and after
    ("algorithm.lr", "update[1]"),  # the rl phase's optimizer: its update and after
])
def test_a_changed_phase_reruns_that_phase_and_later_ones_only(phased, tiny_kit, change, first_rerun):
    bp, store, _, _ = phased
    if change.startswith("phases"):
        changed = bp.model_copy(deep=True)
        changed.phases[2].algorithm.beta = 0.2
    else:
        changed = bp.model_copy(update={"algorithm": bp.algorithm.model_copy(update={"lr": 0.004})})
    steps, _ = checked_plan(changed, RUN, None)
    runs = steps_that_run(open_store(changed.storage), changed, RUN, steps, [False] * len(steps))
    names = [s.name for s in steps]
    first = names.index(first_rerun)
    assert not any(runs[:first]), [n for n, r in zip(names, runs) if r]
    assert runs[first]


BAD = [
    ("  - kind: distill\n", "phases[1].kind", "is none of evaluate, sft, dpo, rl, nor a user stage"),
    ("  - kind: no_such_pkg.mod:Judge\n", "phases[1].kind: cannot import no_such_pkg.mod", "fix the dotted path"),
    ("  - kind: evaluate\n    init_from: nope\n", "phases[1].init_from: 'nope' names no phase", "use 'model' or one of"),
    ("  - kind: evaluate\n    init_from: later\n  - kind: rl\n    name: later\n",
     "phases[1].init_from: 'later' is phases[2], which runs later", "starts from an earlier one"),
    ("  - kind: evaluate\n    name: loop\n    init_from: loop\n", "phases[1].init_from: 'loop' is this phase itself",
     "cannot start from its own output"),
    ("  - kind: rl\n    name: again\n", "phases[1]: a second rl phase", "one rl phase per blueprint"),
    ("  - kind: dpo\n    data: {train_files: [p.parquet]}\n    algorithm: {beta: 0}\n", "phases[1].algorithm.beta",
     "greater than 0"),
    ("  - kind: sft\n", "phases[1]", "needs data.train_files"),
    ("  - kind: evaluate\n    resources: {backend: kubernetes}\n", "phases[1].resources",
     "backend kubernetes needs kubernetes.image"),
    ("  - kind: evaluate\n    resources: {backend: slurm, warm_workers: true}\n", "phases[1].resources",
     "set resources.warm_workers: false"),
]


@pytest.mark.parametrize("tail, where, fix", BAD, ids=[b[1].split(":")[0] for b in BAD])
def test_bad_graphs_are_refused_with_the_phase_path_and_line(tmp_path, tail, where, fix):
    f = tmp_path / "bp.yaml"
    f.write_text("name: bad\neval:\n  files: [t.parquet]\nphases:\n  - kind: rl\n" + tail)
    with pytest.raises(BlueprintError) as e:
        load_blueprint(f)
    msg = str(e.value)
    line = next(ln for ln in msg.splitlines() if where in ln)
    assert fix in line and f"{f}:" in line, msg
    assert f"{f}:6:" in line or f"{f}:7:" in line or f"{f}:8:" in line, msg  # the offending phase's lines


def test_a_phase_runs_on_its_own_backend_and_ranks(tiny_kit, tmp_path):
    """resources per phase: sft on Slurm (each stage its own job there: a pool is one local node's), dpo with one
    rank, the rest on the top-level local warm pool; a run of local node agents cannot move a phase away."""
    bp = phased_blueprint(tiny_kit, tmp_path)
    bp.phases[1].resources.backend = "slurm"
    bp.phases[1].resources.nnodes = 2
    bp.phases[2].resources.nproc_per_node = 1
    bp = Blueprint.model_validate(bp.model_dump())
    res = {p.label: bp.phase_blueprint(i).resources for i, p in enumerate(bp.phases)}
    assert (res["sft"].backend, res["sft"].nnodes, res["sft"].warm_pool) == ("slurm", 2, False)
    assert (res["dpo"].backend, res["dpo"].world_size, res["dpo"].warm_pool) == ("local", 1, True)
    assert all(r.backend == "local" and r.warm_pool for name, r in res.items() if name not in ("sft", "dpo"))
    steps = {s.name: s for s in plan(bp, RUN)}
    assert steps["sft[sft.1]"].bp.resources.backend == "slurm"  # what the runner launches the step with
    assert steps["build[rl]"].bp.resources.backend == "local"

    agents = bp.model_dump()
    agents["resources"].update(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint="127.0.0.1:29400", warm_workers=False)
    with pytest.raises(ValueError, match=r"phases\[1\]\.resources\.backend: a run of node agents"):
        Blueprint.model_validate(agents)


def test_a_phase_step_carries_its_phase_and_the_top_level_sections_as_written(tiny_kit, tmp_path):
    """An sft/dpo step's blueprint is the top-level one (no optimizer copied into `algorithm`, no temperature
    forced): the step carries the phase's index, and its key hashes that phase's own optimizer."""
    from verlflow.core.orchestrate.runner import compute_key

    bp = phased_blueprint(tiny_kit, tmp_path)
    steps = {s.name: s for s in plan(bp, RUN)}
    sft = steps["sft[sft.1]"]
    assert sft.phase == 1 and steps["dpo[dpo.2]"].phase == 2 and steps["validate[init]"].phase is None
    assert sft.bp.algorithm == bp.algorithm and sft.bp.rollout == bp.rollout
    assert bp.phases[1].algorithm.optim.lr == 0.01 != bp.algorithm.optim.lr

    def key(b):
        return compute_key("sft", b, "sft.1", {}, phase=sft.phase)

    phase_lr, rl_lr = bp.model_copy(deep=True), bp.model_copy(deep=True)
    phase_lr.phases[1].algorithm.lr = 0.02
    rl_lr.algorithm.lr = 0.02
    assert key(phase_lr) != key(bp) == key(rl_lr)
    with pytest.raises(ValueError, match="no phase was given"):
        compute_key("sft", bp, "sft.1", {})
    with pytest.raises(ValueError, match="active_phase"):  # not a blueprint field: the plan carries the phase
        Blueprint.model_validate({**bp.model_dump(), "active_phase": 1})


def test_a_missing_or_short_phase_dataset_is_named_before_anything_runs(tiny_kit, tmp_path):
    from verlflow.core.checks.inputs import missing_inputs

    bp = phased_blueprint(tiny_kit, tmp_path)
    assert missing_inputs(bp) == []
    bp.phases[1].data.train_files = [str(tmp_path / "gone.parquet")]
    bp.phases[2].algorithm.mini_batch_size = 512  # the kit's dpo file has 256 pairs
    problems = missing_inputs(bp)
    assert any(p.startswith("phases[1].data.train_files[0]:") and "gone.parquet does not exist" in p
               for p in problems), problems
    assert any(p.startswith("phases[2].data.train_files: 256 rows, fewer than phases[2].algorithm.mini_batch_size=512")
               for p in problems), problems


def _with_phase_file(folder: Path, kind: str, write) -> Path:
    """tiny-phases.yaml (beside the kit) with its `kind` phase's dataset replaced by a copy that `write` changes."""
    yaml_file = folder / "blueprints/tiny-phases.yaml"
    kit_file = f"../tiny/qwen2/data/{kind}.parquet"
    bad = folder / f"bad-{kind}.parquet"
    pq.write_table(write(pq.read_table(yaml_file.parent / kit_file)), bad)
    yaml_file.write_text(yaml_file.read_text().replace(kit_file, str(bad)))
    return yaml_file


@pytest.mark.parametrize("kind, write, want", [
    ("dpo", lambda t: t.drop(["rejected"]), "phases[2].data.train_files: {bad} lacks column(s) ['rejected']"),
    ("sft", lambda t: t.set_column(1, "response", pa.array([None] + t["response"].to_pylist()[1:], pa.string())),
     "phases[1].data.train_files[0]: {bad} row 0: `response` is empty or not a string"),
])
def test_a_phase_dataset_with_a_bad_column_is_refused_before_anything_is_committed(tiny_kit, tmp_path, capsys,
                                                                                  kind, write, want):
    """The phase's own reader (core/ml/phasedata.py) runs in the CLI's preflight: a dpo file without `rejected`, an
    sft row without its response, are refused by validate-blueprint and run, naming the phase, file and column,
    with nothing written to the store (before: validate passed and the run reached build)."""
    from verlflow.flows.cli import main

    phased_blueprint(tiny_kit, tmp_path)
    yaml_file = _with_phase_file(tmp_path, kind, write)
    want = want.format(bad=tmp_path / f"bad-{kind}.parquet")
    for argv in (["validate-blueprint", str(yaml_file)], ["run", str(yaml_file), "--run-id", "bad"]):
        assert main([*argv, f"storage.uri={tmp_path / 'store'}"]) != 0
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()


def test_phase_rows_over_their_max_length_are_named_by_validate(tiny_kit, tmp_path):
    """What only the tokenizer tells (the validate stage's tier, core/checks/preflight.py): a phase row
    longer than its algorithm.max_length, named before build rather than in the phase's own stage."""
    from verlflow.core.ml.model import load_tokenizer
    from verlflow.core.checks.preflight import phase_problems

    bp = phased_blueprint(tiny_kit, tmp_path)
    tok = load_tokenizer(bp.model.path)
    assert phase_problems(bp, tok) == []
    bp.phases[2].algorithm.max_length = 12
    problems = phase_problems(bp, tok)
    assert len(problems) == 1 and problems[0].startswith("phases[2].algorithm.max_length=12: the pair at "), problems
    assert "dpo.parquet row 0" in problems[0] and "raise phases[2].algorithm.max_length" in problems[0]


def test_validates_key_holds_what_it_checks_of_the_phases(tiny_kit, tmp_path):
    """A changed phase dataset is checked again on a rerun (validate's key), a changed dpo beta is not."""
    from verlflow.core.orchestrate.runner import key_sections

    bp = phased_blueprint(tiny_kit, tmp_path)
    key = lambda b: b.section_hash(*key_sections("validate", b))  # noqa: E731
    beta, data = bp.model_copy(deep=True), bp.model_copy(deep=True)
    beta.phases[2].algorithm.beta = 0.3
    data.phases[2].data.train_files = [str(tmp_path / "other.parquet")]
    assert key(beta) == key(bp) != key(data)


# -- a user stage: blueprints/tiny-judge.yaml's JudgeStage against a stub judge --------------------------------------

class _Judge(http.server.BaseHTTPRequestHandler):
    """Scores 1.0 when the response is the ground truth, else 0.0; remembers each request's Authorization."""
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((body, self.headers.get("Authorization")))
        out = json.dumps({"score": float(body["response"] == body["ground_truth"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def judge_blueprint(kit: dict, folder: Path, url: str, module: str = "verlflow.core.examples.judge:JudgeStage",
                    *more: str):
    (folder / "blueprints").mkdir(parents=True, exist_ok=True)
    (folder / "tiny").mkdir(exist_ok=True)
    if not (folder / "tiny/qwen2").exists():
        (folder / "tiny/qwen2").symlink_to(Path(kit["model_dir"]).parent)
    text = (REPO / "blueprints/tiny-judge.yaml").read_text()
    text = text.replace("http://127.0.0.1:8099/score", url).replace("verlflow.core.examples.judge:JudgeStage", module)
    (folder / "blueprints/tiny-judge.yaml").write_text(text)
    return load_blueprint(folder / "blueprints/tiny-judge.yaml", [f"storage.uri={folder / 'store'}",
                                                                  "tracking.backends=[]", *more])


# Credentials left in a blueprint by mistake, in each place one can hold them that a run writes out (the options of
# a user stage, nested or in a URI; the store's endpoint; a scheduler section the run does not use). None may reach
# a tracker, a manifest, the store, an artifact's text or a log line.
PLANTED = {"options": "sk-literal-9d2e7a41", "nested": "hf_nested_4c8b1f60", "query": "qtok-6a1e93d2",
           "endpoint": "minio-pw-2b7f5c18", "label": "k8s-label-8e3d0a77"}


def _planted(bp: Blueprint) -> Blueprint:
    """`bp` (the judge blueprint, its url's query holding PLANTED['query']) with the other PLANTED credentials."""
    data = bp.model_dump(mode="json")
    data["phases"][1]["options"].update(api_key=PLANTED["options"],
                                        headers={"X-Hf-Token": PLANTED["nested"], "Accept": "json"})
    data["storage"]["endpoint_url"] = f"http://minio:{PLANTED['endpoint']}@127.0.0.1:9"
    data["resources"]["kubernetes"]["labels"] = {"team-token": PLANTED["label"]}
    return Blueprint.model_validate(data)


def test_a_user_stage_scores_the_rollout_with_an_external_judge_and_keeps_its_key(tiny_kit, tmp_path, monkeypatch):
    """The judge stage against a stub judge, tracked (MLflow, TensorBoard), with the API key in the
    environment and credentials planted in the blueprint (PLANTED): its options are structured params with the
    secret-looking ones redacted; no secret reaches a tracker, the store, the stage summaries or the lines. Before:
    MLflow's `phases` param held the options whole."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Judge.seen = []
    secret = "judge-token-5f1c9e"
    monkeypatch.setenv("JUDGE_API_KEY", secret)
    # a copy of the example as the user's own module, importable by the workers through PYTHONPATH
    mine = tmp_path / "mystages"
    mine.mkdir()
    shutil.copy(REPO / "core/examples/judge.py", mine / "myjudge.py")
    monkeypatch.syspath_prepend(str(mine))
    monkeypatch.setenv("PYTHONPATH", f"{mine}:{os.environ.get('PYTHONPATH', '')}")
    try:
        bp = _planted(judge_blueprint(tiny_kit, tmp_path, f"http://127.0.0.1:{server.server_port}/score?token="
                                      f"{PLANTED['query']}", "myjudge:JudgeStage", TRACKED))
        lines: list[str] = []
        results = run_pipeline(bp, "judged", on_line=lines.append)
    finally:
        server.shutdown()
    by_name = {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r for r in results}
    assert list(by_name)[-1] == "user[judge]", "\n".join(lines[-30:])
    samples = pq.read_table(tmp_path / "store/runs/judged/1/rollout/samples.parquet").to_pylist()
    judged = pq.read_table(tmp_path / "store/runs/judged/judge/user/judged.parquet").to_pylist()
    assert len(judged) == len(samples) == len(_Judge.seen) == 4 * 4
    assert [j["judge_score"] for j in judged] == [float(s["response"] == s["ground_truth"]) for s in samples]
    assert all(auth == f"Bearer {secret}" for _, auth in _Judge.seen)
    m = by_name["user[judge]"].manifest
    assert m["inputs"]["rollout"]["stage"] == "runs/judged/1/rollout"
    assert m["metrics"]["judged"] == 16 and 0 <= m["metrics"]["agreement_with_reward"] <= 1
    assert secret not in json.dumps(m) and not any(secret in line for line in lines)
    _assert_no_planted_secret(bp, tmp_path, results, lines, secret)
    # the user's code is part of the key: unchanged, the stage is reused; edited, it (alone) reruns
    steps, _ = checked_plan(bp, "judged", None)
    runs = lambda: steps_that_run(open_store(bp.storage), bp, "judged", steps, [False] * len(steps))  # noqa: E731
    assert not any(runs())
    (mine / "myjudge.py").write_text((mine / "myjudge.py").read_text() + "\n# threshold changed\nCUT = 0.4\n")
    assert runs() == [s.name == "user[judge]" for s in steps]


def _assert_no_planted_secret(bp, folder: Path, results, lines: list[str], env_secret: str) -> None:
    """The options as params, field by field, secrets redacted; then no planted secret, nor the environment's, in
    the MLflow store, the artifact store (manifests, pointers, TensorBoard's events, the ledger), the Prefect
    artifacts' text of each stage and of the run, or the lines."""
    from verlflow.core.redact import REDACTED
    from verlflow.tasks.report import iteration_row, run_summary
    from verlflow.tasks.stages import summary_markdown

    client = mlflow_client(bp)
    (run,) = client.search_runs([client.get_experiment_by_name(bp.name).experiment_id])
    options = {k.removeprefix("phases.1.options."): v for k, v in run.data.params.items()
               if k.startswith("phases.1.options.")}
    assert options == {"url": bp.phases[1].options["url"].replace(PLANTED["query"], REDACTED), "timeout_s": "10",
                       "api_key_env": "JUDGE_API_KEY", "api_key": REDACTED, "headers.X-Hf-Token": REDACTED,
                       "headers.Accept": "json"}, options
    assert run.data.params["storage.endpoint_url"] == f"http://{REDACTED}@127.0.0.1:9"
    assert "phases" not in run.data.params and not any(k.startswith("resources.kubernetes.") for k in run.data.params)

    store = open_store(bp.storage)
    by_name = {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r for r in results}
    texts = {name: summary_markdown(name, r, store, f"runs/judged/{r.manifest['iteration']}/{r.manifest['stage']}")
             for name, r in by_name.items()}
    rows = [iteration_row(1, by_name["rollout[1]"], by_name["update[1]"], by_name.get("export[1]"))]
    texts["run summary"] = run_summary(store, bp, "judged", rows)
    files = [p for p in (folder / "store").rglob("*") if p.is_file()]  # MLflow's database, TensorBoard's events too
    assert {"mlflow.db", "manifest.json"} <= {p.name for p in files} and any("tensorboard" in p.parts for p in files)
    for value in [*PLANTED.values(), env_secret]:
        leaks = [str(p) for p in files if value.encode() in p.read_bytes()]
        leaks += [name for name, text in texts.items() if value in text]
        leaks += [line for line in lines if value in line]
        assert not leaks, (value, leaks)


def test_a_user_stage_reading_a_rollout_before_any_rl_phase_is_refused(tmp_path):
    f = tmp_path / "bp.yaml"
    f.write_text("name: bad\nphases:\n  - kind: evaluate\n  - kind: verlflow.core.examples.judge:JudgeStage\n")
    with pytest.raises(BlueprintError) as e:
        load_blueprint(f, ["eval.files=[t.parquet]"])
    assert f"{f}:4: phases[1].kind: verlflow.core.examples.judge:JudgeStage reads input(s) ['rollout']" in str(e.value)


def test_ls_lists_a_phased_run_in_plan_order(phased, capsys):
    from verlflow.flows.cli import main

    bp, store, res, _ = phased
    assert main(["ls", f"storage.uri={store}", "--run", RUN]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == list(res)


def test_ls_orders_stages_committed_in_one_second_by_their_inputs(phased, tmp_path, capsys):
    """Manifests of older versions have whole-second commit times: a stage and the one reading it (dpo[dpo.2],
    evaluate[tuned] in CI) could share one, and the reader must still come second."""
    from verlflow.flows.cli import main

    _, store, res, _ = phased
    copy = tmp_path / "store"
    shutil.copytree(store / "runs" / RUN, copy / "runs" / RUN, ignore=shutil.ignore_patterns("*.safetensors", "*.distcp"))
    names = list(res)
    second = json.loads((copy / "runs" / RUN / "dpo.2/dpo/manifest.json").read_text())["committed_at"][:19] + "+00:00"
    for name in names[names.index("dpo[dpo.2]"):]:  # the rest of the run in one second
        stage, it = name[:-1].split("[")
        f = copy / "runs" / RUN / it / stage / "manifest.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), "committed_at": second}))
    assert main(["ls", f"storage.uri={copy}", "--run", RUN]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(names)
    key = {f"runs/{RUN}/{n[:-1].split('[')[1]}/{n.split('[')[0]}": n for n in names}
    for name in names:  # every stage after the stages it read
        for src in res[name].manifest["inputs"].values():
            if src["stage"] in key:
                assert listed.index(key[src["stage"]]) < listed.index(name), (src["stage"], name, listed)


def test_the_space_estimate_covers_what_a_phased_run_keeps(phased):
    """validate's space estimate (core/checks/footprint.py) counts the phases' checkpoints: each sft/dpo
    phase's last epochs, the start policies retention keeps, the rl phase's own build. Without them it was below
    what this run's store holds at its end."""
    from verlflow.core.checks.footprint import estimate

    bp, store, _, _ = phased
    held = sum(p.stat().st_size for p in (store / "runs" / RUN).rglob("*") if p.is_file())
    fp = estimate(bp)
    assert fp.term("phase checkpoints").count == 4  # sft's epoch, dpo's last, the one being written, the model's build
    assert held <= fp.total <= 3 * held, (fp.describe(), held)


def test_an_sft_or_dpo_step_retried_after_an_oom_runs_at_half_its_micro_batch(tiny_kit, tmp_path):
    """resources.oom_retry for a phase (memplan.at_half): its rows per micro-batch at half, the other phases and
    the rl sections as they were; the OOM error names the phase's field."""
    from verlflow.core.checks import memplan

    bp = phased_blueprint(tiny_kit, tmp_path)
    for kind in ("sft", "dpo"):
        i = next(i for i, ph in enumerate(bp.phases) if ph.kind == kind)
        half, recorded = memplan.at_half(bp, kind, i)
        assert recorded == {"oom_retries": 1, "micro_batch_size_per_gpu": 4}
        assert half.phases[i].algorithm.micro_batch_size_per_gpu == 4
        assert [p.model_dump() for j, p in enumerate(half.phases) if j != i] == \
               [p.model_dump() for j, p in enumerate(bp.phases) if j != i]
        assert half.algorithm == bp.algorithm
        assert memplan.micro_batch(kind, bp, i).field == f"phases[{i}].algorithm.micro_batch_size_per_gpu"
