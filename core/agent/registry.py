"""Environments by name: a small registry, shaped like the reward registry (verlflow.core.ml.rewards).

The blueprint names one in ``rollout.agent.environment``:

- a registered name: the built-ins ``calculator``, ``python``, ``verl_tools`` (verlflow.core.agent.envs), or a
  name that the module in ``rollout.agent.module`` registers when imported (``@register_environment("name")``);
- ``package.module:Class``: any importable Environment subclass.
"""

import importlib
from typing import Any, Callable, Optional

from verlflow.core.agent.env import Environment
from verlflow.core.errors import BlueprintError
from verlflow.core.plugins import check_name, import_user_module, register_into

_REGISTRY: dict[str, type] = {}

_HOW_TO_REGISTER = (
    "To add one, either set rollout.agent.module: mypkg.envs (a module on the Python path whose import runs "
    "`from verlflow.core.agent.registry import register_environment` / `@register_environment(\"my_env\")` on a "
    "subclass of verlflow.core.agent.env.Environment) and rollout.agent.environment: my_env, "
    "or set rollout.agent.environment: 'mypkg.envs:MyEnv'."
)


def register_environment(name: str, *, overwrite: bool = False) -> Callable[[type], type]:
    """Class decorator: register an Environment subclass under `name`. Returns the class unchanged.

    Re-registering the same class (a module imported twice) is fine; taking a name held by another class needs
    ``overwrite=True``.
    """
    check_name("register_environment", name)

    def deco(cls: type) -> type:
        _check_class(cls, f"register_environment({name!r})")
        register_into(_REGISTRY, "register_environment", name, cls, overwrite)
        return cls

    return deco


def environment_names() -> list[str]:
    """The names registered so far (the built-ins included), sorted."""
    _builtins()
    return sorted(_REGISTRY)


def load_environment(name: str, module: Optional[str] = None,
                     field: str = "rollout.agent.environment") -> type[Environment]:
    """The Environment class the blueprint names (after importing `module`, rollout.agent.module, when given);
    errors name `field`."""
    if module:
        _import(module, field="rollout.agent.module", what=f"rollout.agent.module: cannot import {module!r}")
    if not isinstance(name, str) or not name.strip():
        raise BlueprintError(f"{field} must name an environment, got {name!r}. " + _HOW_TO_REGISTER)
    name = name.strip()
    if ":" not in name:
        if name not in _REGISTRY:
            _builtins()
        cls = _REGISTRY.get(name)
        if cls is None:
            raise BlueprintError(
                f"{field}: unknown environment {name!r}. Known: {', '.join(environment_names())}. " + _HOW_TO_REGISTER
            )
        return cls
    mod_name, _, attr = name.partition(":")
    if not mod_name or not attr:
        raise BlueprintError(f"{field}: {name!r} is not of the form 'package.module:Class'. " + _HOW_TO_REGISTER)
    obj: Any = _import(mod_name, field=field, what=f"{field}: cannot import module {mod_name!r}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BlueprintError(f"{field}: module {mod_name!r} has no attribute {attr!r} ({name!r}).")
        obj = getattr(obj, part)
    _check_class(obj, f"{field}: {name!r}")
    return obj


# ---------------------------------------------------------------------------------------------------
def _builtins() -> None:
    importlib.import_module("verlflow.core.agent.envs")  # its modules register the built-ins


def _check_class(obj: Any, where: str) -> None:
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise BlueprintError(
            f"{where} must be a subclass of verlflow.core.agent.env.Environment, got {obj!r}. " + _HOW_TO_REGISTER
        )


def _import(name: str, *, field: str, what: str):
    return import_user_module(name, field=field, what=what, how_to_register=_HOW_TO_REGISTER)
