"""A Hugging Face model folder as model.path names it: the files from_pretrained and the tokenizer read, whether
they parse, and whether the weights hold the bytes their headers describe. One check, asked by the CLI's preflight
(core/checks/inputs.py missing_inputs), the validate stage and the build stage. No torch import: the CLI runs it
before anything touches the store. Every problem is one line naming the file, what was found and the fix.
"""

import json
from pathlib import Path

from verlflow.core.errors import InputError

_MAX_HEADER = 100 * 2**20  # the safetensors library's own bound on a header


def model_dir_problems(path: str | Path) -> list[str]:
    """Problems with the folder: not a folder; config.json missing or not a JSON object; no weights, or weights that
    do not open or match their index; no tokenizer_config.json. Empty: fine."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        return [f"model.path: {path} is not a folder; point it at a Hugging Face model folder "
                "(`verlflow make-tiny tiny/qwen2` writes a tiny one)."]
    problems = []
    if not (model_dir / "config.json").is_file():
        problems.append(f"model.path: {path} has no config.json; save the model with save_pretrained().")
    else:
        try:
            model_config(model_dir)
        except InputError as e:
            problems.append(str(e))
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        problems.append(f"model.path={path}: no weights (*.safetensors); save the model with save_pretrained().")
    problems += weight_file_problems(model_dir)
    if not (model_dir / "tokenizer_config.json").is_file():
        problems.append(f"model.path={path}: tokenizer_config.json is missing; save the tokenizer in the same folder.")
    return problems


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


def weight_file_problems(model_dir: Path) -> list[str]:
    """The safetensors files from_pretrained loads (model.safetensors, or the shards its index names) open, and
    hold the bytes their headers describe; each shard holds the tensors the index maps to it."""
    index, single = model_dir / "model.safetensors.index.json", model_dir / "model.safetensors"
    if not index.is_file():
        return _file_problems(single, []) if single.is_file() else []  # none: model_dir_problems says so
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
