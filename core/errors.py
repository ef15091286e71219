"""Errors a user can act on. Each message names the field or file and what would fix it."""


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


class NonFiniteError(VerlflowError):
    """A loss or gradient norm became NaN/inf; the stage commits nothing."""

    exit_code = 3
