"""The HF safetensors export of a policy (the export stage, the monolithic stage): in storage.export_dtype, with
the model folder's own config.json saying the dtype written, from weights in memory or a DCP checkpoint.

torch is imported inside the functions that need it: export_dtype is a fact about the blueprint and a model folder
that the driver (a space estimate) can ask without it.
"""

import json
import shutil
from pathlib import Path

from verlflow.core.blueprint.sections import ModelSpec, StorageSpec
from verlflow.core.errors import InputError
from verlflow.core.ml.modeldir import model_config

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def export_dtype(storage: StorageSpec, model: ModelSpec, model_dir: str | Path) -> str:
    """storage.export_dtype, `auto` resolved to the model folder's own dtype (its config.json `dtype`, or the older
    `torch_dtype`: bfloat16 for Qwen2.5 even when trained with fp32 master weights), else model.dtype."""
    if storage.export_dtype != "auto":
        return storage.export_dtype
    config = model_config(Path(model_dir))
    name = config.get("dtype") or config.get("torch_dtype")
    if name is None:
        return model.dtype
    if name not in DTYPE_NAMES:
        raise InputError(f"{Path(model_dir) / 'config.json'}: dtype {name!r} cannot be the export's dtype "
                         f"(storage.export_dtype: auto); set storage.export_dtype to one of {', '.join(DTYPE_NAMES)}.")
    return name


def export_model(meta_dir: Path, spec: ModelSpec, dtype: str, *, full: dict | None = None,
                 policy_dir: Path | None = None, base_dir: Path | None = None, into=None):
    """An unsharded CPU model in `dtype` holding the policy's weights, from a full state dict (`full`) or from the
    DCP checkpoint in `policy_dir` (both cast on the copy into it; LoRA adapters merged into the base in
    `base_dir`). A copy of its own: training may go on changing the source while it is written. `into`: an earlier
    export's model whose write is done, refilled from `full` (its pages are faulted in already: the steady state's
    copy then costs the transfer alone)."""
    import torch

    from verlflow.core.ml import checkpoint, model as M

    if into is not None and full is not None:
        checkpoint.copy_state_into(into, full)
        return into
    # Cast while still on meta, then allocate uninitialised: no full-size model in the training dtype on the way.
    model = M.materialize(M.build_module(meta_dir, spec, meta=True).to(M.DTYPES[dtype]), "cpu")
    model.tie_weights()  # to_empty gives each module its own new tensor, untying a shared head
    with torch.no_grad():
        if full is not None:
            if next(iter(full.values())).is_cuda:  # (one device for all; a LoRA mapping merges what it reads)
                # Touch the new pages first (torch fills on every core): a device-to-host copy into pages not yet
                # faulted in ran at 1.4 GB/s on the H200 machine; 0.2 s + 0.3 s this way for 3.55 GB
                # (infra/bench/export_copy.py).
                for p in model.parameters():
                    p.detach().zero_()
            # Cast where the weights are (the GPU), a tensor at a time: half the bytes cross to the CPU, no CPU-side
            # conversion (H200, 1.5B: the copy into the export took ~10 s of each steady iteration), and no whole
            # cast copy on the device. Same rounding either way.
            checkpoint.copy_state_into(model, full)
        else:
            checkpoint.load_full(policy_dir, model, base=base_dir)
    return model


def write_export(model, meta_dir: Path, out: Path, dtype: str) -> None:
    """save_pretrained's weights, the build's meta files (tokenizer, generation config), and the model folder's
    config.json as it was, saying the dtype written."""
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(meta_dir).iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    config = model_config(Path(meta_dir))
    # Both names: transformers 5 reads `dtype`, older readers (transformers 4, vLLM) `torch_dtype`.
    config.update(dtype=dtype, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class AdapterExport:
    """storage.export_lora=adapter: the PEFT adapter folder of a LoRA policy (plus the tokenizer files), from the
    adapters in memory or the policy's DCP checkpoint."""

    def __init__(self, spec: ModelSpec, dtype: str, *, adapters: dict | None = None, policy_dir: Path | None = None):
        from verlflow.core.ml import checkpoint, model as M

        self.spec, self.dtype = spec, M.DTYPES[dtype]
        # A copy of its own on the CPU: training may go on changing the source while it is written.
        src = adapters if adapters is not None else checkpoint.read_tensors(policy_dir)
        self.adapters = {k: v.detach().to("cpu", self.dtype, copy=True) for k, v in src.items()}

    def write(self, meta_dir: Path, out: Path) -> None:
        """The adapter folder and the build's tokenizer files (PEFT's folders usually carry them; no config.json:
        the base model's own stays where model.path names it)."""
        from verlflow.core.ml import lora

        lora.save_adapter(self.adapters, self.spec.lora, self.spec.path, out, self.dtype)
        for f in Path(meta_dir).iterdir():
            if f.is_file() and f.name not in ("config.json", "generation_config.json"):
                shutil.copy2(f, out / f.name)
