"""Tiny model kits as session fixtures (a pytest plugin: tests/conftest.py lists it in `pytest_plugins`).

Imported as the top-level module `kits` (tests/ has no __init__.py; `import tests...` would find verl's own
`tests` package). Each kit takes a few seconds to make, once per session and only if a test asks for it.

Fixtures:
  tiny_kit        (session) -> make_tiny's dict for a Qwen2 kit: model_dir, train_file, test_file, kit_file, ...
  tiny_llama_kit  (session) -> the same for a Llama kit with a tied output layer.
"""

import pytest


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory) -> dict:
    from verlflow.core.testing.tinykit import make_tiny

    return make_tiny(tmp_path_factory.mktemp("kit") / "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_kit(tmp_path_factory) -> dict:
    from verlflow.core.testing.tinykit import make_tiny

    # Tied output layer, as in Qwen2.5-0.5B/1.5B: the stage tests then cover a shared parameter under FSDP2's
    # meta-initialised ranks, DCP and the fused log-prob head.
    return make_tiny(tmp_path_factory.mktemp("kit") / "llama", arch="llama", tie_word_embeddings=True)
