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
