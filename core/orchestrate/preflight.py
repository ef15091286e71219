"""Checks of a blueprint's inputs that would otherwise fail only inside a later stage, after earlier ones committed.

Each fact is decided here once, in one of two tiers:

- cheap (no torch, transformers or verl import; `missing_inputs` in core/blueprint.py calls them): the model's
  config and weight files, the dataset's size. The CLI runs them before anything touches the store, and the
  validate stage runs them again, since a Prefect flow run (UI, schedule) starts there.
- `rollout_problems`: needs the tokenizer and calls the reward function, so only the validate stage (a torchrun
  job that loads both anyway) runs it, before build.

Every problem is one line naming the field or file, what was found and the fix.
"""

import json
import sys
from pathlib import Path

from verlflow.core.errors import InputError, VerlflowError

_MAX_HEADER = 100 * 2**20  # the safetensors library's own bound on a header
_REWARD_SAMPLES = 16  # data sources sampled at most (verl_default picks a scorer per source)


def model_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"model.path: {path} is not valid JSON ({e}); save the model with save_pretrained().") \
            from None
    if not isinstance(config, dict):
        raise InputError(f"model.path: {path} must hold a JSON object (got {type(config).__name__}); save the "
                         "model with save_pretrained().")
    return config


def static_engine_problems(engine: str, model_dir: Path, config: dict) -> list[str]:
    """rollout.engine static runs only the model families the engine itself lists."""
    from verlflow.core.ml.fastgen import SUPPORTED_MODEL_TYPES  # the package's init is torch-free

    model_type = config.get("model_type")
    if engine != "static" or model_type in SUPPORTED_MODEL_TYPES:
        return []
    return [f"rollout.engine: static runs model types {', '.join(SUPPORTED_MODEL_TYPES)}, but "
            f"{model_dir / 'config.json'} has model_type {model_type!r}; set rollout.engine: hf (transformers "
            "generate) for this model."]


def weight_file_problems(model_dir: Path) -> list[str]:
    """The safetensors files from_pretrained loads (model.safetensors, or the shards its index names) open, and
    hold the bytes their headers describe; each shard holds the tensors the index maps to it."""
    index, single = model_dir / "model.safetensors.index.json", model_dir / "model.safetensors"
    if not index.is_file():
        return _file_problems(single, []) if single.is_file() else []  # none: validate's model-folder check says so
    try:
        shards = _shards_of(index)
    except InputError as e:
        return [str(e)]
    return [p for shard, tensors in shards.items() for p in _file_problems(model_dir / shard, tensors, index)]


def _shards_of(index: Path) -> dict[str, list[str]]:
    """shard file name -> the tensor names the index maps to it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(shard, []).append(tensor)
        return shards
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"model.path: {index} is not a readable safetensors index (a JSON object with a "
                         f"weight_map; {type(e).__name__}: {e}); re-download it or re-save the model with "
                         "save_pretrained().") from None


def _file_problems(path: Path, tensors: list[str], index: Path | None = None) -> list[str]:
    from safetensors import SafetensorError, safe_open

    fix = "re-download it or re-save the model with save_pretrained()"
    if not path.is_file():
        return [f"model.path: {path} is missing, but {index} maps {len(tensors)} tensors to it; {fix}."]
    try:
        with safe_open(str(path), framework="numpy") as f:  # reads and checks the header only
            names = set(f.keys())
    except (SafetensorError, OSError) as e:
        return [f"model.path: {path} is not a valid safetensors file: {_damage(path, e)}; {fix}."]
    absent = [t for t in tensors if t not in names]
    if absent:
        return [f"model.path: {path} lacks {len(absent)} of the {len(tensors)} tensors {index} maps to it "
                f"(e.g. {absent[0]}); {fix}."]
    return []


def _damage(path: Path, error: Exception) -> str:
    """What is wrong with an unreadable file, with its size against the size its header declares."""
    size = path.stat().st_size
    declared = _declared_size(path)
    if declared is not None and declared != size:
        how = "truncated (an interrupted download or copy?)" if size < declared else "longer than its header says"
        return f"it is {size} bytes but its header describes {declared} bytes: {how}"
    return f"it is {size} bytes and its header is unreadable ({error})"


def _declared_size(path: Path) -> int | None:
    """8 bytes of header length + the JSON header + the data section up to the largest end offset."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= _MAX_HEADER:
            return None
        try:
            header = json.loads(f.read(n))
            return 8 + n + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None


def batch_size_problems(batch_size: int, n_prompts: int, mini_batch: int) -> list[str]:
    if batch_size <= n_prompts:
        return []
    return [f"data.batch_size={batch_size} is larger than the dataset: data.train_files hold {n_prompts} "
            f"prompt(s); lower data.batch_size to at most {n_prompts} (a multiple of "
            f"algorithm.ppo_mini_batch_size={mini_batch}) or add prompts."]


# ----------------------------------------------------------------------------------------------------- rollout


def rollout_problems(bp, tok, prompts) -> list[str]:
    """What the rollout would refuse: prompts over data.max_prompt_length, a reward that gives no number."""
    return prompt_length_problems(tok, prompts, bp.data.max_prompt_length) + reward_problems(bp, prompts)


def prompt_length_problems(tok, prompts, limit: int) -> list[str]:
    from verlflow.core.ml.generate import encode_prompts

    # The rollout's own encoding (chat template, generation prompt), without its limit, so that every overlong
    # prompt is counted rather than only the first.
    rows = list(range(len(prompts)))
    lengths = [len(ids) for ids in encode_prompts(tok, prompts.messages, sys.maxsize, rows)]
    over = [i for i in rows if lengths[i] > limit]
    if not over:
        return []
    longest = max(over, key=lengths.__getitem__)
    return [f"data.max_prompt_length={limit}: {len(over)} of {len(prompts)} prompts in data.train_files are longer "
            f"after the chat template; the longest is {lengths[longest]} tokens (dataset row {longest}). Raise "
            f"data.max_prompt_length to {lengths[longest]} or filter the prompts over {limit} tokens out of the "
            "data."]


def reward_problems(bp, prompts) -> list[str]:
    """The reward called as the rollout calls it, once per data source (up to a few), on that source's first
    prompt with its ground truth as the response."""
    from verlflow.core.ml.rewards import load_reward

    reward = load_reward(bp.reward.function, bp.reward.module)
    first_row: dict[str, int] = {}
    for i, source in enumerate(prompts.data_source):
        if len(first_row) == _REWARD_SAMPLES:
            break
        first_row.setdefault(source, i)
    problems = []
    for source, i in first_row.items():
        truth = prompts.ground_truth[i]
        try:
            reward(source, truth, truth, prompts.extra_info[i])
        except Exception as e:  # noqa: BLE001 - whatever it raises, the rollout would raise too
            what = str(e) if isinstance(e, VerlflowError) else f"{type(e).__name__}: {e}"
            problems.append(f"reward.function {bp.reward.function!r}, called on dataset row {i} (data_source "
                            f"{source!r}) with its ground truth {truth!r:.40} as the response: {what} Fix the "
                            "function or pick another reward.function.")
    return problems
