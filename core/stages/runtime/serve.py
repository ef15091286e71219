"""The warm pool's serve loop: one torchrun job that runs stage jobs one after another (resources.warm_workers),
started as `python -m verlflow.core.stages.pool <pool folder>`.

The runner (verlflow.core.orchestrate.pool.WarmPool) writes `job-<n>.json` into the pool folder; every rank picks it up,
runs the named stage's `run` through the same `run_job` a fresh stage process uses, and rank 0 answers with
`done-<n>.json`. Imports, the CUDA context, the process group and compile caches stay warm between stages. Any
exception ends the whole pool (torchrun reports it exactly as for a one-job stage); the runner starts a fresh
pool for the next stage.
"""

import gc
import importlib
import json
import os
import sys
import time
from pathlib import Path

from verlflow.core.guard import leave_if_parent_gone, not_orphaned
from verlflow.core.wait import wait_until

POLL_S = 0.01


def next_message(pool_dir: Path, n: int) -> dict:
    path = pool_dir / f"job-{n}.json"

    def arrived() -> bool:
        leave_if_parent_gone(not_orphaned)  # torchrun is gone (PDEATHSIG covers most cases; this the rest)
        return path.exists()

    wait_until(arrived, interval_s=POLL_S)
    return json.loads(path.read_text())


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    from verlflow.core.stages.runtime.entry import run_and_exit, worker_guard

    @record
    def serve() -> None:
        import torch
        import torch.distributed as dist

        from verlflow.core.checks.memplan import DeviceOutOfMemory
        from verlflow.core.stagespec import SPECS, spec
        from verlflow.core.stages.runtime import committer as committers
        from verlflow.core.stages.common import run_job

        worker_guard()
        pool_dir = Path(sys.argv[1])
        for s in SPECS.values():  # the pool's start-up imports what the pipeline's stages need, once
            importlib.import_module(s.module)
        n, ready_at = 0, time.time()  # spawned and imported: what follows is the stages' own time
        try:
            while True:
                n += 1
                msg = next_message(pool_dir, n)
                if msg.get("stop"):
                    committers.drain_pool()  # a failed background commit fails the pool, and so the run
                    return
                stage = importlib.import_module(spec(msg["stage"]).module)
                try:
                    done = run_job(Path(msg["job"]), stage.main.run, stage.main.after_commit, in_pool=True,
                                   pool_ready_at=ready_at if n == 1 else None)
                except DeviceOutOfMemory:
                    # The earlier stages' background commits land first (on their own group, while the other
                    # ranks wait in this stage's collectives): the runner's retry (resources.oom_retry) reads them.
                    committers.drain_pool()
                    raise
                gc.collect()  # the stage's models are garbage now; give their memory back before the next
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if int(os.environ.get("RANK", 0)) == 0:
                    tmp = pool_dir / f".done-{n}.json"
                    tmp.write_text(json.dumps({"job": msg["job"], **(done or {})}))
                    os.replace(tmp, pool_dir / f"done-{n}.json")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    run_and_exit(serve)
