"""Tiny model kits as session fixtures (a pytest plugin: tests/conftest.py lists it in `pytest_plugins`).

Imported as the top-level module `kits` (tests/ has no __init__.py; `import tests...` would find verl's own
`tests` package). Each kit takes a few seconds to make, once per session and only if a test asks for it; under
pytest-xdist the workers share one (built_once), so a stage key that holds model.path is the same in every worker.

Fixtures:
  tiny_kit        (session) -> make_tiny's dict for a Qwen2 kit: model_dir, train_file, test_file, kit_file, ...
  tiny_llama_kit  (session) -> the same for a Llama kit with a tied output layer.
"""

import json
import os

import pytest
from filelock import FileLock


def built_once(tmp_path_factory, name: str, build):
    """build(folder) -> a JSON-able result, made once per test session: under pytest-xdist by the first worker
    that asks, in a folder every worker sees (the session's base temp), while the others wait and read it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{folder}.lock"):
        done = folder / "built.json"
        if done.exists():
            return json.loads(done.read_text())
        folder.mkdir(exist_ok=True)
        result = build(folder)
        done.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory) -> dict:
    from verlflow.core.testing.tinykit import make_tiny

    return built_once(tmp_path_factory, "kit-qwen2", lambda folder: make_tiny(folder / "qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_kit(tmp_path_factory) -> dict:
    from verlflow.core.testing.tinykit import make_tiny

    # Tied output layer, as in Qwen2.5-0.5B/1.5B: the stage tests then cover a shared parameter under FSDP2's
    # meta-initialised ranks, DCP and the fused log-prob head.
    return built_once(tmp_path_factory, "kit-llama",
                      lambda folder: make_tiny(folder / "llama", arch="llama", tie_word_embeddings=True))
