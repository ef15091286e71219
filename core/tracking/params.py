"""The blueprint as tracker parameters: flattened one value a field (`algorithm.lr`; a phase's as written:
`phases.1.kind`, `phases.1.options.url`), redacted (core/redact.py: a value under a secret-looking key of a
free-form mapping, a URI's user-info or secret query value, an environment secret, each as [REDACTED]), without
shell lines, and with only the sections that apply to the run (a local run's have no Slurm or Kubernetes settings)."""

from __future__ import annotations

import json

from verlflow.core.blueprint import Blueprint
from verlflow.core.redact import redacted, redacted_dump

# Shell lines run on the nodes: they may export a token (`export HF_TOKEN=...`), so they are never logged.
SHELL_FIELDS = ("resources.slurm.setup",)
# A scheduler's own section: it applies where the run or one of its phases runs there.
BACKEND_SECTIONS = {"slurm": "resources.slurm.", "kubernetes": "resources.kubernetes."}


def blueprint_params(bp: Blueprint) -> dict[str, str]:
    data = redacted_dump(bp)
    # A phase's settings as written (its kind, and what differs from the defaults): an evaluate phase has no optimizer
    data["phases"] = [{"kind": ph.kind, **redacted(ph.model_dump(mode="json", exclude_defaults=True), ph)}
                      for ph in bp.phases]
    flat = flatten(data)
    unused = tuple(prefix for backend, prefix in BACKEND_SECTIONS.items() if backend not in backends(bp))
    return {k: v for k, v in flat.items() if k not in SHELL_FIELDS and not k.startswith(unused)}


def backends(bp: Blueprint) -> set[str]:
    """Where the run's stage jobs run: the top-level resources.backend and each phase's own."""
    return {bp.resources.backend} | {ph.resources.backend for ph in bp.phases if ph.resources.backend}


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """Mappings and lists of mappings (phases, tolerations) field by field (`phases.0.kind`); other values as
    text, a list of plain values as JSON."""
    out: dict[str, str] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, list) and v and any(isinstance(x, dict) for x in v):
            v = {str(i): x for i, x in enumerate(v)}
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v if isinstance(v, str) else json.dumps(v)
    return out
