"""The blueprint's inputs: files, URIs and names it refers to that are not usable here, each one line naming the field
and the fix. Cheap: no torch or verl import (the datasets are read with pyarrow, the reward function is resolved), so
the CLI runs it before anything touches the store; the validate stage runs it again, since a flow run starts there.

What the rank's own readers refuse stays with them and is asked here with the same words: a model folder
(core/ml/modeldir.py, the build stage refuses one), missing files (core/ml/data.py), eval.files
(core/ml/evaluate.py), an sft/dpo phase's rows (core/ml/phasedata.py).
"""

import difflib
from pathlib import Path

from verlflow.core.blueprint import Blueprint
from verlflow.core.checks.agent import agent_problems
from verlflow.core.checks.footprint import ModelSize
from verlflow.core.checks.tracking import tracking_problems
from verlflow.core.errors import InputError, VerlflowError
from verlflow.core.metrics import available
from verlflow.core.ml.data import load_prompts, missing_file_problems
from verlflow.core.ml.evaluate import held_out_problems
from verlflow.core.ml.fastgen import SUPPORTED_MODEL_TYPES  # the package's init is torch-free
from verlflow.core.ml.modeldir import model_config, model_dir_problems, weight_file_problems
from verlflow.core.ml.phasedata import load_preferences, load_sft_rows
from verlflow.core.ml.rewards import load_reward
from verlflow.core.uris import carries_credentials


def missing_inputs(bp: Blueprint) -> list[str]:
    """Every problem of the blueprint's inputs at once (empty: all usable)."""
    problems = model_dir_problems(bp.model.path) + _engine_problems(bp)
    problems += _data_problems(bp)
    problems += agent_problems(bp)
    problems += _reward_problems(bp)
    if bp.model.lora is not None and not model_dir_problems(bp.model.path):
        problems += _lora_problems(bp)
    if unknown := unknown_metric_problem(bp):
        problems.append(unknown)
    problems += [p for p in _eval_problems(bp) if p not in problems]  # a reward.module error once
    problems += _phase_data_problems(bp)
    problems += _storage_problems(bp.storage.uri)
    problems += tracking_problems(bp.tracking)
    return problems


def _data_problems(bp: Blueprint) -> list[str]:
    """data.train_files: present, their columns, types and rows, and at least data.batch_size prompts."""
    missing = missing_file_problems(bp.data.train_files)
    if missing:
        return missing
    try:
        prompts = load_prompts(bp.data.train_files, bp.data.prompt_key)
    except VerlflowError as e:
        return [str(e)]
    return batch_size_problems(bp.data.batch_size, len(prompts), bp.algorithm.ppo_mini_batch_size)


def batch_size_problems(batch_size: int, n_prompts: int, mini_batch: int) -> list[str]:
    if batch_size <= n_prompts:
        return []
    return [f"data.batch_size={batch_size} is larger than the dataset: data.train_files hold {n_prompts} "
            f"prompt(s); lower data.batch_size to at most {n_prompts} (a multiple of "
            f"algorithm.ppo_mini_batch_size={mini_batch}) or add prompts."]


def _reward_problems(bp: Blueprint) -> list[str]:
    """reward.function resolves (reward.module imported first); reward.model's folder holds a reward model."""
    problems = []
    try:
        load_reward(bp.reward.function, bp.reward.module)
    except VerlflowError as e:
        problems.append(str(e))
    if bp.reward.model is not None:
        problems += reward_model_problems(bp.reward.model.path)
    return problems


def reward_model_problems(path: str | Path) -> list[str]:
    """reward.model.path: a folder holding an HF *ForSequenceClassification with one label, its weights and its
    tokenizer. Empty: fine."""
    folder = Path(path)
    fix = "save a *ForSequenceClassification model with num_labels=1 there with save_pretrained()"
    if not (folder / "config.json").is_file():
        return [f"reward.model.path: {path} has no config.json; {fix}."]
    try:
        config = model_config(folder)
    except InputError as e:
        return [str(e).replace("model.path", "reward.model.path", 1)]
    arch = (config.get("architectures") or ["(none)"])[0]
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    problems = []
    if not str(arch).endswith("ForSequenceClassification") or labels != 1:
        problems.append(f"reward.model.path: {path} holds {arch} with {labels} labels; a reward model is a "
                        f"*ForSequenceClassification with one label ({fix}).")
    if not any(folder.glob("*.safetensors")):
        problems.append(f"reward.model.path: {path} has no *.safetensors weights; {fix}.")
    problems += weight_file_problems(folder)
    if not (folder / "tokenizer_config.json").is_file():
        problems.append(f"reward.model.path: {path} has no tokenizer_config.json; save its tokenizer there too.")
    return problems


