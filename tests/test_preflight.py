"""Bad inputs that used to fail only in a later stage, after validate (and build) had committed (issue 13, item 6
and part of 7), now refused before anything is committed.

The driver-side checks (model config and weight files, dataset size) run in-process through `verlflow.flows.cli.main`, for
both `validate-blueprint` and `run` (no torchrun: `run` stops before its first stage job). The checks that need
the rollout's tokenizer and reward (prompt lengths, a reward that returns text) run in the validate stage: one
1-rank torchrun job per case, and one case through the Prefect flow. Every case asserts: exit code != 0, one
`verlflow <verb>: error:` paragraph naming the field or file, the numbers and the fix, no traceback, and nothing
written to the artifact store.
"""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file, save_file

from verlflow.core.ml.fastgen import SUPPORTED_MODEL_TYPES
from verlflow.flows.cli import main
from tinybp import prompt_rows

pytestmark = pytest.mark.system

SMALL = ["resources.nproc_per_node=1", "data.batch_size=4", "algorithm.ppo_mini_batch_size=2",
         "algorithm.ppo_micro_batch_size_per_gpu=4", "rollout.n=4"]


@pytest.fixture
def model(tiny_kit, tmp_path) -> Path:
    """A copy of the tiny kit's model folder, to damage."""
    return Path(shutil.copytree(tiny_kit["model_dir"], tmp_path / "m"))


def refused(verb: str, overrides: list, tiny_kit, tmp_path, capsys) -> str:
    """Run the CLI; assert a clean refusal with an untouched store; return stderr."""
    store = tmp_path / "store"
    base = [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
            f"storage.uri={store}", *SMALL]
    argv = [verb, *base, *overrides] + (["--run-id", "bad"] if verb == "run" else [])
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc not in (0, None), f"exit code {rc}; stderr:\n{err}"
    assert err.startswith(f"verlflow {verb}: error: "), err
    assert len([line for line in err.splitlines() if line.startswith("verlflow ")]) == 1, err
    assert "Traceback" not in err, err
    assert_store_empty(store)
    return err


