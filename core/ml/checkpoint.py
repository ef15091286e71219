"""Training checkpoints with torch.distributed.checkpoint: sharded, and loadable at any world size.

A checkpoint folder holds `dcp/` (DCP: model [+ optimizer]) and `state.json` (step, data cursor, lineage). Of a
LoRA policy (verlflow.core.ml.lora) it holds the adapters and their optimizer only, and state.json's `lora` says so
(rank, alpha, scaling): loads take the base weights from another, plain checkpoint (the build's `ref/`).
"""

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from verlflow.core.errors import InputError
from verlflow.core.ml import dcpio, lora
from verlflow.core.agree import any_rank

log = logging.getLogger("verlflow.checkpoint")

# Flat optimizer keys ("optim.state.<fqn>.exp_avg") load across world sizes and FSDP1/FSDP2 alike; the nested
# form failed to load an FSDP1 critic's param_groups.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _options(model: nn.Module, **kw) -> StateDictOptions:
    """FLAT; an adapted model's trainable part only (its frozen base lives in another checkpoint)."""
    if lora.is_adapted(model):
        kw.update(ignore_frozen_params=True, strict=False)
    return StateDictOptions(flatten_optimizer_state_dict=True, **kw)


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict,
         write=None) -> str:
    """Every rank writes its shards; rank 0 writes state.json. `write`: a stage's ctx.write
    (verlflow.core.stages.runtime.commit.Writes), which writes the shards now or copies them to CPU memory for the
    stage's background commit to write before the manifest. Returns "inline", or how that CPU copy came.
    """
    options = _options(model)
    # agreed: get_state_dict's collectives follow (every rank steps together, so this only guards a surprise)
    if optimizer is not None and any_rank(bool(optimizer.state)):
        msd, osd = get_state_dict(model, optimizer, options=options)
        sd = {"model": msd, "optim": osd}
    else:  # an optimizer that never stepped (the build's) is all zeros: nothing to write; load() starts it afresh
        sd = {"model": get_model_state_dict(model, options=options)}
    if lora.is_adapted(model):
        state = {**state, "lora": lora.describe(model)}
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    # Several writer threads per rank, each thread's error raised (verlflow.core.ml.dcpio: torch's own threads
    # swallow them, pytorch/pytorch#191391). Inline, the threads copy their tensors off the GPU themselves.
    if write is None:
        dcpio.save(sd, str(folder / "dcp"))
        return "inline"
    return write.save(sd, str(folder / "dcp"), role=folder.name)


def trained_state_bytes(model: nn.Module) -> int:
    """At least the CPU copy (dcpio.copy_bytes) of this rank's part of what save() writes for `model` with an
    AdamW that has stepped: the weights (of an adapted model its adapters), two moments and a step per trainable
    parameter, and the buffers."""
    adapted = lora.is_adapted(model)
    # Every name: a tied head is one parameter but two state-dict entries (Qwen2.5-1.5B's 0.93 GB embedding).
    total = sum(dcpio.local_bytes(b) for _, b in model.named_buffers(remove_duplicate=False))
    for _, p in model.named_parameters(remove_duplicate=False):
        n = dcpio.local_bytes(p)
        total += (n if p.requires_grad or not adapted else 0) + (2 * n + dcpio.ALIGN if p.requires_grad else 0)
    return total


def _saved(folder: Path) -> dict:
    return dcp.FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata


def _check_same_model(folder: Path, target: dict, meta: dict | None = None) -> None:
    """DCP loads whatever keys the target asks for and ignores the rest, so a checkpoint of another architecture
    with overlapping names would load silently; compare the parameter sets and shapes first."""
    meta = _saved(folder) if meta is None else meta
    saved = {k[len("model."):]: tuple(v.size) for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}
    want = {k: tuple(v.shape) for k, v in target.items() if hasattr(v, "shape")}
    extra, missing = sorted(set(saved) - set(want)), sorted(set(want) - set(saved))
    shapes = sorted(k for k in set(saved) & set(want) if saved[k] != want[k])
    if extra or missing or shapes:
        detail = "; ".join(f"{name}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" for name, keys in
                           (("only in the checkpoint", extra), ("missing from it", missing), ("other shape", shapes))
                           if keys)
        raise InputError(
            f"checkpoint {folder}: does not match the model being loaded ({detail}). The blueprint's model must be "
            "the one this run was built from; rerun from build (verlflow rerun RUN_ID --from build)."
        )


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         base: Path | None = None) -> dict:
    """Reshards on load: the saving world size does not matter. An adapted model takes its base weights from the
    plain checkpoint `base` first (None: they are already in place), then its adapters from `folder`."""
    if base is not None and lora.is_adapted(model):
        _load_base(base, model)
    options = _options(model)
    meta = _saved(folder)
    _check_same_model(folder, get_model_state_dict(model, options=options), meta)
    if optimizer is not None and not any(k.startswith("optim.") for k in meta):
        optimizer = None  # saved before its first step (save()): a fresh optimizer is that state exactly
    try:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer, options=options)
            sd = {"model": msd, "optim": osd}
            dcpio.load(sd, str(folder / "dcp"))
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                           options=options)
        else:
            sd = {"model": get_model_state_dict(model, options=options)}
            dcpio.load(sd, str(folder / "dcp"))
            set_model_state_dict(model, sd["model"], options=options)
    except (RuntimeError, KeyError, ValueError, CheckpointException) as e:
        log.error("loading %s failed: %s", folder, e)  # the whole per-rank report; the error below is one line
        raise InputError(
            f"checkpoint {folder}: does not match the model being loaded ({str(e).splitlines()[0][:300]}). "
            "The blueprint's model must be the one this run was built from; rerun from build."
        ) from None
    return read_state(folder)


