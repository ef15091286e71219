"""DCP at disk speed: several writer (and reader) threads per rank whose errors always reach the caller, and a CPU
copy of a state dict in one slab of memory (pinned on CUDA) for background saves.

torch's own FileSystemWriter(thread_count > 1) runs its extra threads with no error path: a failing thread's files
and results are dropped and the save reports success (pytorch/pytorch#191391). Here each thread runs torch's
single-threaded write_data on its own share of the rank's items, in a pool whose futures re-raise, and the results
are checked against the plan before DCP writes the metadata.
"""

import copy
import dataclasses
import errno
import logging
import math
import os
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.tensor import DTensor
from torch.futures import Future

log = logging.getLogger("verlflow.checkpoint")

MAX_THREADS = 16  # H200, 1.5B: 16 threads saved at 3.4 GB/s to a RAM disk, 8 at 1.9; past this a rank's share of the node's cores or the disk, not the threads, limits the rate
ALIGN = 256  # slab offsets: any dtype's alignment, and DMA-friendly


def io_threads() -> int:
    """Threads per rank: this node's usable cores shared by its ranks, at most MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_THREADS, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


class ParallelWriter(FileSystemWriter):
    """One file per thread per rank (`__<rank>_<thread>_0.distcp`), fsynced; every thread's error is raised."""

    def __init__(self, path, threads: int | None = None, device: int | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.threads, self.device = threads or io_threads(), device

    def write_data(self, plan: SavePlan, planner) -> Future:
        shares = _split(plan.items, _write_size, self.threads)
        prefix = plan.storage_data.prefix
        subplans = [dataclasses.replace(plan, items=share, storage_data=dataclasses.replace(
            plan.storage_data, prefix=f"{prefix}{n}_")) for n, share in enumerate(shares)]
        write = super().write_data
        try:
            results = [r for rs in _run_all(lambda sub: write(sub, planner).wait(), subplans, self.device)
                       for r in rs]
        except BaseException as e:
            _name_a_full_disk(e, str(self.path), sum(map(_write_size, plan.items)))
            raise
        _check_written(plan, results)
        done: Future = Future()
        done.set_result(results)
        return done


class ParallelReader(FileSystemReader):
    """Reads the rank's items in `threads` runs of about equal bytes, each in file and offset order."""

    def __init__(self, path, threads: int | None = None, device: int | None = None):
        super().__init__(path)
        self.threads, self.device = threads or io_threads(), device

    def read_data(self, plan: LoadPlan, planner) -> Future:
        info = self.storage_data
        items = sorted(plan.items, key=lambda r: (info[r.storage_index].relative_path, info[r.storage_index].offset))
        runs = _runs(items, lambda r: info[r.storage_index].length, self.threads)
        read = super().read_data
        _run_all(lambda sub: read(sub, planner).wait(), [dataclasses.replace(plan, items=run) for run in runs],
                 self.device)
        done: Future = Future()
        done.set_result(None)
        return done


def _name_a_full_disk(error: BaseException, path: str, nbytes: int) -> None:
    """A write that fails on a filesystem too full for it is a full disk, whatever the writer said: torch.save's
    zip writer reports ENOSPC as "unexpected pos" when the short write came from another of its calls."""
    if isinstance(error, OSError):
        return
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"No space left on device: {free} bytes free at {path} for this rank's "
                      f"{nbytes} bytes of checkpoint ({type(error).__name__}: {error})") from error


def _write_size(item) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 1
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _split(items: list, size: Callable, n: int) -> list[list]:
    """Largest first onto the lightest share: shares of about equal bytes (never an empty one)."""
    shares: list[list] = [[] for _ in range(max(1, min(n, len(items))))]
    loads = [0] * len(shares)
    for item in sorted(items, key=size, reverse=True):
        i = loads.index(min(loads))
        shares[i].append(item)
        loads[i] += size(item)
    return shares


