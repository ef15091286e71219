"""The blueprint as tracker parameters: flattened (`algorithm.lr`), with nothing that may carry a secret, and only the
sections that apply to the run (a local run's parameters hold no Slurm or Kubernetes settings)."""

from __future__ import annotations

import json
import os
import re

from verlflow.core.blueprint import Blueprint
from verlflow.core.store.artifacts import carries_credentials

# Shell lines run on the nodes: they may export a token (`export HF_TOKEN=...`), so they are never logged.
SHELL_FIELDS = ("resources.slurm.setup",)
# A scheduler's own section: it applies where the run or one of its phases runs there.
BACKEND_SECTIONS = {"slurm": "resources.slurm.", "kubernetes": "resources.kubernetes."}
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.I)


def blueprint_params(bp: Blueprint) -> dict[str, str]:
    flat = _flatten(bp.model_dump(mode="json"))
    secrets = secret_env_values()
    unused = tuple(prefix for backend, prefix in BACKEND_SECTIONS.items() if backend not in backends(bp))
    return {k: v for k, v in flat.items() if k not in SHELL_FIELDS and not k.startswith(unused)
            and not carries_credentials(v) and not any(s in v for s in secrets)}


def backends(bp: Blueprint) -> set[str]:
    """Where the run's stage jobs run: the top-level resources.backend and each phase's own."""
    return {bp.resources.backend} | {ph.resources.backend for ph in bp.phases if ph.resources.backend}


def secret_env_values() -> set[str]:
    """Values of environment variables named like credentials (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY...): a
    parameter that contains one is dropped."""
    return {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= 4}


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{name}."))
        else:
            out[name] = v if isinstance(v, str) else json.dumps(v)
    return out
