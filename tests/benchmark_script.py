"""infra/bench/<script> loaded as a module, for the tests that run a benchmark's main() or parser() in-process (each
benchmark puts the repository and infra/bench/ on sys.path itself)."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "infra" / "bench"


def load(script: str):
    path = BENCHMARKS / Path(script).name
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