def _runs(items: list, size: Callable, n: int) -> list[list]:
    """Consecutive runs of `items` of about equal bytes, so each thread reads its part of a file in order."""
    total = sum(size(i) for i in items)
    runs: list[list] = [[]]
    done = 0
    for item in items:
        if runs[-1] and done >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(item)
        done += size(item)
    return runs


def _run_all(fn: Callable, args: list, device: int | None) -> list:
    """fn over args on one thread each (on CUDA `device`: a new thread starts on device 0, where torch's loader
    would sync the wrong stream); waits for all, then raises one of their errors."""
    if len(args) == 1:
        return [fn(args[0])]
    init = (lambda: torch.cuda.set_device(device)) if device is not None else None
    with ThreadPoolExecutor(max_workers=len(args), initializer=init, thread_name_prefix="verlflow-dcp") as pool:
        futures = [pool.submit(fn, a) for a in args]
    errors = [f.exception() for f in futures if f.exception() is not None]
    # An OSError first: it names the cause (a full disk, say); torch.save's "unexpected pos" after a short write
    # in another thread is only its echo.
    errors.sort(key=lambda e: not isinstance(e, OSError))
    for e in errors[1:]:
        log.error("another DCP I/O thread failed too: %s: %s", type(e).__name__, e)
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def _check_written(plan: SavePlan, results: list) -> None:
    """Every item of the plan has a result (a lost one would be missing from the metadata: a checkpoint that does
    not load)."""
    missing = {i.index for i in plan.items} - {r.index for r in results}
    if missing:
        raise RuntimeError(f"DCP save: {len(missing)} of {len(plan.items)} items were not written "
                           f"(e.g. {sorted(map(str, missing))[:3]})")


def save(state_dict: dict, checkpoint_id: str, *, process_group=None, threads: int | None = None,
         device: int | None = None) -> None:
    """dcp.save with ParallelWriter; `device`: the CUDA device the state came from (default: its tensors')."""
    import torch.distributed.checkpoint as dcp

    writer = ParallelWriter(checkpoint_id, threads, cuda_device(state_dict) if device is None else device)
    dcp.save(state_dict, storage_writer=writer, process_group=process_group)


def load(state_dict: dict, checkpoint_id: str, *, no_dist: bool = False, threads: int | None = None) -> None:
    import torch.distributed.checkpoint as dcp

    reader = ParallelReader(checkpoint_id, threads, cuda_device(state_dict))
    dcp.load(state_dict, storage_reader=reader, no_dist=no_dist)


def cuda_device(state_dict: dict) -> int | None:
    """The CUDA device index of the state's tensors (None on CPU): the I/O threads run on it."""
    return next((t.device.index for t in _leaves(state_dict) if t.device.type == "cuda"), None)


# --- the CPU copy ---------------------------------------------------------------------------------------------

def layout(state_dict) -> tuple:
    """Names, shapes and dtypes of a (nested) state dict: a CPU copy fits only the same layout."""
    out = []

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, torch.Tensor):
            out.append((prefix, tuple(obj.shape), obj.dtype, tuple(t.shape for t in _locals(obj))))

    walk("", state_dict)
    return tuple(out)


