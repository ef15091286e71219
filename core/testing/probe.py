"""A tiny torchrun worker for tests/test_launcher.py: each --mode exercises one path of the launcher."""

import argparse
import os
import time

from verlflow.core.stages.runtime.entry import run_and_exit, worker_guard



def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "raise", "hang", "barrier-hang", "nonfinite",
                                                         "sleep-then-print"], default="ok")
    parser.add_argument("--pid-dir", help="each rank writes rank<N>.pid and torchrun.pid (its parent) here")
    return parser.parse_args()


def _write_pids(pid_dir: str | None) -> None:
    """Before torch is imported: on a loaded machine a test's short timeout may end the job during the imports,
    and the test must still find every process it has to see gone."""
    if not pid_dir:
        return
    rank = os.environ["RANK"]
    for name, pid in (("torchrun.pid", os.getppid()), (f"rank{rank}.pid", os.getpid())):
        with open(os.path.join(pid_dir, name + ".tmp" + rank), "w") as f:
            f.write(str(pid))
        os.replace(f.name, os.path.join(pid_dir, name))  # readers never see a half-written file


worker_guard()  # before the slow imports: a worker must never outlive torchrun
ARGS = _args()
_write_pids(ARGS.pid_dir)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from verlflow.core.errors import NonFiniteError  # noqa: E402


@record
def main() -> None:
    args, rank = ARGS, int(os.environ["RANK"])
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"all_reduce={total.item():g}", flush=True)
    if args.mode == "raise" and rank == 1:
        raise ValueError("boom-123")
    if args.mode == "nonfinite" and rank == 0:
        raise NonFiniteError("grad norm is nan at step 7")
    if args.mode == "sleep-then-print":
        print("first", flush=True)
        time.sleep(1.5)
        print("second", flush=True)
    if args.mode in ("hang", "barrier-hang") and args.pid_dir:  # a test may stop the job once both are here
        open(os.path.join(args.pid_dir, f"hung{rank}"), "w").close()
    if args.mode == "barrier-hang" and rank == 0:
        dist.barrier()  # rank 1 never comes: a hung collective
    while args.mode in ("hang", "barrier-hang"):
        time.sleep(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
