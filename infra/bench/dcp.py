"""DCP checkpoint benchmark: save and load GB/s of the policy + AdamW state, today's path against ours, inline and in
the background (a warm pool's commit), to each folder of --dirs, in one run.

    python infra/bench/dcp.py --dirs /dev/shm,/tmp --threads 8,16 --json dcp.json  # H200, 1.5B: RAM disk and disk
    torchrun --nproc_per_node 2 infra/bench/dcp.py --dirs ...                       # 2 ranks
    python infra/bench/dcp.py --smoke                                               # CPU (the test suite runs it)

The state is the update stage's: verlflow.core.ml.model's FSDP2 module of --shape (random weights, fp32 as the GPU
blueprint trains) with verlflow.core.ml.optim's AdamW after one step, so every parameter has exp_avg and exp_avg_sq.
Per folder, measured in turn (each checkpoint deleted once timed, so one fits at a time):
  old  save inline      dcp.save with torch's FileSystemWriter (1 thread: today's verlflow.core.ml.checkpoint.save)
  old  load             dcp.load with torch's FileSystemReader (today's checkpoint.load)
  new  load (old ckpt)  ours on that one-file-per-rank checkpoint (the checkpoints already in stores)
  old  save background  today's Committer.save (_create_cpu_state_dict(pin_memory=True) + _copy_state_dict) + write:
                        the first save, which allocates the CPU copy (a second writes as "save inline" does)
  new  save inline      checkpoint.save's inline path: verlflow.core.ml.dcpio.save (ParallelWriter), per --threads
  new  load             checkpoint.load's: dcpio.load (ParallelReader)
  new  save inline, no fsync  the same with sync_files off: what fsync costs (the stages keep it)
  new  save inline, staged  the alternative: the whole state copied into a fresh CpuCopy slab, then written
  new  save background  checkpoint.save(write=Committer): the 1st written inline while a thread makes the
                        one-slab CPU copy; the 2nd copied into it, then written by the committer
wait_s is the time the stage waits (all of an inline save or a load; a background save's copy to CPU), behind_s
the background write after it; GB/s = bytes / (wait + behind).
Before each load the files are dropped from the page cache (posix_fadvise; a no-op on tmpfs) and the model and
optimizer zeroed; `ok` says the loaded state's digest equals the saved one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from update import BASE, init_dist, model_dir  # noqa: E402  (the update benchmark's shapes and process group)

from verlflow.core.blueprint import load_blueprint  # noqa: E402
from verlflow.core.ml import checkpoint, dcpio, model as M  # noqa: E402
from verlflow.core.ml.optim import make_optimizer  # noqa: E402
from verlflow.core.stages.runtime.committer import Committer  # noqa: E402

T0 = time.perf_counter()


def say(*a):
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def build(mdir: Path, dev: torch.device, world: int, smoke: bool):
    over = {**BASE, "model.path": str(mdir), "data.train_files": [str(mdir / "none.parquet")],
            "storage.uri": str(mdir / "store"), "resources.nproc_per_node": world,
            "resources.device": dev.type, "algorithm.ppo_mini_batch_size": world, "data.batch_size": world}
    if smoke:
        over.update({"fsdp.mixed_precision": "fp32", "fsdp.activation_checkpointing": False})
    bp = load_blueprint(None, [f"{k}={json.dumps(v) if isinstance(v, (list, bool)) else v}" for k, v in over.items()])
    torch.manual_seed(0)
    with torch.device(dev):
        module = M.build_module(mdir, bp.model)
    model, _ = M.wrap_fsdp(module, bp.fsdp, dev, bp.algorithm.fused_head)
    opt = make_optimizer(model, bp.algorithm.optim)
    for p in model.parameters():  # one step, so the optimizer's state is all there
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def tensors(model, opt) -> list[torch.Tensor]:
    local = [getattr(t, "to_local", lambda t=t: t)() for t in model.parameters()]
    for state in opt.state.values():
        local += [getattr(v, "to_local", lambda v=v: v)() for v in state.values() if isinstance(v, torch.Tensor)]
    return local


@torch.no_grad()
def digest(model, opt) -> torch.Tensor:
    vals = torch.stack([torch.stack([t.double().sum(), t.double().abs().sum()]) for t in tensors(model, opt)])
    return (vals * torch.arange(1, len(vals) + 1, dtype=torch.float64, device=vals.device)[:, None]).sum().cpu()


@torch.no_grad()
def zero(model, opt) -> None:
    for t in tensors(model, opt):
        t.zero_()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def folder_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def drop_cache(folder: Path) -> None:
    if dist.get_rank() == 0:
        for p in folder.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()


# --- today's code, verbatim in effect (verlflow.core.ml.checkpoint.save/load, Committer.save before issue 15) ---

def old_state_dict(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt, options=checkpoint.FLAT)
    return {"model": msd, "optim": osd}


def old_save_inline(folder: Path, model, opt) -> None:
    dcp.save(old_state_dict(model, opt), checkpoint_id=str(folder / "dcp"))


def old_stage(model, opt, cache: dict) -> dict:
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    sd, cuda = old_state_dict(model, opt), torch.cuda.is_available()
    if "cpu" not in cache:
        cache["cpu"] = _create_cpu_state_dict(sd, pin_memory=cuda)
    staged = _copy_state_dict(sd, cache["cpu"], non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return staged


def old_load(folder: Path, model, opt) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = old_state_dict(model, opt)
    dcp.load(sd, checkpoint_id=str(folder / "dcp"))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=checkpoint.FLAT)


# --- ours with a given thread count (what checkpoint.save/load do inline, with dcpio.io_threads()) ---------------

def new_save_inline(threads: int):
    return lambda folder, model, opt: dcpio.save(old_state_dict(model, opt), str(folder / "dcp"), threads=threads)


def unsynced_save_inline(threads: int):
    """What fsync costs: the same save with sync_files off (the stages keep it on: a manifest must not outlive a
    crash that loses the files' pages)."""
    def run(folder: Path, model, opt) -> None:
        sd = old_state_dict(model, opt)
        writer = dcpio.ParallelWriter(str(folder / "dcp"), threads, dcpio.cuda_device(sd))
        writer.sync_files = False
        dcp.save(sd, storage_writer=writer)
    return run


def staged_save_inline(threads: int):
    def run(folder: Path, model, opt) -> None:
        sd = old_state_dict(model, opt)
        cpu = dcpio.CpuCopy(sd, pin=torch.cuda.is_available())
        dcpio.save(cpu.copy_from(sd), str(folder / "dcp"), threads=threads, device=cpu.device)
    return run


def new_load(threads: int):
    def run(folder: Path, model, opt) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = old_state_dict(model, opt)
        dcpio.load(sd, str(folder / "dcp"), threads=threads)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=checkpoint.FLAT)
    return run


