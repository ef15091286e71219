"""Errors a user can act on. Each message names the field or file and what would fix it."""

import errno


class VerlflowError(Exception):
    """Base class: the CLI prints these as one paragraph and exits non-zero (no traceback)."""

    exit_code = 2


class BlueprintError(VerlflowError):
    """The blueprint (YAML, overrides, or cross-field rules) is not acceptable."""


class InputError(VerlflowError):
    """A dataset, model folder, or other input named by the blueprint is unusable."""


class StoreError(VerlflowError):
    """The artifact store cannot be reached, written, or holds something inconsistent."""


class UnsafeKeyError(StoreError):
    """An artifact key would escape its prefix ('..', absolute path, odd characters)."""


class ChecksumError(StoreError):
    """A committed file does not match the sha256/size its manifest recorded."""


class PrunedError(StoreError):
    """A committed stage's file that retention pruned (verlflow.core.store.retention) is needed."""


class PrefectServerError(VerlflowError):
    """The Prefect server refused a request or could not be reached, after the Prefect client's own retries."""


class NonFiniteError(VerlflowError):
    """A loss or gradient norm became NaN/inf; the stage commits nothing."""

    exit_code = 3


NO_SPACE_FIX = "free space there, or keep fewer artifacts (storage.keep_last)"


def is_no_space(exc: BaseException) -> bool:
    """Whether a failed write hit a full filesystem: an OSError anywhere in the chain, one of the ranks' errors that
    DCP's CheckpointException wraps, or a library's message of it (safetensors' StorageFull)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "StorageFull" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values()]  # CheckpointException
    return False