def _locals(obj: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a (DTensor, ShardedTensor or plain) tensor's data on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(obj, DTensor):
        with torch.no_grad():
            return [obj.to_local()]  # without grad: the DTensor's own local tensor, not a view of it
    if isinstance(obj, ShardedTensor):
        return [s.tensor for s in obj.local_shards()]
    return [obj]


def _leaves(state_dict) -> list[torch.Tensor]:
    out = []

    def walk(obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, torch.Tensor):
            out.extend(_locals(obj))

    walk(state_dict)
    return out


def _cpu_structure(obj):
    """The same nesting with each tensor on CPU (DTensor and ShardedTensor keep their sharding): their data is
    replaced by slab views next, so none is copied (torch's own stager copies each tensor to fresh pageable
    memory first: ~14 s for 19.5 GB on an H200 host, most of what making the copy cost)."""
    if isinstance(obj, dict):
        return {k: _cpu_structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_structure(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            if type(obj) is torch.Tensor or isinstance(obj, nn.Parameter):
                return torch.empty_like(obj.detach(), device="cpu")
            if isinstance(obj, DTensor):  # the same placement spec around an empty CPU local tensor
                return DTensor(torch.empty_like(obj.to_local(), device="cpu"), obj._spec, requires_grad=False)
            return copy.deepcopy(obj) if obj.device.type == "cpu" else obj.to("cpu")
    return copy.deepcopy(obj)


class CpuCopy:
    """A CPU copy of a state dict whose tensors all live in one slab: one allocation (and on CUDA one page-locking)
    for the whole state, instead of a pinned tensor per entry. Refill it with copy_from() for each save; it fits
    only state dicts of its layout."""

    def __init__(self, state_dict: dict, *, pin: bool, slab: torch.Tensor | None = None):
        """`slab`: one made beforehand (make_slab), at least copy_bytes(state_dict) long."""
        self.layout = layout(state_dict)
        self.device = cuda_device(state_dict)  # for the writer threads
        self.state_dict = _cpu_structure(state_dict)
        leaves = _leaves(self.state_dict)
        offsets, total = [], 0
        for t in leaves:
            offsets.append(total)
            total += _aligned(t.untyped_storage().nbytes())
        if slab is not None and slab.numel() < total:
            raise ValueError(f"the reserved slab holds {slab.numel():,} bytes; this state needs {total:,}")
        self.slab = slab if slab is not None else make_slab(max(total, 1), pin)
        self.pinned = pin
        storage = self.slab.untyped_storage()
        for t, at in zip(leaves, offsets):
            n = t.untyped_storage().nbytes()
            # A storage of exactly the tensor's bytes (a slice shares the slab's memory): DCP writes a tensor's
            # whole storage, or clones it first when the storage is larger.
            t.set_(storage[at:at + n], t.storage_offset(), t.shape, t.stride())

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's data, each a view of the slab."""
        return _leaves(self.state_dict)

    def fits(self, state_dict: dict) -> bool:
        return layout(state_dict) == self.layout

    def copy_from(self, state_dict: dict) -> dict:
        with torch.no_grad():
            for src, dst in zip(_leaves(state_dict), self.tensors(), strict=True):
                dst.copy_(src, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()
        return self.state_dict


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def local_bytes(t: torch.Tensor) -> int:
    """What a tensor's data on this rank takes in a slab (its storage's bytes: an unevenly sharded parameter's
    local tensor is a view of a padded one)."""
    return sum(_aligned(x.untyped_storage().nbytes()) for x in _locals(t))


def copy_bytes(state_dict: dict) -> int:
    """The slab a CpuCopy of `state_dict` takes."""
    return sum(_aligned(t.untyped_storage().nbytes()) for t in _leaves(state_dict))


def make_slab(nbytes: int, pin: bool, *, touch: bool = True) -> torch.Tensor:
    """Pinned by registering pageable memory: torch's pinned allocator would round 19 GB up to 32 GB. `touch`:
    fault the pages in first, on every core (a fill is parallel); cudaHostRegister would fault them one by one."""
    slab = torch.empty(nbytes, dtype=torch.uint8)
    if pin and touch:
        slab.zero_()
    if pin:
        cudart = torch.cuda.cudart()
        ptr = slab.data_ptr()
        err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
        if err != 0:
            raise RuntimeError(f"pinning {nbytes / 1e9:.1f} GB of CPU memory for the background save failed "
                               f"(cudaError {err}); turn resources.async_checkpoint off or free host memory")
        # The slices share the slab's memory: it is freed after the last of them, so after this unregistering.
        weakref.finalize(slab, cudart.cudaHostUnregister, ptr)
    return slab
