"""The blueprint loader: example blueprints, overrides and their types, relative paths, errors that point at the
YAML line or the override, and the JSON Schema the Prefect form shows."""

import json
from pathlib import Path

import pytest

from verlflow.core.blueprint import (
    ADV_ESTIMATORS,
    KL_TYPES,
    Blueprint,
    json_schema,
    load_blueprint,
    parse_override,
)
from verlflow.core.checks.inputs import missing_inputs
from verlflow.core.errors import BlueprintError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "blueprints/gpu-qwen2.5-1.5b.yaml"
TINY = REPO / "blueprints/tiny-cpu.yaml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def error_of(*args, **kw) -> str:
    with pytest.raises(BlueprintError) as e:
        load_blueprint(*args, **kw)
    return str(e.value)


# ---------------------------------------------------------------------------------------------------
# Example blueprints.

def test_gpu_blueprint_passes_schema_validation():
    bp = load_blueprint(GPU)  # schema and cross-field rules only: the model/data placeholders are not checked
    assert bp.name == "qwen2.5-1.5b-gsm8k-grpo"
    assert bp.model.path == "/models/Qwen2.5-1.5B-Instruct"
    assert bp.data.train_files[0].endswith("gsm8k/train.parquet")
    assert bp.reward.function == "verl_default"
    assert (bp.resources.device, bp.resources.nproc_per_node, bp.resources.world_size) == ("cuda", 8, 8)
    assert bp.resources.dist_backend == "cpu:gloo,cuda:nccl"  # CPU-tensor collectives (metrics) need gloo
    assert bp.fsdp.mixed_precision == "bf16" and bp.fsdp.version == 2
    # the fast settings infra/bench/RESULTS.md measured: packed micro-batches, fused head, compile, layer weights
    # kept from forward to backward; the token budget, activation checkpointing and the rollout's rows are the
    # memory plan's to choose per card (core/checks/memplan.py)
    assert bp.algorithm.use_remove_padding and bp.algorithm.ppo_max_token_len_per_gpu == "auto"
    assert bp.algorithm.use_fused_kernels and bp.algorithm.fused_kernels_backend == "triton"
    assert not bp.fsdp.reshard_after_forward
    assert bp.fsdp.compile and bp.fsdp.activation_checkpointing == "auto" and bp.rollout.micro_batch_size == "auto"
    assert bp.rollout.engine == "static" and bp.resources.warm_workers
    a, r = bp.algorithm, bp.rollout
    assert (a.adv_estimator, a.lr, r.n) == ("grpo", 1e-6, 5)
    assert isinstance(a.lr, float)
    assert (a.use_kl_loss, a.kl_loss_type, a.kl_loss_coef) == (True, "low_var_kl", 0.001)
    assert (bp.data.max_prompt_length, r.max_new_tokens) == (512, 1024)
    # the batch arithmetic holds at 8 ranks: mini-batch divides the batch, micro-batch divides a rank's share
    assert bp.data.batch_size % a.ppo_mini_batch_size == 0
    per_rank = a.ppo_mini_batch_size * r.n // bp.resources.world_size
    assert per_rank % a.ppo_micro_batch_size_per_gpu == 0
    assert Path(bp.storage.uri).is_absolute()  # relative to the blueprint's folder


def test_gpu_blueprint_rejects_a_world_it_does_not_fit():
    msg = error_of(GPU, ["resources.nproc_per_node=3"])
    assert "must divide across 3 ranks" in msg


@pytest.mark.parametrize("sampling", [["rollout.top_p=0.9"], ["rollout.top_k=20"]])
def test_rollout_old_logprobs_refuse_truncated_sampling(sampling):
    """The rollout's log-probs are log_softmax(logits / T): not what top-p / top-k sampling drew from."""
    with pytest.raises(BlueprintError) as e:
        load_blueprint(None, ["algorithm.old_logprobs=rollout", *sampling])
    msg = str(e.value)
    assert "algorithm.old_logprobs=rollout" in msg and "rollout.top_p" in msg and "rollout.top_k" in msg
    assert "algorithm.old_logprobs=recompute" in msg  # the fix
    assert load_blueprint(None, sampling).algorithm.old_logprobs == "recompute"  # recompute: any sampling
    assert load_blueprint(None, ["algorithm.old_logprobs=rollout"]).rollout.top_p == 1.0


def test_tiny_blueprint_resolves_paths_against_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository
    bp = load_blueprint(TINY)
    assert bp.model.path == str(REPO / "tiny/qwen2/model")
    assert bp.data.train_files == [str(REPO / "tiny/qwen2/data/train.parquet")]
    assert bp.storage.uri == str(REPO / "artifacts")


