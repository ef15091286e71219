"""Redaction of a blueprint's values before they are written out (the trackers' params, core/tracking/params.py): a
literal credential left in a blueprint by mistake (a user stage's `options: {api_key: ...}`) is never copied on.

- A value under a key the user chose (inside a free-form mapping: a phase's `options`, Kubernetes labels,
  tolerations) whose name looks like a secret: *key*, *token*, *secret*, *passw*, *pwd*, *credential*, *auth*,
  *cookie* (case-insensitive, so api_key, access_key_id, hf_token, passwd, Authorization). The blueprint's own field
  names (prompt_key, max_new_tokens, env_from_secret) are schema, not secrets, and are kept.
- A URI's user-info (`https://user:pw@host`, `s3://KEY:SECRET@bucket`), and in any text a value assigned to a
  name like a secret (a query's `?token=...`, `&X-Amz-Signature=...`; `export HF_TOKEN=...`).
- Any text holding the value of an environment variable named like a credential (WANDB_API_KEY, HF_TOKEN).
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel

from verlflow.core.store.artifacts import carries_credentials

REDACTED = "[REDACTED]"
SECRET_KEY = re.compile(r"key|token|secret|passw|pwd|credential|auth|cookie", re.I)
# Environment names by whole word (TOKENIZERS_PARALLELISM and PWD are no secrets), values of 8+ characters.
_SECRET_ENV = re.compile(r"(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(_|$)", re.I)
_MIN_ENV_SECRET = 8
_USERINFO = re.compile(r"^([A-Za-z][\w+.-]*://)([^/?#]*@)")
# name=value where the name looks like a secret: a URI's query (?token=, &X-Amz-Signature=, Azure's sig=), a shell or
# sbatch line (export HF_TOKEN=..., --export=ALL,HF_TOKEN=...)
_ASSIGNED_SECRET = re.compile(r"((?:[\w.-]*(?:key|token|secret|passw|pwd|credential|auth|signature)[\w.-]*"
                              r"|(?<![\w.-])sig)=)[^&#;,\s'\"]*", re.I)


# A key that names where a secret is (api_key_env: OPENAI_API_KEY, token_file: /run/secrets/t) holds no secret.
_POINTER_KEY = re.compile(r"_(env|var|variable|file|path)$", re.I)


def secret_key(name: str) -> bool:
    return bool(SECRET_KEY.search(name)) and not _POINTER_KEY.search(name)


def secret_env_values() -> set[str]:
    """Values of the environment variables named like credentials (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY...)."""
    return {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_ENV_SECRET}


def redact_text(text: str, env_secrets: set[str] | None = None) -> str:
    """`text` with a URI's user-info and the values assigned to secret names replaced; REDACTED whole if it holds an
    environment secret (what user-info is: core/store/artifacts.py's carries_credentials; an s3 one may hold '/')."""
    if any(s in text for s in (secret_env_values() if env_secrets is None else env_secrets)):
        return REDACTED
    if carries_credentials(text):
        cleaned = _USERINFO.sub(rf"\g<1>{REDACTED}@", text, count=1)
        if carries_credentials(cleaned.replace(f"{REDACTED}@", "")):  # s3://KEY:SE/CRET@bucket: where does it end?
            return REDACTED
        text = cleaned
    return _ASSIGNED_SECRET.sub(rf"\g<1>{REDACTED}", text)


def redacted(value: Any, schema: Any = None, env_secrets: set[str] | None = None) -> Any:
    """A JSON dump (model_dump(mode="json")) with secrets replaced; `schema` is the model it was dumped from: its
    fields' names are kept, the keys of the free-form mappings under them are judged by name."""
    env = secret_env_values() if env_secrets is None else env_secrets
    if isinstance(value, dict):
        model = schema if isinstance(schema, BaseModel) else None
        return {k: REDACTED if model is None and secret_key(str(k)) and v not in (None, "", {}, [])
                else redacted(v, getattr(model, k, None) if model is not None else None, env)
                for k, v in value.items()}
    if isinstance(value, list):
        parts = list(schema) if isinstance(schema, (list, tuple)) and len(schema) == len(value) else [None] * len(value)
        return [redacted(v, s, env) for v, s in zip(value, parts)]
    if isinstance(value, str):
        return redact_text(value, env)
    return value


def redacted_dump(model: BaseModel) -> dict:
    """A blueprint (or any section) as JSON data, redacted."""
    return redacted(model.model_dump(mode="json"), model)
