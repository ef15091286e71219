"""LoRA adapters on the policy, through PEFT (`model.lora`).

The adapters are injected into the HF module before FSDP wraps it (PEFT's `inject_adapter_in_model`: the module
keeps its class, each targeted Linear gains `base_layer` and `lora_A/lora_B.default`); only they require grad, so
the optimizer and the update's DCP checkpoint hold them alone. The base weights stay in the build's `ref/`
checkpoint under their plain names: the reference is the same module with the adapters switched off, and every
unsharded copy (rollout, evaluation, HF export) is the plain model with `W + scaling * B @ A` merged in, so the
generation engines never see PEFT.
"""

import contextlib
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from verlflow.core.errors import InputError

ADAPTER = "default"  # PEFT's name for a model's only adapter
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def peft_config(spec, base_model: str | None = None):
    from peft import LoraConfig

    targets = spec.target_modules
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                      target_modules="all-linear" if targets == ["all-linear"] else list(targets),
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model)


def inject(model: nn.Module, spec, *, meta: bool) -> nn.Module:
    """Adapters into `model` in place, in the dtype of the weights they adapt (PEFT keeps them fp32 next to bf16
    weights; FSDP2 shards one dtype per unit). `meta`: created empty, for a checkpoint load or broadcast to fill."""
    from peft import inject_adapter_in_model

    dtype = next(model.parameters()).dtype
    try:
        inject_adapter_in_model(peft_config(spec), model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise InputError(f"model.lora.target_modules={spec.target_modules}: {str(e).splitlines()[0]} "
                         f"(this model's linear layers: {', '.join(linear)}; or all-linear)") from None
    for name, p in model.named_parameters():
        if is_adapter_key(name) and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def _layers(model: nn.Module):
    if "peft" not in sys.modules:  # no LoraLayer exists before PEFT is imported (inject imports it): a rank of a
        return []  # model without adapters skips PEFT's import (0.3 s)
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def is_adapted(model: nn.Module) -> bool:
    return bool(_layers(model))


def describe(model: nn.Module) -> dict:
    """What a checkpoint of the adapters records to be merged without a blueprint: rank, alpha, scaling."""
    layer = _layers(model)[0]
    return {"rank": layer.r[ADAPTER], "alpha": layer.lora_alpha[ADAPTER], "scaling": layer.scaling[ADAPTER]}


def is_adapter_key(name: str) -> bool:
    return ".lora_" in name


def base_name(name: str) -> str:
    """The base weight's name in the plain model: PEFT moves a targeted Linear's weight under `base_layer`."""
    return name.replace(".base_layer.", ".")


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@contextlib.contextmanager
def disabled(model: nn.Module):
    """The base model's forward (the reference policy). PEFT's enable_adapters(False) also flips requires_grad,
    which FSDP2 must not see change under it; the flag alone decides the forward, and scoring needs no grads."""
    layers = _layers(model)
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def split(full: dict) -> tuple[dict, dict]:
    """An adapted model's state dict as (base weights under their plain names, adapter tensors)."""
    base = {base_name(k): v for k, v in full.items() if not is_adapter_key(k)}
    return base, {k: v for k, v in full.items() if is_adapter_key(k)}


class Merged(Mapping):
    """`base` (plain names) with every adapter's update W + scaling * B @ A added in fp32, in W's dtype, each weight
    made when it is read: a reader that takes one tensor at a time (the copies into the inference model and the HF
    export) holds one merged weight beside the model, not a second whole model (7B with LoRA on one H100: 26 GiB
    more in fp32, an out-of-memory)."""

    def __init__(self, base: dict, adapters: dict, scaling: float):
        self._base, self._adapters, self._scaling = base, adapters, scaling

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        return merged_weight(name, self._base[name], self._adapters, self._scaling)

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


def merge(base: dict, adapters: dict, scaling: float) -> dict:
    """`Merged`, every weight made at once."""
    return dict(Merged(base, adapters, scaling))


def merged_weight(name: str, w: torch.Tensor, adapters: dict, scaling: float) -> torch.Tensor:
    """Base tensor `name` (its plain name) with its adapter's update added in fp32, in w's dtype; w itself when no
    adapter targets it."""
    prefix = name[: -len(".weight")]
    a = adapters.get(prefix + LORA_A)
    if not name.endswith(".weight") or a is None:
        return w
    b = adapters[prefix + LORA_B]
    return (w.float() + scaling * (b.to(w.device).float() @ a.to(w.device).float())).to(w.dtype)


def merge_into(model: nn.Module, adapters: dict, scaling: float) -> None:
    """Add the adapters' updates to a plain (unsharded) model's weights in place."""
    weights = {n: p for n, p in model.named_parameters()}
    merged = Merged({k: weights[k] for k in _targets(adapters)}, adapters, scaling)
    with torch.no_grad():
        for k, w in merged.items():  # one merged weight at a time
            weights[k].copy_(w)


def _targets(adapters: dict) -> list[str]:
    return [k[: -len(LORA_A)] + ".weight" for k in adapters if k.endswith(LORA_A)]


def save_adapter(adapters: dict, spec, base_model: str, out: Path, dtype: torch.dtype) -> None:
    """The PEFT adapter folder (`PeftModel.from_pretrained(base, out)` loads it): adapter_config.json and
    adapter_model.safetensors, whose keys PEFT writes as `base_model.model.<module>.lora_A.weight`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_config(spec, base_model).save_pretrained(str(out))
    tensors = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v.detach().to("cpu", dtype).contiguous()
               for k, v in adapters.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
