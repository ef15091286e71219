"""Where each tracker writes, decided once: under the artifact root's `tracking/` folder for local stores; for
s3:// stores (a SQLite database and event files need a local disk) in $VERLFLOW_CACHE_DIR (default
~/.cache/verlflow)/tracking/<bucket/prefix>/. Also the ledger's key and what it says about the MLflow run."""

from __future__ import annotations

from pathlib import Path

from verlflow.core.cachedir import cache_root
from verlflow.core.store.artifacts import ArtifactStore

MLFLOW_DB = "mlflow.db"


def ledger_key(run_id: str) -> str:
    return f"tracking/{run_id}.json"


def local_root(store: ArtifactStore) -> Path:
    """The folder that holds the embedded MLflow store, TensorBoard's event files and W&B's run folders."""
    if store.is_local:
        return store.local_path("tracking")
    cache = cache_root()
    return cache / "tracking" / store.root.strip("/")


def embedded_mlflow_uri(store: ArtifactStore) -> str:
    """MLflow 3's recommended local store: a SQLite database (the ./mlruns file store is deprecated)."""
    return f"sqlite:///{local_root(store) / MLFLOW_DB}"


def mlflow_run_url(store: ArtifactStore, run_id: str) -> str | None:
    """The MLflow run of a verlflow run: its page on a tracking server (http URIs), else the store URI holding it;
    None until the run has opened an MLflow run. Read from the ledger: no MLflow import, no request."""
    return _ledger(store, run_id).get("mlflow_url")


def summary_lines(store: ArtifactStore, run_id: str) -> list[str]:
    """The run summary's line linking the MLflow run (none when the run is not tracked in MLflow); for an embedded
    store, how to serve it and the run's page there (`mlflow ui` listens on 127.0.0.1:5000)."""
    ledger = _ledger(store, run_id)
    url = ledger.get("mlflow_url")
    if url is None:
        return []
    if url.startswith(("http://", "https://")):
        return [f"- MLflow run: [{url}]({url})"]
    page = f", then open `http://127.0.0.1:5000/{ledger['mlflow_page']}`" if ledger.get("mlflow_page") else ""
    return [f"- MLflow run {run_id} in `{url}` (browse: `mlflow ui --backend-store-uri {url}`{page})"]


def _ledger(store: ArtifactStore, run_id: str) -> dict:
    import json

    key = ledger_key(run_id)
    return json.loads(store.get_bytes(key)) if store.exists(key) else {}