# --- measuring ---------------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, model, opt, dev):
        self.args, self.model, self.opt, self.dev = args, model, opt, dev
        self.rows: list[dict] = []
        self.want = digest(model, opt)
        self.gloo = dist.new_group(backend="gloo")  # the ok flag is a CPU tensor

    def record(self, row: dict, folder: Path) -> dict:
        size, files = folder_bytes(folder / "dcp") if dist.get_rank() == 0 else (0, 0)
        total = row["wait_s"] + row["behind_s"]
        row.update(bytes=size, files=files, total_s=round(total, 2), gb_per_s=round(size / total / 1e9, 3),
                   wait_s=round(row["wait_s"], 2), behind_s=round(row["behind_s"], 2))
        self.rows.append(row)
        say(json.dumps(row))
        if self.args.json and dist.get_rank() == 0:
            self.args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(self.args).items()},
                                                  "rows": self.rows}, indent=1))
        return row

    def save(self, base: dict, folder: Path, stage, write=lambda: None) -> None:
        sync(self.dev)
        t = time.perf_counter()
        stage()
        sync(self.dev)
        t1 = time.perf_counter()
        write()
        sync(self.dev)
        self.record({**base, "wait_s": t1 - t, "behind_s": time.perf_counter() - t1}, folder)

    def load(self, base: dict, folder: Path, fn) -> None:
        drop_cache(folder)
        zero(self.model, self.opt)
        sync(self.dev)
        t = time.perf_counter()
        fn(folder, self.model, self.opt)
        sync(self.dev)
        took = time.perf_counter() - t
        ok = torch.equal(digest(self.model, self.opt), self.want)
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.gloo)
        self.record({**base, "wait_s": took, "behind_s": 0.0, "ok": bool(flag.item())}, folder)