def assert_store_empty(store: Path) -> None:
    files = [p for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert not files, f"the store was written: {files}"


def _phi(kit: dict, tmp: Path) -> Path:
    """A tiny Phi(-2) model with the kit's tokenizer: the HF engine runs it, the static engine does not (LayerNorm,
    parallel attention and MLP)."""
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    out = tmp / "phi"
    shutil.copytree(kit["model_dir"], out, ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                        "generation_config.json"))
    vocab = json.loads((Path(kit["model_dir"]) / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    PhiForCausalLM(PhiConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
                   ).save_pretrained(out)
    return out


def _model_type(model: Path, model_type: str) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"] = model_type
    (model / "config.json").write_text(json.dumps(cfg))


def _shard(model: Path) -> list[Path]:
    """Split model.safetensors into two shards with an index, as save_pretrained does for a large model."""
    tensors = load_file(str(model / "model.safetensors"))
    names = sorted(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    shards = [model / f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    for shard, part in zip(shards, parts):
        save_file({n: tensors[n] for n in part}, str(shard), metadata={"format": "pt"})
    weight_map = {n: shard.name for shard, part in zip(shards, parts) for n in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "model.safetensors").unlink()
    return shards


def _truncate(path: Path, keep: float = 0.6) -> tuple[int, int]:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return int(len(data) * keep), len(data)


# ------------------------------------------------------------------------------------------ in the driver

DRIVER_VERBS = ("validate-blueprint", "run")


@pytest.mark.parametrize("verb", DRIVER_VERBS)
def test_static_engine_with_an_unsupported_model_type(verb, tiny_kit, tmp_path, capsys):
    model = _phi(tiny_kit, tmp_path)
    err = refused(verb, [f"model.path={model}", "rollout.engine=static"], tiny_kit, tmp_path, capsys)
    assert "rollout.engine: static" in err and f"{model}/config.json has model_type 'phi'" in err
    assert ", ".join(SUPPORTED_MODEL_TYPES) in err  # the engine's own list
    assert "set rollout.engine: hf" in err


def test_static_engine_accepts_its_model_types_and_hf_any(model, tiny_kit, tmp_path):
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.checks.inputs import missing_inputs

    def problems(*overrides):
        base = [f"model.path={model}", f"data.train_files=[{tiny_kit['train_file']}]", f"storage.uri={tmp_path}"]
        return missing_inputs(load_blueprint(None, [*base, *overrides]))

    for model_type in SUPPORTED_MODEL_TYPES:
        _model_type(model, model_type)
        assert problems("rollout.engine=static") == []
    _model_type(model, "phi")
    assert problems("rollout.engine=hf") == []


@pytest.mark.parametrize("verb", DRIVER_VERBS)
def test_truncated_weights_are_named_with_their_sizes(verb, model, tiny_kit, tmp_path, capsys):
    size, full = _truncate(model / "model.safetensors")
    err = refused(verb, [f"model.path={model}"], tiny_kit, tmp_path, capsys)
    assert f"model.path: {model}/model.safetensors is not a valid safetensors file" in err
    assert f"it is {size} bytes but its header describes {full} bytes: truncated" in err
    assert "re-download it or re-save the model with save_pretrained()" in err


def test_corrupt_weight_header_is_named(model, tiny_kit, tmp_path, capsys):
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00" * 32  # the JSON header
    path.write_bytes(bytes(data))
    err = refused("run", [f"model.path={model}"], tiny_kit, tmp_path, capsys)
    assert f"{path} is not a valid safetensors file: it is {len(data)} bytes and its header is unreadable" in err


def test_sharded_checkpoint_names_the_bad_shard(model, tiny_kit, tmp_path, capsys):
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.checks.inputs import missing_inputs

    shards = _shard(model)
    bp = load_blueprint(None, [f"model.path={model}", f"data.train_files=[{tiny_kit['train_file']}]"])
    assert missing_inputs(bp) == []  # a sound sharded checkpoint passes
    size, full = _truncate(shards[1])
    err = refused("run", [f"model.path={model}"], tiny_kit, tmp_path, capsys)
    assert f"{shards[1]} is not a valid safetensors file: it is {size} bytes but its header describes {full}" in err
    assert str(shards[0]) not in err
    shards[1].unlink()
    err = refused("validate-blueprint", [f"model.path={model}"], tiny_kit, tmp_path, capsys)
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    mapped = sum(1 for shard in index.values() if shard == shards[1].name)
    assert f"{shards[1]} is missing, but {model}/model.safetensors.index.json maps {mapped} tensors to it" in err


@pytest.mark.parametrize("verb", DRIVER_VERBS)
def test_batch_size_larger_than_the_dataset(verb, tiny_kit, tmp_path, capsys):
    data = tmp_path / "three.parquet"
    pq.write_table(pa.table(prompt_rows(3)), data)
    err = refused(verb, [f"data.train_files=[{data}]"], tiny_kit, tmp_path, capsys)
    assert "data.batch_size=4 is larger than the dataset: data.train_files hold 3 prompt(s)" in err
    assert "lower data.batch_size to at most 3" in err and "or add prompts" in err


# ------------------------------------------------------------------------------ in the validate stage job


def _prompt_lengths(model_dir: str, messages: list) -> list[int]:
    """The oracle: the prompts' token counts after the chat template, straight from transformers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for msgs in messages:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def test_prompts_over_max_prompt_length(tiny_kit, tmp_path, capsys):
    rows = prompt_rows(5)
    rows["prompt"][1] = [{"role": "user", "content": "Write the digit 1 twice. " * 6}]
    rows["prompt"][3] = [{"role": "user", "content": "Write the digit 3 twice. " * 9}]
    lengths = _prompt_lengths(tiny_kit["model_dir"], rows["prompt"])
    limit = max(lengths[0], lengths[2], lengths[4])
    assert lengths[3] > lengths[1] > limit
    data = tmp_path / "long.parquet"
    pq.write_table(pa.table(rows), data)
    err = refused("run", [f"data.train_files=[{data}]", f"data.max_prompt_length={limit}"], tiny_kit, tmp_path,
                  capsys)
    assert (f"data.max_prompt_length={limit}: 2 of 5 prompts in data.train_files are longer after the chat "
            f"template; the longest is {lengths[3]} tokens (dataset row 3)") in err
    assert f"Raise data.max_prompt_length to {lengths[3]} or filter the prompts over {limit} tokens" in err


TEXT_REWARD = """\
def score(data_source, solution_str, ground_truth, extra_info=None):
    return "good answer"
"""


def test_reward_that_returns_text(tiny_kit, tmp_path, capsys, monkeypatch):
    (tmp_path / "text_reward.py").write_text(TEXT_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver resolves it, then the validate job calls it
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    err = refused("run", ["reward.function=text_reward:score"], tiny_kit, tmp_path, capsys)
    assert "reward.function 'text_reward:score', called on dataset row 0 (data_source 'tiny_digits')" in err
    assert "returned str 'good answer'; it must return a number" in err
    assert "Fix the function or pick another reward.function" in err


def test_the_flow_refuses_at_validate(prefect_server, tiny_kit, tmp_path):
    """A flow run (UI, schedule) has no CLI preflight: its validate stage runs the same checks."""
    from verlflow.flows.finetune import finetune
    from tinybp import ONE_RANK, tiny_blueprint

    model = _phi(tiny_kit, tmp_path)
    bp = tiny_blueprint({**tiny_kit, "model_dir": str(model)}, tmp_path / "store", *ONE_RANK, "rollout.engine=static")
    state = finetune(blueprint=bp, run_id="bad-flow", return_state=True)
    assert state.is_failed(), state
    msg = state.message + str(state.result(raise_on_failure=False))
    assert "validate[init]" in msg or "validate found" in msg, msg
    assert f"{model}/config.json has model_type 'phi'" in msg and "set rollout.engine: hf" in msg, msg
    assert_store_empty(tmp_path / "store")
