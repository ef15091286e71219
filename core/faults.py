"""Fault points: where a production code path can be made to fail on purpose, for the reliability suite
(tests/test_faults.py). Inert unless VERLFLOW_FAULT is set: every point is then one dictionary lookup.

Values of VERLFLOW_FAULT:
    nan_loss                   the policy loss becomes NaN (core/ml/ppo.py)
    kill_rank<N>_in_update     rank N SIGKILLs itself after the first optimizer step of `update`
    kill_rank<N>_in_commit     rank N SIGKILLs itself as a warm pool's background commit begins
    kill_rank<N>_in_rollout    rank N SIGKILLs itself in an agent rollout, its trajectories made, before the gather
    kill_rank<N>_in_export     rank N SIGKILLs itself as it writes the HF export (export stage; in a warm pool
                               with async_checkpoint, in the background before the commit)
    kill_rank0_in_prune        rank 0 SIGKILLs itself in a retention pass, after a pruned manifest is committed
                               and before that stage's files are deleted (core/store/retention.py)
    oom_rank<N>_above<T>       rank N runs out of memory (torch.OutOfMemoryError) in the forward of a micro-batch of
                               more than T tokens (core/ml/forward.py: the update's and the sft/dpo phases')
    hang_in_<stage>            every rank of <stage> sleeps before its work (a hung job, for timeouts/cancel/kill)
    barrier_hang_in_<stage>    rank 0 of <stage> waits in a barrier the other ranks never enter (a hung collective)
VERLFLOW_FAULT_ONCE=<path>: the fault fires only for the first process that creates <path> (O_EXCL), so the retry
or rerun of the same stage runs clean.
"""

import os
import re
import signal
import time


def requested(name: str) -> bool:
    """Whether VERLFLOW_FAULT names this fault (every rank alike: VERLFLOW_FAULT_ONCE does not apply)."""
    return os.environ.get("VERLFLOW_FAULT") == name


def active(name: str) -> bool:
    """Whether this fault fires here: requested, and (VERLFLOW_FAULT_ONCE) in the first process to ask."""
    if not requested(name):
        return False
    once = os.environ.get("VERLFLOW_FAULT_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def kill_point(where: str, rank: int) -> None:
    if active(f"kill_rank{rank}_in_{where}"):
        print(f"[verlflow fault] rank {rank}: SIGKILL in {where}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_OOM = re.compile(r"oom_rank(\d+)_above(\d+)")


def oom_point(tokens: int) -> None:
    """VERLFLOW_FAULT=oom_rank<N>_above<T>: on rank N (torchrun's RANK), a micro-batch of more than T tokens."""
    fault = os.environ.get("VERLFLOW_FAULT")
    m = _OOM.fullmatch(fault) if fault else None
    if m and int(os.environ.get("RANK", 0)) == int(m[1]) and tokens > int(m[2]):
        import torch

        print(f"[verlflow fault] rank {m[1]}: out of memory on a micro-batch of {tokens} tokens", flush=True)
        raise torch.OutOfMemoryError(f"CUDA out of memory (VERLFLOW_FAULT={fault}: {tokens} tokens)")


def hang_point(where: str, rank: int) -> None:
    if active(f"barrier_hang_in_{where}"):
        print(f"[verlflow fault] rank {rank}: hanging in {where}" + (" (in a barrier)" if rank == 0 else ""), flush=True)
        if rank == 0:
            import torch.distributed as dist

            dist.barrier()  # the other ranks sleep below: a collective that never completes
        _sleep_forever()
    if active(f"hang_in_{where}"):
        print(f"[verlflow fault] hanging in {where}", flush=True)
        _sleep_forever()


def _sleep_forever() -> None:
    while True:
        time.sleep(1)