def test_embedded_defaults_are_valid():
    bp = load_blueprint()
    assert bp.name == "tiny-grpo" and bp.resources.world_size == 2
    assert load_blueprint(data={"rollout": {"n": 8}}).rollout.n == 8


# ---------------------------------------------------------------------------------------------------
# Paths and overrides.

def test_relative_paths_resolve_against_the_file_folder(tmp_path, monkeypatch):
    f = write(tmp_path / "conf/bp.yaml", "model:\n  path: ../models/m\n"
                                         "data:\n  train_files: [d/a.parquet, /abs/b.parquet]\n"
                                         "storage:\n  uri: s3://bucket/prefix\n")
    monkeypatch.chdir(REPO)
    bp = load_blueprint(f)
    assert bp.model.path == str(tmp_path / "models/m")
    assert bp.data.train_files == [str(tmp_path / "conf/d/a.parquet"), "/abs/b.parquet"]
    assert bp.storage.uri == "s3://bucket/prefix"


def test_file_uri_and_relative_store_folder(tmp_path):
    f = write(tmp_path / "bp.yaml", "storage:\n  uri: out/store\n")
    assert load_blueprint(f).storage.uri == str(tmp_path / "out/store")
    assert load_blueprint(f, ["storage.uri=file:///x/y"]).storage.uri == "file:///x/y"


@pytest.mark.parametrize("uri, what", [
    ("s3://bucket/team-a/../../team-b", "'..' segments"), ("s3://bucket/team-a/./x", "'.' segments"),
    ("s3://bucket/team-a//x", "empty ('//') segments"), ("file:///srv/team-a/../team-b", "'..' segments"),
    ("file://srv/store", "is relative to the current folder"), ("s3:///team-a", "starts with its bucket")])
def test_a_store_uri_must_name_one_place(tmp_path, capsys, uri, what):
    """A file:// or s3:// storage.uri is the literal prefix of every key: one with '..' (or '.', '//') is refused at
    load, naming storage.uri and the line, and the CLI touches no store (before: validated, then used as
    s3://bucket/team-a/../../team-b/_probe/...)."""
    from verlflow.flows.cli import main

    f = write(tmp_path / "bp.yaml", f"name: x\nstorage:\n  uri: {uri}\n")
    assert f"{f}:3: storage.uri: " in error_of(f) and what in error_of(f)
    for argv in (["validate-blueprint", str(f)], ["run", str(f), "--run-id", "r"]):
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert "storage.uri: " in err and what in err and "Traceback" not in err, err


def test_a_plain_store_folder_may_climb_from_the_blueprints_folder(tmp_path):
    """A plain folder path is resolved against the blueprint's folder, `..` included: the folder it names is the
    store's root, and its keys stay under it."""
    f = write(tmp_path / "exp/bp.yaml", "storage:\n  uri: ../artifacts\n")
    assert load_blueprint(f).storage.uri == str(tmp_path / "artifacts")
    for fine in ("s3://bucket/team-a/", "file:///srv/team-a", "/srv/team-a/../team-b"):
        assert load_blueprint(f, [f"storage.uri={fine}"]).storage.uri == fine