def _load_base(folder: Path, model: nn.Module) -> None:
    """An adapted model's base weights from a plain checkpoint of the same model: names mapped, adapters untouched."""
    sd = {k: v for k, v in get_model_state_dict(model).items() if not lora.is_adapter_key(k)}
    base = {lora.base_name(k): v for k, v in sd.items()}
    _check_same_model(folder, base)
    dcpio.load({"model": base}, str(folder / "dcp"))
    set_model_state_dict(model, {k: base[lora.base_name(k)] for k in sd}, options=StateDictOptions(strict=False))


def read_state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


def load_full(folder: Path, model: nn.Module, *, base: Path | None = None) -> None:
    """Fill an unsharded (non-FSDP) model from a DCP checkpoint without a process group. A LoRA policy's checkpoint
    (adapters only) needs the plain checkpoint of its base in `base`; the model gets the merged weights."""
    adapters = read_state(folder).get("lora") if (folder / "state.json").is_file() else None
    if adapters is not None:
        if base is None:
            raise InputError(f"checkpoint {folder} holds LoRA adapters only; its base model's checkpoint is needed")
        load_full(base, model)
        lora.merge_into(model, read_tensors(folder), adapters["scaling"])
        return
    sd = {"model": model.state_dict()}
    _check_same_model(folder, sd["model"])
    try:
        dcpio.load(sd, str(folder / "dcp"), no_dist=True)
    except (RuntimeError, KeyError, ValueError, CheckpointException) as e:
        raise InputError(f"checkpoint {folder}: does not match the model ({str(e).splitlines()[0][:300]})") from None
    model.load_state_dict(sd["model"])


def read_tensors(folder: Path) -> dict:
    """Every model tensor of a checkpoint, whole, without a process group (a LoRA policy's adapters)."""
    meta = dcp.FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata
    sd = {k[len("model."):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}
    dcpio.load({"model": sd}, str(folder / "dcp"), no_dist=True)
    return sd


@torch.no_grad()
def copy_state_into(plain: nn.Module, full: Mapping) -> None:
    """``plain.load_state_dict(full)``'s values, one tensor at a time: each is read from ``full`` (a ``lora.Merged``
    makes a merged weight then), cast on its own device and copied in, so no second whole copy of the model is
    made beside ``full`` and ``plain``."""
    into = plain.state_dict(keep_vars=True)
    if set(full) != set(into):
        raise RuntimeError(f"the copy's tensors differ from the policy's: missing {sorted(set(into) - set(full))[:5]}, "
                           f"unexpected {sorted(set(full) - set(into))[:5]}")
    for name, t in into.items():
        src = full[name]
        # cast where the source is: a device-to-host copy then moves the target dtype's bytes
        t.copy_(src if src.device == t.device else src.to(t.dtype))


def copy_full_into(model: nn.Module, plain: nn.Module) -> None:
    """The whole of ``model`` (sharded; an adapted one with its adapters merged) copied into the unsharded
    ``plain`` model on every rank (collective), cast as each tensor lands."""
    copy_state_into(plain, full_state_dict(model))


def full_state_dict(model: nn.Module) -> Mapping:
    """The whole model on every rank, on its device (for the inference copy and HF export; collective): of an adapted
    model, the plain model's names with the adapters merged in as each weight is read (``lora.Merged``)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    if not lora.is_adapted(model):
        return full
    base, adapters = lora.split(full)
    return lora.Merged(base, adapters, lora.describe(model)["scaling"])


def full_adapters(model: nn.Module) -> dict:
    """An adapted model's adapters, whole, on every rank (collective): the PEFT adapter export."""
    return {k: v for k, v in get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=False, ignore_frozen_params=True)).items() if lora.is_adapter_key(k)}
