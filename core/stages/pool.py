"""The warm pool's torchrun entry, `python -m verlflow.core.stages.pool <pool folder>` (core/stagespec.py POOL): its
serve loop is verlflow.core.stages.runtime.serve. A module of its own so that the pool's processes keep the name
they are found by (`ps`, tests/test_hangs.py)."""

from verlflow.core.stages.runtime.serve import main

if __name__ == "__main__":
    main()
