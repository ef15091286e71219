"""Training checkpoints with torch.distributed.checkpoint: sharded, and loadable at any world size.

A checkpoint folder holds `model/` (DCP: model [+ optimizer]) and `state.json` (step, data cursor, lineage).
"""

import json
import logging
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
from verlflow.core.ml import dcpio

log = logging.getLogger("verlflow.checkpoint")

# Flat optimizer keys ("optim.state.<fqn>.exp_avg") load across world sizes and FSDP1/FSDP2 alike; the nested
# form failed to load an FSDP1 critic's param_groups.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict,
         background=None) -> None:
    """Every rank writes its shards; rank 0 writes state.json. With `background` (a warm pool's
    verlflow.core.stages.committer.Committer) the state is copied to CPU memory here and written by the stage's background
    commit, before the manifest."""
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer, options=FLAT)
        sd = {"model": msd, "optim": osd}
    else:
        sd = {"model": get_model_state_dict(model)}
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    # Several writer threads per rank, each thread's error raised (verlflow.core.ml.dcpio: torch's own threads
    # swallow them, pytorch/pytorch#191391). Inline, the threads copy their tensors off the GPU themselves.
    if background is None:
        dcpio.save(sd, str(folder / "dcp"))
    else:
        background.save(sd, str(folder / "dcp"), role=folder.name)


def _check_same_model(folder: Path, target: dict) -> None:
    """DCP loads whatever keys the target asks for and ignores the rest, so a checkpoint of another architecture
    with overlapping names would load silently; compare the parameter sets and shapes first."""
    meta = dcp.FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata
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


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Reshards on load: the saving world size does not matter."""
    _check_same_model(folder, get_model_state_dict(model))
    try:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer, options=FLAT)
            sd = {"model": msd, "optim": osd}
            dcpio.load(sd, str(folder / "dcp"))
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FLAT)
        else:
            sd = {"model": get_model_state_dict(model)}
            dcpio.load(sd, str(folder / "dcp"))
            set_model_state_dict(model, sd["model"])
    except (RuntimeError, KeyError, ValueError, CheckpointException) as e:
        log.error("loading %s failed: %s", folder, e)  # the whole per-rank report; the error below is one line
        raise InputError(
            f"checkpoint {folder}: does not match the model being loaded ({str(e).splitlines()[0][:300]}). "
            "The blueprint's model must be the one this run was built from; rerun from build."
        ) from None
    return read_state(folder)


def read_state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


def load_full(folder: Path, model: nn.Module) -> None:
    """Fill an unsharded (non-FSDP) model from a DCP checkpoint without a process group."""
    sd = {"model": model.state_dict()}
    _check_same_model(folder, sd["model"])
    try:
        dcpio.load(sd, str(folder / "dcp"), no_dist=True)
    except (RuntimeError, KeyError, ValueError, CheckpointException) as e:
        raise InputError(f"checkpoint {folder}: does not match the model ({str(e).splitlines()[0][:300]})") from None
    model.load_state_dict(sd["model"])


def full_state_dict(model: nn.Module) -> dict:
    """The whole model on every rank, on CPU (for the inference copy and HF export)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
