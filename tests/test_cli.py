"""Bad input through the real `verlflow` CLI: a table of cases, each refused with one clear message.

Every case asserts: exit code != 0; exactly one `verlflow ...: error:` paragraph on stderr that names the field
or file and says what is allowed or how to fix it; no Python traceback; nothing on stdout; and nothing written
to the artifact store (storage.uri points at a folder under tmp_path that must not exist afterwards).

Most cases call `verlflow.flows.cli.main()` in-process (fast); the ones marked `sub=True` run the installed console
script as a subprocess, as a user would.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.numpy import save_file

from verlflow.core.blueprint import ADV_ESTIMATORS
from verlflow.core.ml import rewards
from verlflow.flows.cli import main, parser
from s3server import FAKE_SECRET
from tinybp import prompt_rows

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
VERLFLOW = str(Path(sys.executable).with_name("verlflow"))
VERBS = tuple(next(a for a in parser()._actions if a.dest == "verb").choices)

# The base blueprint every case starts from: valid as it is (test_base_blueprint_is_valid). Line numbers
# matter: cases assert them (`bp.yaml:10` is `  adv_estimator: grpo`).
BASE = """\
name: bad-input
model:
  path: model
data:
  train_files: [data/train.parquet]
  batch_size: 8
reward:
  function: exact_match
algorithm:
  adv_estimator: grpo
  ppo_mini_batch_size: 4
  ppo_micro_batch_size_per_gpu: 4
rollout:
  n: 4
resources:
  nproc_per_node: 2
storage:
  uri: store
