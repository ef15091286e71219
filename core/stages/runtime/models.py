"""ctx.models: the models a stage works on, from a warm pool's memory or from their checkpoints.

In a warm pool an update (and the build) leaves its models in memory after saving them, and the next stage that would
load that very checkpoint takes them from there (verlflow.core.stages.runtime.cache); its files may still be being
written in the background, and are not read then. Whether a model is taken from memory is agreed across the ranks
(verlflow.core.agree): a rank that alone missed would load, and wait in collectives the others skip. Memory gives
what a load gives, bit for bit (tests/test_stages.py, tests/test_pool.py).

How a model is read from files is the stage's maths, hashed into its key: the `loads` module run_job hands over
(verlflow.core.stages.loads). This module only decides whether it must.
"""

import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from verlflow.core.agree import every_rank
from verlflow.core.ml import checkpoint, trainstep
from verlflow.core.stages.runtime import cache

if TYPE_CHECKING:
    from verlflow.core.stages.runtime.context import StageContext


@dataclass(frozen=True)
class Trainee(trainstep.Trainee):
    """A model being trained, its optimizer, and the state.json of the checkpoint it continues."""
    state: dict


@dataclass(frozen=True)
class Policy:
    """An input's policy, to copy its weights from: in memory (`trained`, a warm pool's), else its checkpoint
    folder; with the build's meta files and the plain checkpoint LoRA adapters merge into."""
    meta_dir: Path
    trained: Trainee | None
    folder: Path | None
    base_dir: Path
    state: dict

    def gathered(self, adapters: bool = False) -> dict | None:
        """The weights in memory as one full state dict (or only the LoRA adapters), None when they are read from
        the folder. A collective: every rank calls it."""
        if self.trained is None:
            return None
        model = self.trained.model
        return checkpoint.full_adapters(model) if adapters else checkpoint.full_state_dict(model)


@dataclass(frozen=True)
class Frozen:
    """A frozen model and where it came from: "cache" (a warm pool's memory), "policy" (the policy that starts from
    its very weights), "checkpoint" (the build's files)."""
    model: Any
    source: str


@dataclass(frozen=True)
class _Export:
    model: Any
    written: threading.Event  # its stage's writes ran: it may be refilled


class Models:
    """One job's models. Every method that may take a model from memory is called on every rank, but export_copy
    (rank 0's alone: no collective depends on it)."""

    def __init__(self, ctx: "StageContext", loads: ModuleType):
        self._ctx, self._loads = ctx, loads
        self._hits: list[str] = []

    def trainee(self, role: str) -> Trainee:
        """`role` ("policy" or "critic") as the `policy` input saved it, to train on."""
        kept = self._shared(role, self._identity("policy"))
        if kept is not None:
            return kept
        build = self._ctx.input("build")
        return self._loads.load_trainee(self._ctx, build / "hf_meta", self._ctx.input("policy"), role,
                                        base=build / "ref")

    def frozen(self, role: str = "ref", policy=None) -> Frozen:
        """The build's frozen `role`. `policy`: the policy being trained, when it starts from the very weights the
        build wrote this model from: used as it is (a warm pool keeps a frozen copy for later stages)."""
        key = self._identity("build")
        kept = self._shared(role, key)
        if kept is not None:
            return Frozen(kept, "cache")
        build = self._ctx.input("build")
        if policy is not None:
            if cache.enabled():
                cache.put(role, key, self._loads.frozen_copy(self._ctx, build / "hf_meta", policy))
            return Frozen(policy, "policy")
        model = self._loads.frozen(self._ctx, build / "hf_meta", build / role)
        cache.put(role, key, model)
        return Frozen(model, "checkpoint")

    def policy(self, of: str = "policy") -> Policy:
        """The policy of input `of` (its policy/ checkpoint), to copy its weights from."""
        build = self._ctx.input("build")
        kept = self._shared("policy", self._identity(of))
        folder = self._ctx.input(of) / "policy" if kept is None else None
        state = kept.state if kept is not None else checkpoint.read_state(folder)
        return Policy(build / "hf_meta", kept, folder, build / "ref", state)

    def inference_copy(self, policy: Policy):
        """The policy's weights in an unsharded model of the inference dtype. A warm pool's previous copy is refilled
        in place: its static engine (compiled, CUDA graphs captured on these very tensors) is reused, as the
        monolithic stage reuses its own. The rollout and the evaluate stage share it."""
        key = (self._identity("build"), self._ctx.bp.fsdp.mixed_precision)
        into = self._shared("infer", key) if policy.trained is not None else None
        model = self._loads.inference_copy(self._ctx, policy, into)
        cache.put("infer", key, model)
        return model

    def export_copy(self, policy: Policy, dtype: str, make: Callable[[Any], Any]):
        """The CPU model an export writes: `make(into)`, where `into` is the last export's model once that one is
        written (a warm pool, the weights in memory), else None. Kept for the next export."""
        key = (self._identity("build"), dtype)
        idle = self._local("export", key, lambda kept: kept.written.is_set()) if policy.trained is not None else None
        model = make(idle.model if idle is not None else None)
        cache.put("export", key, _Export(model, self._ctx.write.written))
        return model

    def keep(self, role: str, model, optimizer, state: dict) -> None:
        """Leave a model this stage just saved as `role` for the next stage of a warm pool that would load it (and
        start making the CPU copy of its next background save)."""
        if optimizer is not None:
            self._ctx.write.reserve(role, lambda: checkpoint.trained_state_bytes(model))
        cache.put(role, self._identity(), Trainee(model, optimizer, state))

    def hits(self) -> list[str]:
        """The roles this job took from memory, each once."""
        return sorted(set(self._hits))

    def _shared(self, role: str, identity: tuple):
        """The kept value, on every rank or on none."""
        if not cache.enabled():
            return None
        kept = cache.get(role, identity)
        if not every_rank(kept is not None):
            return None
        self._hits.append(role)
        return kept

    def _local(self, role: str, identity: tuple, usable: Callable[[Any], bool]):
        """The kept value on this rank alone, if usable: only for what no collective depends on (rank 0's export)."""
        kept = cache.get(role, identity)
        if kept is None or not usable(kept):
            return None
        self._hits.append(role)
        return kept

    def _identity(self, name: str | None = None) -> tuple:
        """Which committed checkpoint an input (or, with no name, this stage's output) is, plus the blueprint
        sections that shape its modules."""
        job = self._ctx.job
        shape = self._ctx.bp.section_hash("model", "fsdp", "algorithm.use_remove_padding", "algorithm.adv_estimator")
        if name is None:
            return job.output, job.manifest.key, shape
        return job.inputs[name], job.input_manifests[name].key, shape
