"""Validate-time checks of the tracking section (cheap: no MLflow import; a tracking server gets one short request),
so that a run whose tracker cannot work is refused before anything is written."""

from __future__ import annotations

import importlib.util
import os
import urllib.error
import urllib.request

from verlflow.core.uris import carries_credentials

# Store URIs MLflow's client opens (its SQLAlchemy engines, a folder, Databricks) and the tracking-server schemes.
STORE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "file", "databricks")
SERVER_SCHEMES = ("http", "https")
PROBE_TIMEOUT_S = 5.0
_PACKAGE = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}


def tracking_problems(spec) -> list[str]:
    """One line per problem of a TrackingSpec, naming the field and the fix."""
    problems = [f"tracking.backends: {name} is listed but the package {_PACKAGE[name]!r} is not importable here; "
                f"pip install {_PACKAGE[name]} (or `pip install verlflow[tracking]`), or remove {name} from "
                "tracking.backends." for name in spec.backends if importlib.util.find_spec(_PACKAGE[name]) is None]
    if spec.mlflow_uri and "mlflow" in spec.backends:
        problems += mlflow_uri_problems(spec.mlflow_uri)
    return problems


def mlflow_uri_problems(uri: str) -> list[str]:
    scheme = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else "file"
    if carries_credentials(uri):  # the URI itself is not repeated: it holds a secret
        return ["tracking.mlflow_uri: the URI must not carry credentials (http://user:password@host); set "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment."]
    if scheme not in SERVER_SCHEMES + STORE_SCHEMES:
        return [f"tracking.mlflow_uri: {uri}: the scheme '{scheme}://' is not one MLflow tracks to; use a tracking "
                f"server (http://host:5000) or a store URI ({', '.join(s + '://' for s in STORE_SCHEMES)}), or "
                "leave it empty for the embedded store under the artifact root."]
    if scheme in SERVER_SCHEMES:
        return _server_problems(uri)
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        return [f"tracking.mlflow_uri: {uri} is a folder, MLflow's file store, which MLflow 3 opens only with "
                "MLFLOW_ALLOW_FILE_STORE=true in the environment; set it, use a database (sqlite:///path/mlflow.db), "
                "or leave tracking.mlflow_uri empty for the embedded store under the artifact root."]
    return []


def _server_problems(uri: str) -> list[str]:
    """A server that answers at all (even 401/404: a proxy in front, an older server) is reachable."""
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return []
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", e)
        return [f"tracking.mlflow_uri: the MLflow tracking server {uri} is unreachable ({why}); start it "
                f"(`mlflow server --host 0.0.0.0 --port PORT`), fix the address, or leave tracking.mlflow_uri "
                "empty for the embedded store under the artifact root."]
    return []
