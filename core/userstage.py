"""User stages: a phase `kind: "package.module:Class"` runs your class under torchrun with the same commit, key
and manifest rules as verlflow's own stages (core/stages/user.py is its worker).

The contract::

    from verlflow.core.userstage import UserStage

    class Judge(UserStage):
        inputs = ("rollout",)           # what run() reads: build, policy, rollout, or an earlier phase's name
        outputs = ("judged.parquet",)   # what it must write under ctx.out ("policy" = a checkpoint later phases
                                        # start from, in the update's format)
        def run(self, ctx) -> dict:     # on every rank of the job; ctx.input(name) is that input's local folder,
            ...                         # ctx.out this stage's, ctx.is_main() rank 0; returns the manifest's metrics

`self.options` is the phase's `options:` mapping. The stage's key hashes the phase (options included), its inputs'
keys, and the source of the class's module: editing that file reruns the stage and everything after it. The
driver imports the class to plan the run (keep heavy imports inside run()).
"""

import hashlib
import importlib
import inspect
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from verlflow.core.errors import BlueprintError
from verlflow.core.stagespec import SPECS, StageSpec

SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
NAMED_INPUTS = ("build", "policy", "rollout")  # besides the names of earlier phases


class UserStage:
    inputs: ClassVar[tuple[str, ...]] = ("policy",)
    outputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: dict[str, Any]):
        self.options = options

    def run(self, ctx) -> dict:
        raise NotImplementedError(f"{type(self).__name__}.run(ctx) must return the stage's metrics")


def load(spec: str, field: str = "kind") -> type[UserStage]:
    """`package.module:Class` -> the class, or a BlueprintError naming `field` and the fix."""
    module, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise BlueprintError(f"{field}: cannot import {module} ({e}); install the package that holds it or fix "
                             "the dotted path.") from None
    except AttributeError:
        raise BlueprintError(f"{field}: {module} has no {name}; fix the class name after the colon.") from None
    if not (isinstance(cls, type) and issubclass(cls, UserStage)):
        raise BlueprintError(f"{field}: {spec} is not a subclass of verlflow.core.userstage.UserStage.")
    return cls


def spec_of(cls: type[UserStage]) -> StageSpec:
    """The stage spec of a user class: the user stage's, reading what the class lists."""
    return replace(SPECS["user"], inputs=tuple(cls.inputs))


def code_version(spec: str) -> str:
    """The source of the class's module (the user's half of the stage's code version)."""
    source = Path(inspect.getsourcefile(load(spec)))
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]