def _engine_problems(bp: Blueprint) -> list[str]:
    """What the rollout engine would refuse in a model folder whose config.json reads (model_dir_problems says
    what else is wrong with it)."""
    model_dir = Path(bp.model.path)
    try:
        config = model_config(model_dir)
    except (VerlflowError, OSError):
        return []
    return static_engine_problems(bp.rollout.engine, model_dir, config)


def static_engine_problems(engine: str, model_dir: Path, config: dict) -> list[str]:
    """rollout.engine static runs only the model families the engine itself lists."""
    model_type = config.get("model_type")
    if engine != "static" or model_type in SUPPORTED_MODEL_TYPES:
        return []
    return [f"rollout.engine: static runs model types {', '.join(SUPPORTED_MODEL_TYPES)}, but "
            f"{model_dir / 'config.json'} has model_type {model_type!r}; set rollout.engine: hf (transformers "
            "generate) for this model."]


def _lora_problems(bp: Blueprint) -> list[str]:
    """model.lora.target_modules against the model folder's linear layers (its safetensors headers)."""
    size = ModelSize.of(Path(bp.model.path))
    if not size.linears:  # pickled weights only: validate's PEFT injection checks them
        return []
    unmatched = size.unmatched_targets(bp.model.lora)
    if not unmatched:
        return []
    return [f"model.lora.target_modules: {', '.join(unmatched)} names no linear layer of {bp.model.path} (its linear "
            f"layers: {', '.join(size.linear_names())}; or all-linear)"]


def unknown_metric_problem(bp: Blueprint) -> str | None:
    """promote.metric, when it names no metric the configured stages record: the problem, with the names."""
    metric = bp.promote.metric
    names = available(bp)
    if metric is None or metric in names:
        return None
    close = difflib.get_close_matches(metric, names, n=1)
    return (f"promote.metric={metric} is not a metric this blueprint's stages record"
            f"{f' (did you mean {close[0]}?)' if close else ''}; choose one of: {', '.join(names)}")


def _eval_problems(bp: Blueprint) -> list[str]:
    """eval.files' files, columns and rows, and eval.reward's function."""
    problems = held_out_problems(bp.eval)
    if bp.eval.reward:
        try:
            load_reward(bp.eval.reward, bp.reward.module, field="eval.reward")
        except VerlflowError as e:
            problems.append(str(e))
    return problems


def _phase_data_problems(bp: Blueprint) -> list[str]:
    """An sft/dpo phase's files, as its stage reads them (core/ml/phasedata.py: columns, types, every row), and at
    least one mini-batch of rows."""
    problems = []
    for i, ph in enumerate(bp.phases):
        if ph.kind not in ("sft", "dpo"):
            continue
        field = f"phases[{i}].data.train_files"
        read = load_sft_rows if ph.kind == "sft" else load_preferences
        try:
            rows = len(read(ph.data.train_files, field))
        except InputError as e:
            problems.append(str(e))
            continue
        mini = ph.algorithm.mini_batch_size
        if rows < mini:
            problems.append(f"{field}: {rows} rows, fewer than phases[{i}].algorithm.mini_batch_size={mini}; lower "
                            "the mini-batch or add rows.")
    return problems


def _storage_problems(uri: str) -> list[str]:
    """storage.uri: a scheme the store opens, and no credentials in it (the URI itself is not repeated: it holds a
    secret)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme not in ("file", "s3"):
        return [f"storage.uri: scheme '{scheme}://' is not supported; use a folder, file:// or s3://bucket/prefix."]
    if carries_credentials(uri):
        return ["storage.uri: an s3:// URI must not carry credentials (s3://key:secret@bucket); use "
                "s3://bucket/prefix and set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment "
                "(or a Prefect Secret)."]
    return []
