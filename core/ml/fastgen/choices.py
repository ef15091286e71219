"""The decode attention an engine timed, kept across processes (rank side).

Timing the candidates costs a pool's first rollout seconds (each Triton configuration compiled and loaded, every
candidate captured and replayed). The winner depends only on the chip, the software and the engine's shape, so it is
kept under the machine's cache folder, keyed by all of them, and a later engine of that shape on that machine reuses
it. A file that cannot be read or written is no error: the engine times again."""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from verlflow.core.cachedir import cache_root

log = logging.getLogger("verlflow.fastgen")


def where():
    return cache_root() / "fastgen" / "attention.json"


def key(device, **shape) -> str:
    import triton

    facts = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                 cuda=torch.version.cuda, **shape)
    return json.dumps(facts, sort_keys=True, default=str)


def _read() -> dict:
    try:
        return json.loads(where().read_text())
    except (OSError, ValueError):
        return {}


def load(k: str) -> dict | None:
    got = _read().get(k)
    return got if isinstance(got, dict) and got.get("attn") in ("sdpa", "triton") else None


def store(k: str, choice: dict) -> None:
    path = where()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read(), k: choice}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".attention-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)  # whole or not at all: another rank may be reading it
    except OSError as e:
        log.info("fastgen: could not keep the attention choice in %s (%s)", path, e)