def fresh(folder: Path) -> Path:
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    dist.barrier()
    return folder


def remove(folder: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()


def free_cpu_copies() -> None:
    gc.collect()
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the old path's pinned tensors, cached by torch's host allocator


def run_dir(b: Bench, where: str, threads: list[int]) -> None:
    model, opt, state = b.model, b.opt, {"step": 1}
    root = where
    ck = Path(where) / "verlflow-dcp-bench" / "ckpt"
    if "old" in b.args.paths:
        at = {"dir": root, "path": "old", "threads": 1}
        b.save({**at, "op": "save inline"}, fresh(ck), lambda: old_save_inline(ck, model, opt))
        b.load({**at, "op": "load"}, ck, old_load)
        b.load({**at, "path": "new", "threads": threads[0], "op": "load (old ckpt)"}, ck, new_load(threads[0]))
        remove(ck)
        cache, staged = {}, {}  # the first save only: a second writes as "save inline" does, after a fast copy
        b.save({**at, "op": "save background 1st"}, fresh(ck),
               lambda: staged.update(sd=old_stage(model, opt, cache)),
               lambda: dcp.save(staged["sd"], checkpoint_id=str(ck / "dcp")))
        remove(ck)
        del cache, staged
        free_cpu_copies()
    if "new" in b.args.paths:
        for n in threads:
            at = {"dir": root, "path": "new", "threads": n}
            b.save({**at, "op": "save inline"}, fresh(ck), lambda: new_save_inline(n)(ck, model, opt))
            b.load({**at, "op": "load"}, ck, new_load(n))
            remove(ck)
        n = threads[0]
        at = {"dir": root, "path": "new", "threads": n}
        b.save({**at, "op": "save inline, no fsync"}, fresh(ck), lambda: unsynced_save_inline(n)(ck, model, opt))
        remove(ck)
        # Inline the other way round: the whole state copied to a fresh slab first, then written from CPU.
        b.save({**at, "op": "save inline, staged"}, fresh(ck), lambda: staged_save_inline(n)(ck, model, opt))
        remove(ck)
        free_cpu_copies()
        at = {"dir": root, "path": "new", "threads": dcpio.io_threads()}
        committer = Committer(timedelta(minutes=30))
        for i, nth in enumerate(("1st", "2nd")):
            out = f"{ck}#{i}"
            b.save({**at, "op": f"save background {nth}"}, fresh(ck),
                   lambda: checkpoint.save(ck, model, opt, state, write=committer),
                   lambda: (committer.submit(out, "bench", lambda: None, str(ck)), committer.wait(out)))
            if nth == "1st":  # written inline; the CPU copy for later saves is made meanwhile, which a pipeline
                t = time.perf_counter()  # hides behind the export, the next rollout and the next update's training
                committer.cpu_copy(ck.name)
                say(f"CPU copy for the later background saves ready {time.perf_counter() - t:.1f} s after the "
                    "1st save returned")
            if nth == "2nd":  # what the pinned slab's asynchronous copies wrote is the state
                b.load({**at, "op": "load (background ckpt)"}, ck, new_load(at["threads"]))
            remove(ck)
        committer._staged.clear()  # its slab, before the next folder's first save (its thread keeps it alive)
        free_cpu_copies()


def table(rows: list[dict]) -> str:
    head = "| folder | path | operation | threads | stage waits s | behind s | total s | GB | GB/s | files | ok |"
    lines = [head, "| " + " | ".join(["---"] * 11) + " |"]
    for r in rows:
        lines.append(f"| {r['dir']} | {r['path']} | {r['op']} | {r['threads']} | {r['wait_s']:.2f} | "
                     f"{r['behind_s']:.2f} | {r['total_s']:.2f} | {r['bytes'] / 1e9:.2f} | {r['gb_per_s']:.2f} | "
                     f"{r['files']} | {r.get('ok', '-')} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per folder, today's figure against ours (the first --threads value)."""
    def pick(d, path, op, key):
        r = next((r for r in rows if r["dir"] == d and r["path"] == path and r["op"] == op), None)
        return f"{r[key]:.2f}" if r else "-"

    lines = ["| folder | measure | old | new |", "| --- | --- | --- | --- |"]
    for d in dict.fromkeys(r["dir"] for r in rows):
        for label, op, key in (("save inline GB/s", "save inline", "gb_per_s"), ("load GB/s", "load", "gb_per_s"),
                               ("background save, 1st: stage waits s", "save background 1st", "wait_s"),
                               ("background save, 2nd: stage waits s", "save background 2nd", "wait_s"),
                               ("background save, 2nd: GB/s", "save background 2nd", "gb_per_s")):
            lines.append(f"| {d} | {label} | {pick(d, 'old', op, key)} | {pick(d, 'new', op, key)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", help="an infra/bench/rollout.py SHAPES entry")
    ap.add_argument("--dirs", help="comma-separated folders to write the checkpoints in (a subfolder each)")
    ap.add_argument("--threads", default="", help="comma-separated writer/reader threads per rank for the new "
                                                  "inline path (default: dcpio.io_threads())")
    ap.add_argument("--paths", default="old,new", help="today's path (old), ours (new) or both")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, two folders under a temporary one")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape = "tiny"
    at = init_dist("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    scratch = [tempfile.mkdtemp(prefix="verlflow-dcp-bench-") if at.rank == 0 else None]
    dist.broadcast_object_list(scratch)
    scratch = Path(scratch[0])
    if args.smoke and not args.dirs:
        args.dirs = f"{scratch}/a,{scratch}/b"
    if not args.dirs:
        ap.error("--dirs: the folders to measure (e.g. a local disk's and /dev/shm's)")
    if at.rank == 0:
        model_dir(args.shape, scratch)
    dist.barrier()
    threads = [int(t) for t in args.threads.split(",") if t] or [dcpio.io_threads()]
    say(f"shape {args.shape}, world {at.world}, device {at.device}, threads {threads}, torch {torch.__version__}")
    model, opt = build(scratch / args.shape, at.device, at.world, args.smoke)
    b = Bench(args, model, opt, at.device)
    need = sum(t.numel() * t.element_size() for t in tensors(model, opt)) * at.world
    say(f"built: {need / 1e9:.2f} GB of state")
    try:
        for d in args.dirs.split(","):
            Path(d).mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(d).free
            if free < need * 1.05 + 2**28:
                say(f"SKIPPED {d}: {free / 1e9:.1f} GB free, a checkpoint needs {need / 1e9:.1f} GB")
                continue
            run_dir(b, d, threads)
    finally:
        for d in args.dirs.split(","):
            remove(Path(d) / "verlflow-dcp-bench")
        if at.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if at.rank == 0:
        print(table(b.rows) + "\n\n" + summary(b.rows), flush=True)
    bad = [r for r in b.rows if r.get("ok") is False]
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