def test_overrides_apply_to_nested_fields_with_types(tmp_path):
    f = write(tmp_path / "bp.yaml", "rollout:\n  temperature: 1.0\nfsdp:\n  version: 2\n")
    bp = load_blueprint(f, ["rollout.temperature=0.7", "fsdp.version=1", "model.trust_remote_code=true",
                            "data.train_files=[a.parquet, b.parquet]", "schedule.cron=0 3 * * *",
                            "algorithm.betas=[0.9, 0.95]", "iterations=5", "name=run-2"])
    assert bp.rollout.temperature == 0.7 and isinstance(bp.rollout.temperature, float)
    assert bp.fsdp.version == 1 and isinstance(bp.fsdp.version, int)
    assert bp.model.trust_remote_code is True
    assert bp.data.train_files == [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    assert bp.schedule.cron == "0 3 * * *"  # a section the file does not have
    assert bp.algorithm.betas == (0.9, 0.95)
    assert (bp.iterations, bp.name) == (5, "run-2")
    # untouched fields keep their defaults; the last override of a key wins
    assert bp.rollout.n == Blueprint().rollout.n
    assert load_blueprint(f, ["rollout.n=2", "rollout.n=6"]).rollout.n == 6


@pytest.mark.parametrize("text, path, value", [
    ("rollout.n=8", ["rollout", "n"], 8),
    ("rollout.temperature=0.7", ["rollout", "temperature"], 0.7),
    ("model.path=", ["model", "path"], ""),
    ("schedule.cron='0 3 * * *'", ["schedule", "cron"], "0 3 * * *"),
    ("data.train_files=[a, b]", ["data", "train_files"], ["a", "b"]),
    (" rollout . n =3", ["rollout", "n"], 3),
])
def test_parse_override(text, path, value):
    assert parse_override(text) == (path, value)


def test_override_error_names_the_override_not_a_file_line(tmp_path):
    f = write(tmp_path / "bp.yaml", "name: x\nrollout:\n  n: 4\n")
    msg = error_of(f, ["rollout.top_p=1.5"])
    assert "override 'rollout.top_p=1.5': rollout.top_p: Input should be less than or equal to 1" in msg
    assert "bp.yaml:2" not in msg
    msg = error_of(f, ["rollout.n=0"])  # the file has rollout.n; the value at fault came from the override
    assert "override 'rollout.n=0': rollout.n" in msg


# ---------------------------------------------------------------------------------------------------
# Errors that point at the YAML.

def test_errors_name_line_field_and_allowed_values(tmp_path):
    f = write(tmp_path / "bp.yaml", "name: x\nalgorithm:\n  lr: 0.1\n  kl_loss_type: k9\nrollout:\n  top_p: 2\n")
    msg = error_of(f)
    assert f"{f}:4: algorithm.kl_loss_type: Input should be 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl' or 'k3' " \
           "(got 'k9')" in msg
    assert f"{f}:6: rollout.top_p: Input should be less than or equal to 1 (got 2)" in msg  # every problem at once


def test_cross_field_rule_is_reported_without_a_misleading_line(tmp_path):
    f = write(tmp_path / "bp.yaml", "name: x\nalgorithm:\n  ppo_mini_batch_size: 3\n")
    msg = error_of(f)
    assert f"{f}: algorithm.ppo_mini_batch_size=3 must divide data.batch_size=8" in msg
    assert "(top level)" not in msg and f"{f}:1" not in msg


def test_duplicate_keys_are_refused(tmp_path):
    f = write(tmp_path / "bp.yaml", "name: x\nrollout:\n  n: 4\n  temperature: 1.0\n  n: 8\nname: y\n")
    msg = error_of(f)
    assert f"{f}:5: rollout.n: duplicate key (first given on line 3)" in msg
    assert f"{f}:6: name: duplicate key (first given on line 1)" in msg


def test_python_tags_are_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    f = write(tmp_path / "bp.yaml", f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    msg = error_of(f)
    assert f"{f}:1: not valid YAML" in msg and "python/object/apply:os.system" in msg
    assert not marker.exists()
    f = write(tmp_path / "bp2.yaml", "model: !!python/object:verlflow.core.blueprint.ModelSpec {path: x}\n")
    assert "could not determine a constructor" in error_of(f)


@pytest.mark.parametrize("text, expect", [
    ("seed: 2024-01-01\n", "seed: Input should be a valid integer"),  # a YAML date
    ("name: !!binary aGVsbG8=\n", "name: String should match pattern"),  # bytes
    ("data:\n  train_files: !!set {a: null}\n", "data.train_files: Input should be a valid list"),
    ("algorithm:\n  lr: .nan\n", "algorithm.lr: Input should be a finite number"),
    ("algorithm:\n  lr: .inf\n", "algorithm.lr: Input should be a finite number"),
    ("rollout:\n", "rollout: must be a mapping of fields (key: value lines), not an empty value"),
    ("rollout: [1, 2]\n", "rollout: must be a mapping of fields (key: value lines), not a YAML list"),
    ("reward:\n  function: {a: b}\n", "reward.function: Input should be a valid string (got a YAML mapping; quote"),
    ("data:\n  train_files: []\n", "data.train_files: List should have at least 1 item"),
    ("name: 'a/b'\n", "name: String should match pattern"),
    ("storage:\n  keep_last: 0\n", "storage.keep_last: Input should be greater than or equal to 1"),
    ("resources:\n  backend: ray\n", "resources.backend: Input should be 'local', 'slurm' or 'kubernetes' (got 'ray')"),
    ("schedule:\n  init_from: last\n", "schedule.init_from: Input should be 'base' or 'previous'"),
])
def test_odd_yaml_values_get_a_clear_validation_error(tmp_path, text, expect):
    f = write(tmp_path / "bp.yaml", text)
    assert expect in error_of(f)


def test_not_utf8_and_missing_file(tmp_path):
    f = tmp_path / "bp.yaml"
    f.write_bytes(b"\xff\xfe\x00bad")
    assert "not a UTF-8 text file" in error_of(f)
    assert "no such blueprint file" in error_of(tmp_path / "nope.yaml")
    assert "no such blueprint file" in error_of(tmp_path)  # a folder


# ---------------------------------------------------------------------------------------------------
# Inputs (no torch import) and the schema.

def test_missing_inputs_of_the_kit_blueprint_is_empty(tiny_kit, tmp_path):
    bp = load_blueprint(TINY, [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
                               f"eval.files=[{tiny_kit['test_file']}]"])
    assert missing_inputs(bp) == []
    bp = load_blueprint(GPU, [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
                              f"storage.uri={tmp_path}"])
    assert missing_inputs(bp) == []


def test_missing_inputs_lists_every_problem(tmp_path):
    bp = load_blueprint(data={"model": {"path": str(tmp_path / "m")}, "data": {"train_files": [str(tmp_path / "d")]},
                              "reward": {"function": "nope"}, "storage": {"uri": "gs://b/p"}})
    problems = missing_inputs(bp)
    assert [p.split(":", 1)[0] for p in problems] == ["model.path", "data.train_files[0]", "reward.function",
                                                      "storage.uri"]


def test_json_schema_has_descriptions_enums_and_plain_defaults():
    schema = json_schema()
    json.dumps(schema)
    defs = schema["$defs"]
    adv = defs["AlgorithmSpec"]["properties"]["adv_estimator"]
    assert tuple(adv["enum"]) == ADV_ESTIMATORS and adv["default"] == "grpo" and adv["description"]
    assert tuple(defs["AlgorithmSpec"]["properties"]["kl_loss_type"]["enum"]) == KL_TYPES
    assert defs["FSDPSpec"]["properties"]["version"]["enum"] == [1, 2]
    assert defs["RolloutSpec"]["properties"]["top_p"]["maximum"] == 1.0
    for name, d in defs.items():
        assert d.get("additionalProperties") is False, name
        for prop, spec in d["properties"].items():
            assert "default" in spec, f"{name}.{prop} has no plain default (the Prefect form would not show it)"
    for section in ("model", "data", "reward", "algorithm", "rollout", "fsdp", "resources", "storage", "schedule"):
        assert "default" in schema["properties"][section], section


@pytest.mark.parametrize("resources", [["resources.backend=slurm"],
                                       ["resources.backend=kubernetes", "resources.kubernetes.image=r/v:1"],
                                       ["resources.nnodes=2", "resources.rdzv_endpoint=h:29400"]])
def test_warm_workers_are_refused_where_no_pool_serves_them(resources):
    """A warm pool is one local torchrun job on one node: other backends and multi-node runs are refused up front
    (they used to validate and then run their stages in a local pool), with the fix."""
    msg = error_of(None, ["resources.warm_workers=true", *resources])
    assert "resources.warm_workers: true is served by backend local on one node only" in msg
    backend = resources[0].removeprefix("resources.backend=") if "backend" in resources[0] else "local"
    assert f"resources.backend={backend}" in msg and "resources.nnodes=" in msg
    assert "set resources.warm_workers: false" in msg
    assert not load_blueprint(None, ["resources.warm_workers=false", *resources]).resources.warm_pool


def test_the_example_blueprints_use_the_warm_pool_they_ask_for():
    for f in (TINY, GPU):
        res = load_blueprint(f).resources
        assert res.warm_workers and res.warm_pool, f
    assert not Blueprint().resources.warm_pool  # warm_workers defaults to off


def undescribed(schema: dict, where: str = "") -> list[str]:
    """Every property, at any depth (sections, $defs, items), that has no description."""
    missing = []
    for name, spec in schema.get("properties", {}).items():
        if not spec.get("description"):
            missing.append(f"{where}{name}")
        missing += undescribed(spec, f"{where}{name}.")
    for name, sub in {**schema.get("$defs", {}), **schema.get("definitions", {})}.items():
        missing += undescribed(sub, f"{name}:")
    return missing


def test_every_field_of_the_schema_has_a_description_and_optionals_are_labelled():
    schema = json_schema()
    assert undescribed(schema) == []
    region = schema["$defs"]["StorageSpec"]["properties"]["region"]["anyOf"]
    assert [b["title"] for b in region] == ["set", "none"]  # the form's toggle, not `str | None`
    res = schema["$defs"]["ResourcesSpec"]["properties"]
    assert "only for backend: slurm" in res["slurm"]["description"].lower()
    assert "only for backend: kubernetes" in res["kubernetes"]["description"].lower()
