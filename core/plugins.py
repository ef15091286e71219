"""What the registries of user code share (reward functions: core/ml/rewards.py; agent environments:
core/agent/registry.py): naming a registered object, and importing a user's module with an error that names the
blueprint field and how to register. Import-light: the driver's checks read it."""

import importlib
from typing import Any

from verlflow.core.errors import BlueprintError


def ident(obj: Any) -> str:
    """module.qualname of a registered function or class: the same object imported twice has one."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def import_user_module(name: str, *, field: str, what: str, how_to_register: str):
    """Import `name`; a failure raises a BlueprintError that starts with `what` and names `field`."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise BlueprintError(
            f"{what}: {type(e).__name__}: {e}. Check that {field} names a module on the Python path "
            f"(installed, or its folder in PYTHONPATH). " + how_to_register
        ) from e
    except Exception as e:  # the user's module raised while being imported
        raise BlueprintError(f"{what}: importing it raised {type(e).__name__}: {e}") from e


def check_name(decorator: str, name: Any) -> None:
    """A registry name: a non-empty string without ':' (which marks `package.module:attr`)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise BlueprintError(f"{decorator}: the name must be a non-empty string without ':', got {name!r}")


def register_into(table: dict, decorator: str, name: str, obj: Any, overwrite: bool) -> None:
    """table[name] = obj. The same object again (a module imported twice) is fine; another one needs `overwrite`."""
    old = table.get(name)
    if old is not None and not overwrite and ident(old) != ident(obj):
        raise BlueprintError(
            f"{decorator}({name!r}): the name is already taken by {ident(old)}; "
            f"{ident(obj)} cannot take it. Pick another name or pass overwrite=True."
        )
    table[name] = obj