iterations: 1
"""

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


# ---------------------------------------------------------------------------------------------------
# Inputs the cases point at.

def write_parquet(path: Path, columns: dict, schema: Optional[pa.Schema] = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)


def drop_column(name: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        cols = prompt_rows()
        del cols[name]
        write_parquet(tmp / "data/train.parquet", cols)
    return setup


def empty_dataset(tmp: Path) -> None:
    schema = pa.table(prompt_rows(1)).schema
    write_parquet(tmp / "data/train.parquet", {k: [] for k in prompt_rows(1)}, schema=schema)


def prompt_is_int(tmp: Path) -> None:
    write_parquet(tmp / "data/train.parquet", {**prompt_rows(), "prompt": [1, 2, 3]})


def reward_model_is_str(tmp: Path) -> None:
    write_parquet(tmp / "data/train.parquet", {**prompt_rows(), "reward_model": ["11", "22", "33"]})


def dataset_not_parquet(tmp: Path) -> None:
    (tmp / "data/train.parquet").write_text("prompt,answer\nWrite 7 twice.,77\n")


def model_without_config(tmp: Path) -> None:
    (tmp / "model/config.json").unlink()


def model_without_weights(tmp: Path) -> None:
    (tmp / "model/model.safetensors").unlink()


def model_without_tokenizer_config(tmp: Path) -> None:
    (tmp / "model/tokenizer_config.json").unlink()


def model_is_a_file(tmp: Path) -> None:
    shutil.rmtree(tmp / "model")
    (tmp / "model").write_text("not a folder")


def binary_blueprint(tmp: Path) -> None:
    (tmp / "bp.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary")


def reward_module_raises(tmp: Path) -> None:
    (tmp / "broken_rewards_mod.py").write_text("raise RuntimeError('boom at import')\n")


# ---------------------------------------------------------------------------------------------------
# The table.

@dataclass
class Case:
    id: str
    args: list  # after the verb; "@BP@" is the blueprint file, "@TMP@" the case's folder
    expect: list  # substrings stderr must hold: the field or file, and the allowed values / the fix
    verb: str = "validate-blueprint"
    replace: tuple = ()  # (old, new) pairs applied to BASE
    text: Optional[str] = None  # the whole blueprint text instead of BASE
    setup: Optional[Callable[[Path], None]] = None
    sub: bool = False  # run the console script as a subprocess
    absent: list = field(default_factory=list)  # substrings that must NOT appear anywhere (secrets)


BP = ["@BP@"]
C = Case
CASES = [
    # -- YAML syntax and safety
    C("yaml-tab-indent", BP, ["bp.yaml:3", "not valid YAML", "indentation"],
      replace=[("\n  path: model", "\n\tpath: model")], sub=True),
    C("yaml-unclosed-bracket", BP, ["bp.yaml:", "not valid YAML", "check indentation and quoting"],
      replace=[("[data/train.parquet]", "[data/train.parquet")]),
    C("yaml-duplicate-key", BP, ["bp.yaml:15", "rollout.n: duplicate key", "line 14", "keep one"],
      replace=[("  n: 4\n", "  n: 4\n  n: 8\n")]),
    C("yaml-duplicate-section", BP, ["bp.yaml:20", "model: duplicate key", "line 2"],
      text=BASE + "model:\n  path: x\n"),
    C("yaml-mapping-in-scalar", BP, ["bp.yaml:14", "not valid YAML", "mapping values are not allowed"],
      replace=[("  n: 4", "  n: 4: 5")]),
    C("yaml-two-documents", BP, ["bp.yaml:", "not valid YAML", "single document"], text=BASE + "---\nseed: 1\n"),
    C("yaml-python-tag", BP, ["bp.yaml:1", "python/object/apply:os.system", "no !!python tags"],
      text="name: !!python/object/apply:os.system ['touch @TMP@/pwned']\n", sub=True),
    C("yaml-not-utf8", BP, ["bp.yaml", "not a UTF-8 text file"], setup=binary_blueprint),
    C("yaml-top-level-list", BP, ["bp.yaml", "top level must be a mapping"],
      text="- model: {path: model}\n- seed: 1\n"),
    C("yaml-top-level-scalar", BP, ["bp.yaml", "top level must be a mapping"], text="just a string\n"),
    C("blueprint-file-missing", ["@TMP@/nope.yaml"], ["nope.yaml: no such blueprint file", "blueprints/tiny-cpu.yaml"]),
    # -- keys
    C("unknown-top-level-key", BP, ["bp.yaml:20", "modle", "Did you mean 'model'?", "Allowed keys here"],
      text=BASE + "modle:\n  path: x\n"),
    C("unknown-nested-key", BP, ["bp.yaml:10", "algorithm.adv_estimatr", "Did you mean 'adv_estimator'?"],
      replace=[("adv_estimator: grpo", "adv_estimatr: grpo")], sub=True),
    C("unknown-nested-key-no-close-match", BP, ["bp.yaml:16", "resources.gpus", "Allowed keys here", "nproc_per_node"],
      replace=[("resources:\n", "resources:\n  gpus: 8\n")]),
    # -- types
    C("string-for-int", BP, ["bp.yaml:14", "rollout.n", "valid integer", "'four'"], replace=[("n: 4", "n: four")]),
    C("float-for-int", BP, ["bp.yaml:14", "rollout.n", "fractional part", "4.5"], replace=[("n: 4", "n: 4.5")]),
    C("list-for-section", BP, ["bp.yaml:9", "algorithm", "mapping of fields", "adv_estimator"],
      replace=[("algorithm:\n  adv_estimator: grpo\n  ppo_mini_batch_size: 4\n  ppo_micro_batch_size_per_gpu: 4\n",
                "algorithm: [grpo]\n")]),
    C("dict-for-list", BP, ["bp.yaml:5", "data.train_files", "valid list"],
      replace=[("[data/train.parquet]", "{a: data/train.parquet}")]),
    C("date-for-int", BP, ["bp.yaml:20", "seed", "valid integer", "2024-01-01"], text=BASE + "seed: 2024-01-01\n"),
    C("bad-run-name", BP, ["bp.yaml:1", "name", "should match pattern", "'my run'"], replace=[("bad-input", "my run")]),
    C("empty-train-files", BP, ["bp.yaml:5", "data.train_files", "at least 1 item"],
      replace=[("[data/train.parquet]", "[]")]),
    # -- ranges and allowed values
    C("negative-lr", ["@BP@", "algorithm.lr=-1e-6"],
      ["override 'algorithm.lr=-1e-6'", "algorithm.lr", "greater than 0"]),
    C("infinite-lr", ["@BP@", "algorithm.lr=.inf"], ["algorithm.lr", "finite number"]),
    C("top-p-above-1", ["@BP@", "rollout.top_p=1.5"], ["rollout.top_p", "less than or equal to 1", "1.5"]),
    C("n-zero", BP, ["bp.yaml:14", "rollout.n", "greater than or equal to 1", "(got 0)"], replace=[("n: 4", "n: 0")]),
    C("clip-ratio-c-not-above-1", ["@BP@", "algorithm.clip_ratio_c=1.0"], ["algorithm.clip_ratio_c", "greater than 1"]),
    C("unknown-estimator", BP,
      ["bp.yaml:10", "algorithm.adv_estimator", "'grpo', 'grpo_vectorized'", "'remax'", "or 'gae'", "'gpro'"],
      replace=[("adv_estimator: grpo", "adv_estimator: gpro")], sub=True),
    C("unknown-policy-loss", ["@BP@", "algorithm.policy_loss=clip_cov2"], ["algorithm.policy_loss", "'vanilla'",
                                                                           "'clip_cov'", "'clip_cov2'"]),
    C("unknown-kl-type", ["@BP@", "algorithm.kl_loss_type=k9"], ["algorithm.kl_loss_type", "'low_var_kl'", "'k9'"]),
    C("unknown-kl-penalty", ["@BP@", "algorithm.kl_penalty=big"], ["algorithm.kl_penalty", "'low_var_kl'"]),
    C("fsdp-version-3", ["@BP@", "fsdp.version=3"], ["fsdp.version", "Input should be 1 or 2", "(got 3)"]),
    C("unknown-mixed-precision", ["@BP@", "fsdp.mixed_precision=fp8"],
      ["fsdp.mixed_precision", "'fp32', 'bf16' or 'fp16'"]),
    C("unknown-device", ["@BP@", "resources.device=tpu"], ["resources.device", "'cpu' or 'cuda'"]),
    C("unknown-sharding-strategy", ["@BP@", "fsdp.sharding_strategy=ZERO3"],
      ["fsdp.sharding_strategy", "'FULL_SHARD'"]),
    # -- batch sizes against the world size
    C("mini-batch-not-dividing-batch", ["@BP@", "algorithm.ppo_mini_batch_size=3"],
      ["algorithm.ppo_mini_batch_size=3 must divide data.batch_size=8"]),
    C("samples-not-dividing-ranks", ["@BP@", "resources.nproc_per_node=3"],
      ["algorithm.ppo_mini_batch_size x rollout.n = 16 samples must divide across 3 ranks", "nproc_per_node"]),
    C("micro-batch-not-dividing", ["@BP@", "algorithm.ppo_micro_batch_size_per_gpu=3"],
      ["algorithm.ppo_micro_batch_size_per_gpu=3 must divide the 8 samples each rank gets"]),
    C("grpo-with-n-1", ["@BP@", "rollout.n=1", "algorithm.ppo_micro_batch_size_per_gpu=2"],
      ["algorithm.adv_estimator=grpo needs rollout.n >= 2"]),
    # -- overrides
    C("override-without-value", ["@BP@", "rollout.n"], ["override 'rollout.n'", "section.field=value", "rollout.n=8"]),
    C("override-without-key", ["@BP@", "=3"], ["override '=3'", "section.field=value"]),
    C("override-bad-yaml-value", ["@BP@", "rollout.n=["], ["override 'rollout.n=['", "not valid YAML"]),
    C("override-empty-key-part", ["@BP@", "rollout..n=3"], ["override 'rollout..n=3'", "empty part"]),
    C("override-unknown-key", ["@BP@", "rollout.nn=3"], ["override 'rollout.nn=3'", "rollout.nn", "Did you mean 'n'?"]),
    C("override-into-a-value", ["@BP@", "iterations.x=3"],
      ["override 'iterations.x=3'", "'iterations' is not a section"]),
    C("override-section-with-scalar", ["@BP@", "rollout=5"], ["override 'rollout=5'", "rollout", "mapping of fields"]),
    # -- files and folders the blueprint names
    C("model-path-missing", ["@BP@", "model.path=no/such/model"], ["model.path", "no/such/model is not a folder",
                                                                   "make-tiny"], sub=True),
    C("model-path-is-a-file", BP, ["model.path", "is not a folder"], setup=model_is_a_file),
    C("model-without-config", BP, ["model.path", "has no config.json", "save_pretrained"], setup=model_without_config),
    # refused before any stage job since the model folder is checked in one place (the validate stage's check)
    C("model-without-weights", BP, ["model.path=@TMP@/model", "no weights (*.safetensors)", "save_pretrained"],
      setup=model_without_weights),
    C("model-without-tokenizer-config", BP, ["model.path=@TMP@/model", "tokenizer_config.json is missing"],
      setup=model_without_tokenizer_config),
    C("data-file-missing", ["@BP@", "data.train_files=[data/nope.parquet]"],
      ["data.train_files[0]", "data/nope.parquet does not exist", "verl's RL schema"]),
    C("dataset-missing-reward-column", BP, ["data.train_files", "train.parquet", "lacks column(s) ['reward_model']"],
      setup=drop_column("reward_model")),
    C("dataset-missing-prompt-key", ["@BP@", "data.prompt_key=question"],
      ["data.train_files", "lacks column(s) ['question']", "data.prompt_key"]),
    C("dataset-empty", BP, ["data.train_files", "train.parquet", "has no rows"], setup=empty_dataset),
    C("dataset-prompt-wrong-type", BP, ["data.train_files", "row 0", "'prompt' must be a list of {role, content}",
                                        "got int"], setup=prompt_is_int),
    C("dataset-reward-model-wrong-type", BP, ["data.train_files", "row 0", "reward_model must be a struct with "
                                              "ground_truth"], setup=reward_model_is_str),
    C("dataset-not-parquet", BP, ["data.train_files", "train.parquet", "not a readable parquet file"],
      setup=dataset_not_parquet, sub=True),
    # -- reward
    C("unknown-reward-name", ["@BP@", "reward.function=no_such_reward"],
      ["reward.function", "unknown reward function 'no_such_reward'", "Known: ", "exact_match", "register_reward"]),
    C("reward-module-not-importable", ["@BP@", "reward.module=no_such_module_xyz"],
      ["reward.module", "cannot import 'no_such_module_xyz'", "No module named", "PYTHONPATH"]),
    C("reward-module-raises", ["@BP@", "reward.module=broken_rewards_mod"],
      ["reward.module", "broken_rewards_mod", "RuntimeError: boom at import"], setup=reward_module_raises),
    C("reward-function-bad-attribute", ["@BP@", "reward.function=json:no_such_fn"],
      ["reward.function", "module 'json' has no attribute 'no_such_fn'"]),
    C("reward-function-bad-form", ["@BP@", "reward.function='json:'"],
      ["reward.function", "'json:' is not of the form 'package.module:function'"]),
    C("override-value-parsed-as-mapping", ["@BP@", "reward.function=json:"],
      ["override 'reward.function=json:'", "reward.function", "valid string (got a YAML mapping; quote the value"]),
    # -- storage
    C("storage-scheme-gs", ["@BP@", "storage.uri=gs://bucket/prefix"],
      ["storage.uri", "scheme 'gs://' is not supported", "s3://bucket/prefix"]),
    C("storage-s3-with-credentials", ["@BP@", f"storage.uri=s3://AKIAEXAMPLE:{SECRET}@bucket/prefix"],
      ["storage.uri", "must not carry credentials", "AWS_SECRET_ACCESS_KEY"], absent=[SECRET], sub=True),
    # the same check as storage.uri's, for the blueprint file's own URI (it was read, and echoed, with the secret)
    C("blueprint-uri-with-credentials", [f"s3://AKIAEXAMPLE:{SECRET}@bucket/exp/bp.yaml"],
      ["blueprint URI", "must not carry credentials", "AWS_SECRET_ACCESS_KEY"], absent=[SECRET]),
    # -- CLI misuse
    C("unknown-verb", [], ["invalid choice: 'frobnicate'", "validate-blueprint"], verb="frobnicate", sub=True),
    C("no-verb", [], ["the following arguments are required: verb"], verb=""),
    C("unknown-option", ["@BP@", "--bogus"], ["unrecognized arguments: --bogus"]),
    C("show-missing-stage-argument", [], ["the following arguments are required: stage\n"], verb="show"),
    C("rerun-missing-run-argument", [], ["the following arguments are required: run\n"], verb="rerun"),
    C("make-tiny-missing-out", [], ["the following arguments are required: out"], verb="make-tiny"),
    C("make-tiny-unknown-arch", ["@TMP@/kit", "--arch", "gpt2"], ["--arch", "invalid choice: 'gpt2'", "'qwen2'"],
      verb="make-tiny"),
    C("show-uncommitted-stage", ["runs/r1/1/rollout", "@BP@"], ["runs/r1/1/rollout", "no committed stage there",
                                                                "verlflow ls --run"], verb="show", sub=True),
    C("show-unsafe-stage-path", ["../../etc", "@BP@"], ["'../../etc' is refused", "'..'"], verb="show"),
    C("ls-unsafe-run", ["@BP@", "--run", "../x"], ["--run '../x' is refused", "[A-Za-z0-9][A-Za-z0-9._-]*"], verb="ls"),
    C("run-bad-run-id", ["@BP@", "--run-id", "../x"], ["--run-id '../x' is refused", "[A-Za-z0-9][A-Za-z0-9._-]*"],
      verb="run", sub=True),
    C("run-run-id-with-space", ["@BP@", "--run-id", "my run"], ["--run-id 'my run' is refused"], verb="run"),
    C("rerun-bad-run-id", ["../x", "@BP@"], ["rerun RUN '../x' is refused"], verb="rerun"),
    C("run-bad-from", ["@BP@", "--from", "bogus"], ["--from bogus: no such step", "update[1]"], verb="run"),
    # A run id longer than a file name may be (it was an OSError traceback from a rank): refused with the limit.
    C("run-id-too-long", ["@BP@", "--run-id", "r" * 300], ["--run-id rrrr", "300 characters", "at most 128",
                                                             "letters, digits, '.', '_' or '-'"], verb="run"),
    C("rerun-run-id-too-long", ["r" * 129, "@BP@"], ["rerun RUN rrrr", "129 characters", "at most 128"], verb="rerun",
      sub=True),
    C("ls-run-id-too-long", ["@BP@", "--run", "r" * 300], ["--run rrrr", "at most 128"], verb="ls"),
    C("verify-run-id-too-long", ["r" * 300, "@BP@"], ["verify RUN rrrr", "at most 128"], verb="verify"),
    C("run-missing-model", ["@BP@", "model.path=nope"], ["model.path", "is not a folder"], verb="run"),
    C("run-bad-yaml", BP, ["bp.yaml:14", "rollout.n", "valid integer"], replace=[("n: 4", "n: four")], verb="run"),
    C("run-store-under-a-file", ["@BP@", "storage.uri=blocker/store"],
      ["Artifact store could not write", "blocker/store", "regular file, not a folder"], verb="run",
      setup=lambda tmp: (tmp / "blocker").write_text("a file")),
]


# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def case_dir(tmp_path, monkeypatch):
    """A folder with a valid blueprint's inputs: a model folder (config, weights, tokenizer config) and
    data/train.parquet. cwd is there."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp_path / "model/model.safetensors"))
    (tmp_path / "model/tokenizer_config.json").write_text("{}")
    write_parquet(tmp_path / "data/train.parquet", prompt_rows(8))  # data.batch_size: 8
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # reward.module cases import from here (in-process)
    saved = dict(rewards._REGISTRY)
    yield tmp_path
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


