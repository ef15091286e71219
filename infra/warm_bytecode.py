"""Byte-compile what verlflow's processes import, by importing it: a stage rank's modules in one process, the
driver's and Prefect server's in another, at once (make's install step runs this).

Python caches the code it compiles on a first import, except where PYTHONDONTWRITEBYTECODE is set (this machine and
CI set it): there every rank of every stage job compiled torch, transformers and verl from source again, twice a
rank's import time. Importing them once with caching on writes those ~7,000 modules' caches in ~21 s on 2 cores;
`compileall` of the whole venv (30,000 files, twice) took 60 s. A module outside these lists is compiled on its first
import as usual (make's recipes run with caching on)."""

import importlib
import os
import subprocess
import sys
import warnings

GROUPS = {
    "rank": ["verlflow.core.stages.pool", "verlflow.core.stages.build", "verlflow.core.stages.rollout",
             "verlflow.core.stages.update", "verlflow.core.stages.export", "verlflow.core.stages.evaluate",
             "transformers.models.qwen2.modeling_qwen2", "peft", "torch._inductor.compile_fx",
             "verl.utils.reward_score"],
    "driver": ["verlflow.flows.cli", "verlflow.flows.finetune", "verlflow.flows.deploy", "prefect.server.api.server",
               "prefect.cli", "mlflow"],
}


def warm(group: str) -> None:
    for name in GROUPS[group]:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional part missing only leaves its modules to a first import
            warnings.warn(f"warm_bytecode: {name} did not import ({type(e).__name__}: {e})", stacklevel=1)


def main() -> int:
    if len(sys.argv) > 1:
        warm(sys.argv[1])
        return 0
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    procs = [subprocess.Popen([sys.executable, __file__, group], env=env) for group in GROUPS]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
