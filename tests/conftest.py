"""Shared fixtures. verl installs its own top-level `tests` package, so helpers here are plain modules."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

pytest_plugins = ["s3server", "kits", "prefect_server", "reference"]