def _sub(tmp: Path, s: str) -> str:
    return s.replace("@BP@", str(tmp / "bp.yaml")).replace("@TMP@", str(tmp))


def run_cli(argv: list, tmp: Path, capsys, sub: bool) -> tuple[int, str, str]:
    if sub:
        env = {**os.environ, "PYTHONPATH": str(tmp), "HF_HUB_OFFLINE": "1"}
        p = subprocess.run([VERLFLOW, *argv], cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout, p.stderr
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly(case: Case, case_dir: Path, capsys):
    tmp = case_dir
    text = case.text if case.text is not None else BASE
    for old, new in case.replace:
        assert old in text, f"case {case.id}: {old!r} is not in the base blueprint"
        text = text.replace(old, new)
    (tmp / "bp.yaml").write_text(_sub(tmp, text))
    if case.setup:
        case.setup(tmp)
    argv = ([case.verb] if case.verb else []) + [_sub(tmp, a) for a in case.args]

    rc, out, err = run_cli(argv, tmp, capsys, case.sub)

    assert rc not in (0, None), f"exit code {rc}; stderr:\n{err}"
    assert "Traceback" not in err + out, err
    assert out == "", f"stdout should be empty, got:\n{out}"
    headers = re.findall(r"^verlflow[\w -]*: error: ", err, re.M)
    assert len(headers) == 1, f"expected one error paragraph, got {len(headers)}:\n{err}"
    for s in case.expect:
        assert _sub(tmp, s) in err, f"{s!r} not in stderr:\n{err}"
    for s in case.absent:
        assert s not in err + out, f"{s!r} leaked:\n{err}"
    store = tmp / "store"
    assert not store.exists() or not any(store.iterdir()), f"the store was written: {list(store.rglob('*'))}"
    assert not (tmp / "pwned").exists(), "a YAML tag ran code"
    assert not (tmp / "kit").exists(), "make-tiny wrote a kit"
    if case.id == "run-store-under-a-file":
        assert (tmp / "blocker").read_text() == "a file"


def test_enough_cases():
    assert len(CASES) >= 40
    assert sum(c.sub for c in CASES) >= 5
    assert len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------------------------------
# What works.

def test_base_blueprint_is_valid(case_dir: Path, capsys):
    """The base of the table is valid, so each case fails for the one reason it changes."""
    (case_dir / "bp.yaml").write_text(BASE)
    rc, out, err = run_cli(["validate-blueprint", str(case_dir / "bp.yaml")], case_dir, capsys, sub=False)
    assert rc == 0, err
    assert ": ok (bad-input, 1 iterations, 2 ranks on cpu" in out
    assert not (case_dir / "store").exists()


def test_reward_registered_by_module_validates(case_dir: Path, capsys):
    (case_dir / "my_rewards_ok.py").write_text(
        "from verlflow.core.ml.rewards import register_reward\n\n"
        "@register_reward('my_reward')\n"
        "def my_reward(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    (case_dir / "bp.yaml").write_text(BASE)
    rc, out, err = run_cli(["validate-blueprint", str(case_dir / "bp.yaml"), "reward.module=my_rewards_ok",
                            "reward.function=my_reward"], case_dir, capsys, sub=False)
    assert rc == 0, err


def test_example_tiny_blueprint_validates(tiny_kit, tmp_path):
    p = subprocess.run(
        [VERLFLOW, "validate-blueprint", str(REPO / "blueprints/tiny-cpu.yaml"), f"model.path={tiny_kit['model_dir']}",
         f"data.train_files=[{tiny_kit['train_file']}]", f"eval.files=[{tiny_kit['test_file']}]",
         f"storage.uri={tmp_path / 'store'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    iterations = yaml.safe_load((REPO / "blueprints/tiny-cpu.yaml").read_text())["iterations"]
    assert f"ok (tiny-grpo, {iterations} iterations, 2 ranks on cpu" in p.stdout
    assert not (tmp_path / "store").exists()


def test_example_gpu_blueprint_validates_with_kit_inputs(tiny_kit, tmp_path, capsys):
    rc, out, err = run_cli(
        ["validate-blueprint", str(REPO / "blueprints/gpu-qwen2.5-1.5b.yaml"), f"model.path={tiny_kit['model_dir']}",
         f"data.train_files=[{tiny_kit['train_file']}]", f"storage.uri={tmp_path / 'store'}"], tmp_path, capsys, False)
    assert rc == 0, err
    assert "8 ranks on cuda" in out


def test_every_example_blueprint_is_covered():
    assert {p.name for p in (REPO / "blueprints").glob("*.yaml")} >= {"tiny-cpu.yaml", "gpu-qwen2.5-1.5b.yaml"}


def test_schema_prints_json_schema():
    p = subprocess.run([VERLFLOW, "schema"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    schema = json.loads(p.stdout)
    defs = schema["$defs"]
    adv = defs["AlgorithmSpec"]["properties"]["adv_estimator"]
    assert adv["enum"] == list(ADV_ESTIMATORS) and "remax" in adv["enum"]
    assert "description" in adv and "critic" in adv["description"]
    assert defs["RolloutSpec"]["properties"]["n"]["description"]
    assert set(schema["properties"]) >= {"model", "data", "reward", "algorithm", "rollout", "fsdp", "resources",
                                         "storage", "schedule", "iterations", "seed"}
    assert schema.get("additionalProperties") is False


def test_top_level_help_exits_zero():
    p = subprocess.run([VERLFLOW, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert {"schema", "validate-blueprint", "make-tiny", "run", "rerun", "ls", "show"} <= set(VERBS)
    for verb in VERBS:
        assert verb in p.stdout
    assert "examples:" in p.stdout


@pytest.mark.parametrize("verb", VERBS)
def test_verb_help_exits_zero(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: verlflow {verb}")


def test_verb_help_subprocess():
    p = subprocess.run([VERLFLOW, "validate-blueprint", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "KEY=VALUE" in p.stdout, p.stderr


# ---------------------------------------------------------------------------------------------------
# Storage on the real S3 endpoint (moto server): refused at the preflight probe, nothing created, no secret shown.

def _run_s3(case_dir: Path, capsys, uri: str) -> str:
    (case_dir / "bp.yaml").write_text(BASE)
    rc, out, err = run_cli(["run", str(case_dir / "bp.yaml"), f"storage.uri={uri}", "--run-id", "r1"], case_dir,
                           capsys, sub=False)
    assert rc not in (0, None), err
    assert "Traceback" not in err and out == ""
    assert len(re.findall(r"^verlflow[\w -]*: error: ", err, re.M)) == 1, err
    assert FAKE_SECRET not in err
    return err


def test_s3_bucket_that_does_not_exist(s3_bucket, case_dir: Path, capsys):
    missing = f"{s3_bucket.name}-missing"
    err = _run_s3(case_dir, capsys, f"s3://{missing}/prefix")
    assert f"s3://{missing}/prefix/_probe/" in err
    assert "The bucket does not exist" in err and f"aws s3 mb s3://{missing}" in err and "storage.uri" in err
    names = {b["Name"] for b in s3_bucket.client().list_buckets()["Buckets"]}
    assert missing not in names  # nothing was created
    assert s3_bucket.client().list_objects_v2(Bucket=s3_bucket.name).get("KeyCount", 0) == 0


def test_s3_without_credentials(s3_bucket, case_dir: Path, capsys, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    err = _run_s3(case_dir, capsys, f"{s3_bucket.uri}/prefix")
    assert f"{s3_bucket.uri}/prefix/_probe/" in err
    assert "No S3 credentials were found" in err and "AWS_ACCESS_KEY_ID" in err
    assert s3_bucket.client().list_objects_v2(Bucket=s3_bucket.name).get("KeyCount", 0) == 0


def test_validate_blueprint_stays_cheap(tiny_kit):
    """Checking files, datasets and the reward imports neither torch nor verl (seconds each)."""
    code = ("import sys; from verlflow.flows.cli import main; "
            f"rc = main(['validate-blueprint', {str(REPO / 'blueprints/gpu-qwen2.5-1.5b.yaml')!r}, "
            f"'model.path={tiny_kit['model_dir']}', 'data.train_files=[{tiny_kit['train_file']}]']); "
            "print(rc, sorted(m for m in ('torch', 'verl', 'transformers', 'prefect') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.stdout.strip().endswith("0 []"), p.stdout + p.stderr


def test_ls_lists_runs_and_stage_states(tmp_path, capsys):
    from verlflow.flows.cli import main
    from verlflow.core.store.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "s")
    for it, stage in (("init", "build"), ("1", "rollout")):
        store.put_bytes(f"runs/r1/{it}/{stage}/x.bin", b"x")
        store.commit(f"runs/r1/{it}/{stage}", {"key": f"k-{stage}"}, {"x.bin": {"sha256": "0" * 64, "size": 1}})
    store.put_bytes("runs/r1/1/update/partial.bin", b"half")  # data without a manifest
    assert main(["ls", f"storage.uri={tmp_path / 's'}"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["r1", "unknown"] in [r[:2] for r in rows]  # a run recorded before runs had plans: 0 updates of ?
    assert rows[rows.index(["run", "state", "started", "iterations", "reward", "promoted"]) + 1] == \
        ["r1", "unknown", "0/?"]
    assert main(["ls", f"storage.uri={tmp_path / 's'}", "--run", "r1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["build[init]", "committed"], ["rollout[1]", "committed"],
                                                   ["update[1]", "NOT"]]


def test_a_run_id_of_the_longest_allowed_length_makes_stage_keys():
    from verlflow.core.store.artifacts import RUN_ID_MAX, stage_key

    assert stage_key("r" * RUN_ID_MAX, 1, "export").startswith("runs/rrr")


# ---------------------------------------------------------------------------------------------------
# What a stage's failure shows: one message on the terminal, every line in the stage's log file.

def test_line_sink_groups_a_traceback_into_one_error_record(tmp_path):
    import logging

    from verlflow.core.orchestrate.logsink import LineSink

    records = []
    tb0 = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "    f()",
           "ValueError: first", "", "During handling of the above exception, another exception occurred:", "",
           "Traceback (most recent call last):", '  File "a.py", line 3, in <module>',
           "verlflow.core.errors.InputError: two problems:", "  rank 0: a", "  rank 1: b"]
    lines = ["[verlflow] update[1] -> file:///s", "[rank0] 12:00:00 verlflow.stage: loading",
             f"[rank0] {tb0[0]}", "[rank1] 12:00:01 verlflow.stage: still fine",
             *[f"[rank0] {t}".rstrip() for t in tb0[1:]],
             "[rank0] 12:00:02 verlflow.stage: after", "[torchrun] W1201 12:00:03.000 1 api.py:1] closing",
             "[rank1] Traceback (most recent call last):", '[rank1]   File "b.py", line 9, in g', "[rank1] KeyError: 'x'"]
    with LineSink(tmp_path / "logs" / "update-1.log", lambda level, text: records.append((level, text))) as sink:
        for line in lines:
            sink(line)
    assert records == [
        (logging.INFO, lines[0]), (logging.INFO, lines[1]), (logging.INFO, lines[3]),
        (logging.ERROR, "[rank0] " + "\n".join(tb0)), (logging.INFO, "[rank0] 12:00:02 verlflow.stage: after"),
        (logging.INFO, "[torchrun] W1201 12:00:03.000 1 api.py:1] closing"),
        (logging.ERROR, "[rank1] Traceback (most recent call last):\n  File \"b.py\", line 9, in g\nKeyError: 'x'"),
    ]  # rank 1's traceback was still open at the end: close() emitted it
    text = (tmp_path / "logs" / "update-1.log").read_text().splitlines()
    assert text[0].startswith("==== ") and text[1:] == lines  # the file has every line as it came


BAD_REWARD = ("import os\nfrom verlflow.core.errors import InputError\nfrom verlflow.core.ml.rewards import register_reward\n"
              "if os.environ.get('RANK') is not None:  # in the stage's ranks only, not in the CLI's own checks\n"
              "    raise InputError('badreward: the scoring service is unreachable')\n"
              "@register_reward('bad')\ndef bad(data_source, solution_str, ground_truth, extra_info=None):\n"
              "    return 0.0\n")


def test_a_rank_traceback_is_one_error_record_in_the_task_logs(prefect_server, tiny_kit, tmp_path, monkeypatch):
    """The stage task's logs in Prefect: validate's ranks fail with a traceback; each is one ERROR record, no frame
    of it is an INFO record of its own, and the stage's log file has every line."""
    import time

    import httpx
    from prefect import flow

    from tinybp import ONE_RANK, tiny_blueprint
    from verlflow.tasks.stages import stage_task

    (tmp_path / "badreward.py").write_text(BAD_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "reward.module=badreward", "reward.function=bad")

    @flow
    def one():
        return stage_task("validate", "init", bp)("validate", "init", {}, bp, "tb1", False)

    state = one(return_state=True)
    assert state.is_failed()
    body = {"logs": {"flow_run_id": {"any_": [str(state.state_details.flow_run_id)]}}, "limit": 200}
    deadline = time.monotonic() + 30
    while True:  # the API log handler sends in batches
        records = httpx.post(f"{prefect_server.url}/logs/filter", json=body, timeout=30).json()
        ranks = [r for r in records if re.match(r"\[rank\d+\] Traceback \(most recent call last\):\n", r["message"])]
        if ranks or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ranks and all(r["level"] == 40 for r in ranks), [r["message"][:80] for r in records]
    assert all("InputError: validate found 1 problem(s)" in r["message"] for r in ranks)
    assert not [r for r in records if re.match(r"\[rank\d+\]\s+(File |raise |Traceback)", r["message"])
                and r["level"] < 40], "a traceback's line logged as a record of its own"
    log = next((tmp_path / "cache" / "logs").rglob("tb1/validate-init.log")).read_text()
    assert re.search(r"^\[rank0\] Traceback \(most recent call last\):$", log, re.M), log


def test_a_user_error_in_a_stage_prints_one_message_and_the_log_file(tiny_kit, tmp_path):
    """Both ranks of validate raise a verlflow error: the terminal shows the stage's ordinary lines (one rank prefix
    each) and the one message with the log file's path; the ranks' tracebacks are in that file only."""
    (tmp_path / "badreward.py").write_text(BAD_REWARD)
    args = [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
            f"storage.uri={tmp_path / 'store'}", "reward.module=badreward", "reward.function=bad",
            "resources.nproc_per_node=2", "iterations=1", "data.batch_size=4", "rollout.n=2"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "VERLFLOW_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([VERLFLOW, "run", *args, "--run-id", "bad1"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert len(re.findall(r"^verlflow[\w -]*: error: ", p.stderr, re.M)) == 1, p.stderr
    assert "badreward: the scoring service is unreachable" in p.stderr and "USER_ERROR" in p.stderr
    log = tmp_path / "logs" / "file" / str(tmp_path / "store").lstrip("/") / "bad1" / "validate-init.log"
    assert f"every rank's traceback included: {log}" in p.stderr
    assert not [f for f in (tmp_path / "store").rglob("*") if f.is_file()]  # the failed stage left nothing there
    text = log.read_text()
    assert re.search(r"^\[rank[01]\] Traceback \(most recent call last\):$", text, re.M), text
    assert "[rank0] " in p.stdout and "| inputs | NO |" in p.stdout  # the ordinary lines reached the terminal
    for line in p.stdout.splitlines() + text.splitlines():
        assert line.count("[rank") <= 1, line  # one rank prefix per line


# ---------------------------------------------------------------------------------------------------
# What a newcomer meets: progress, the start-up wait, `verlflow ls`, pipes.

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(argv: list, env: dict, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """The command with a pseudo-terminal (80 columns) as its stdout and stderr, as a person's shell runs it."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=cwd)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                out += data
            elif p.poll() is not None:
                break
        return p.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()


def test_run_shows_progress_on_a_terminal_and_plain_lines_in_a_pipe(reference, tmp_path):
    """Piped (a log file, CI): the stage lines, the warm workers' start said before its wait, the update's epochs
    and mini-batches of their totals, and one plain line per iteration with the ETA; no escape codes. On a
    terminal: rich's bar with iteration i/N instead of those lines."""
    from tinybp import tiny_overrides

    _, root = reference.copy(tmp_path)
    args = tiny_overrides(reference.kit, root, iterations=2, storage__keep_last_checkpoints=3)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VERLFLOW_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run([VERLFLOW, "rerun", "eq", *args, "--from", "rollout[1]"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    lines = p.stdout.splitlines()
    assert not ANSI.search(p.stdout) and "━" not in p.stdout
    launch = next(i for i, line in enumerate(lines) if line.startswith("[verlflow] rollout[1] -> "))
    assert lines[launch + 1].startswith("[verlflow] starting 2 warm worker(s) for rollout"), lines[launch:launch + 3]
    assert sum(bool(re.search(r"verlflow\.update: epoch 1/1 mini-batch [12]/2: pg_loss", line)) for line in lines) == 4
    ends = [line for line in lines if line.startswith("[verlflow] iteration ")]
    assert len(ends) == 2, lines
    assert re.fullmatch(r"\[verlflow\] iteration 1/2 done: elapsed (\d+m)?\d+s, ETA (\d+m)?\d+s", ends[0]), ends
    assert re.fullmatch(r"\[verlflow\] iteration 2/2 done: elapsed (\d+m)?\d+s", ends[1]), ends

    rc, out = run_in_pty([VERLFLOW, "rerun", "eq", *args], env, tmp_path)  # every stage reused: seconds
    assert rc == 0, out[-3000:]
    plain = ANSI.sub("", out)
    assert "━" in plain and re.search(r"━ 2/2 iterations elapsed (\d+m)?\d+s", plain), plain[-2000:]
    assert "[verlflow] iteration" not in plain  # the bar, not the pipe's lines


def _ls(args: list, tmp_path: Path, columns: int = 80) -> tuple[str, dict]:
    """`verlflow ls` as a terminal of `columns` would show it: (its output, {run id: {column: cell}})."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": str(columns)}
    p = subprocess.run([VERLFLOW, "ls", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stdout + p.stderr
    lines = p.stdout.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("run ")), None)
    if head is None:
        return p.stdout, {}
    assert max(map(len, lines[head:-1])) <= columns, p.stdout  # the table fits the terminal (the text lines wrap there)
    starts = [m.start() for m in re.finditer(r"(?<!\S)\S", lines[head])]
    rows: list[list[str]] = []
    for line in lines[head + 1:-1]:  # the last line: the hint
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        if cells[2 if "blueprint" in lines[head] else 1]:
            rows.append(cells)
        else:  # a folded cell's next line
            rows[-1] = [a + b if b else a for a, b in zip(rows[-1], cells)]
    names = lines[head].split()
    return p.stdout, {r[0]: dict(zip(names, r)) for r in rows}


def test_ls_is_a_table_of_the_blueprints_runs(reference, tmp_path):
    """`verlflow ls BLUEPRINT`: the blueprint's runs with their state (committed, running: a live lease,
    incomplete), start, iterations done of planned, promote.metric's best and which holds the promoted policy;
    --all adds other blueprints' runs; an empty store says so and how to start a run."""
    import datetime as dt

    from reference import clone_stages
    from tinybp import tiny_overrides
    from verlflow.core.orchestrate.pipeline import plan, record_plan
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.lease import run_lease

    bp, root = reference.copy(tmp_path)
    store = open_store(bp.storage)
    stopped = "eq-stopped-after-its-first-iteration-by-a-kill"  # longer than its column: folds, whole
    clone_stages(store, "eq", stopped, [("init", "validate"), ("init", "build"), (1, "rollout"), (1, "update"),
                                        (1, "export")])
    record_plan(store, bp, stopped, plan(bp, stopped))
    other = bp.model_copy(update={"name": "someone-else"})
    clone_stages(store, "eq", "theirs", [("init", "validate")])
    record_plan(store, other, "theirs", plan(other, "theirs"))
    args = tiny_overrides(reference.kit, root, iterations=2, storage__keep_last_checkpoints=3)
    rewards = [store.read_manifest(f"runs/eq/{i}/rollout")["metrics"]["reward_mean"] for i in (1, 2)]
    with run_lease(store, "starting", say=lambda line: None):  # a run that holds its lease, nothing committed yet
        out, runs = _ls([*args, "promote.metric=rollout/reward_mean"], tmp_path)
    assert f"file://{root}" in out, out  # whole, to copy: not broken over lines however long
    assert " ".join(out.split()).startswith(f"3 run(s) of blueprint {bp.name} in file://{root}; best: the highest "
                                            "rollout/reward_mean"), out
    started = dt.datetime.fromisoformat(store.read_manifest("runs/eq/init/validate")["committed_at"]).astimezone()
    best = max((1, 2), key=lambda i: rewards[i - 1])
    assert runs["eq"] == {"run": "eq", "state": "committed", "started": f"{started:%Y-%m-%d %H:%M}",
                          "iterations": "2/2", "best": f"{rewards[best - 1]:.4g} (it {best})",
                          "promoted": "yes, it 2"}, out
    assert runs[stopped]["state"] == "incomplete" and runs[stopped]["iterations"] == "1/2", out
    assert runs[stopped]["best"] == f"{rewards[0]:.4g} (it 1)" and runs[stopped]["promoted"] == "", out
    assert runs["starting"]["state"] == "running", out
    assert set(runs) == {"eq", stopped, "starting"}, out  # not another blueprint's

    out, runs = _ls([*args, "--all"], tmp_path, columns=120)
    assert runs["theirs"]["blueprint"] == "someone-else" and runs["theirs"]["iterations"] == "0/2", out
    assert runs["eq"]["reward"] == f"{rewards[1]:.4g} (it 2)" and "reward: the last rollout's" in out, out

    out, runs = _ls([*args, f"storage.uri={tmp_path / 'nothing'}"], tmp_path)
    assert out.startswith(f"no runs of blueprint {bp.name} in file://{tmp_path / 'nothing'}; start one with "
                          f"`verlflow run model.path={reference.kit['model_dir']} ") and not runs, out


@pytest.mark.parametrize("verb", ["validate-blueprint", "schema", "ls"])
def test_a_reader_that_goes_away_ends_the_command_quietly(verb, tiny_kit, tmp_path):
    """`verlflow validate-blueprint ... | head -2`: once the reader has closed the pipe, the command stops with
    the shell's code for it, 141, and no traceback."""
    inputs = [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
              f"storage.uri={tmp_path / 'store'}"]
    argv = {"validate-blueprint": [str(REPO / "blueprints/tiny-cpu.yaml"), *inputs,
                                   f"eval.files=[{tiny_kit['test_file']}]"], "schema": [], "ls": inputs}[verb]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        p = subprocess.run([VERLFLOW, verb, *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                           cwd=tmp_path)
    finally:
        os.close(write)
    assert p.returncode == 141 and p.stderr == "", p.stderr
