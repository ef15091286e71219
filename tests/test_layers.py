"""The rooms' import rules (pyproject.toml's [tool.importlinter], README "Where the code lives") hold, and a planted
upward import breaks them: the rule that a path says which process runs it is a check, not a promise."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _tree(tmp_path: Path) -> Path:
    """The three packages laid out as `verlflow/<room>`, first on the path, with the project's contracts."""
    for room in ("core", "tasks", "flows"):
        shutil.copytree(REPO / room, tmp_path / "verlflow" / room, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold_and_a_planted_upward_import_breaks_them(tmp_path):
    root = _tree(tmp_path)
    kept = _lint(root)
    assert kept.returncode == 0 and "0 broken" in kept.stdout, kept.stdout + kept.stderr
    (root / "verlflow/core/ml/planted.py").write_text("from verlflow.core.orchestrate import runner\n")
    (root / "verlflow/core/blueprint/planted.py").write_text("def f():\n    from verlflow.core.store import artifacts\n")
    broken = _lint(root)
    assert broken.returncode != 0, broken.stdout
    assert "a rank never imports the driver BROKEN" in broken.stdout, broken.stdout
    assert "verlflow.core.ml.planted -> verlflow.core.orchestrate.runner" in broken.stdout, broken.stdout
    assert "verlflow.core.blueprint.planted -> verlflow.core.store.artifacts" in broken.stdout, broken.stdout
    assert "2 broken" in broken.stdout, broken.stdout
