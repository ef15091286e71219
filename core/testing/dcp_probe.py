"""Test worker (torchrun, gloo): an FSDP2 model with AdamW state saved and loaded by verlflow.core.ml.dcpio.

The job file's `op`:
  save   train `steps` steps, save with `threads` writer threads per rank to `ckpt`; write the full state to `out`
  load   load `ckpt` (checkpoint.load, or dcpio.load with `threads`) into a fresh model; write its full state; with
         `save_to`, save it there with `save_threads`
  stage  the background path: today's per-tensor staging (torch's _create_cpu_state_dict) saved to `ckpt`/old, the
         committer's slab copy saved to `ckpt`/one/policy and, after another step, to `ckpt`/two/policy (the same
         slab, refilled); a role's first save into a slab reserved before the optimizer stepped to `ckpt`/three;
         each loaded back; full states to `out`; the slab's layout to `out`.json
  fail   save into `ckpt` (a filesystem too small for it) inline and through the committer; what each raised to `out`
The model's sizes shard unevenly over 2 ranks; its state is the same at any world size (identical batches).
"""

import json
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from verlflow.core.errors import is_no_space
from verlflow.core.ml import checkpoint, dcpio
from verlflow.core.stages.runtime.entry import worker_guard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)


def build(steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(101, 480), nn.Linear(480, 333), nn.GELU(), nn.Linear(333, 47), nn.Linear(47, 5))
    for layer in (model[1], model[3], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        train(model, opt)
    return model, opt


class Tied(nn.Module):
    """A head tied to the embedding (as Qwen2.5-1.5B's): one parameter, two state-dict entries."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(101, 480)
        self.body = nn.Sequential(nn.Linear(480, 333), nn.GELU(), nn.Linear(333, 480))
        self.head = nn.Linear(480, 101, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def build_tied():
    torch.manual_seed(0)
    model = Tied()
    for layer in (model.body[0], model.body[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt) -> None:
    ids = torch.arange(24).reshape(3, 8) % 101
    model(ids).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_dict(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=checkpoint.FLAT)
    return {"model": msd, "optim": osd}


def write_full(model, opt, out: str) -> None:
    msd, osd = get_state_dict(model, opt, options=FULL)
    if dist.get_rank() == 0:
        tensors = {f"model.{k}": v for k, v in msd.items()}
        tensors |= {f"optim.{k}": v for k, v in osd.items() if isinstance(v, torch.Tensor)}
        torch.save(tensors, out)
    dist.barrier()


def load_into_fresh(folder: Path, threads: int | None, tied: bool = False):
    model, opt = build_tied() if tied else build(0)
    train(model, opt)  # the optimizer's state exists, with other values than the checkpoint's
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    if threads is None:
        checkpoint.load(folder, model, opt)
    else:
        sd = state_dict(model, opt)
        dcpio.load(sd, str(folder / "dcp"), threads=threads)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=checkpoint.FLAT)
    return model, opt


def save(folder: Path, model, opt, threads: int) -> None:
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state.json").write_text("{}")
    dcpio.save(state_dict(model, opt), str(folder / "dcp"), threads=threads)


def background(committer, folder: Path, model, opt) -> str:
    how = checkpoint.save(folder, model, opt, {}, write=committer)
    committer.submit(str(folder), "probe", lambda: None, str(folder))
    committer.wait(str(folder))
    return how


def stage(job: dict) -> None:
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    import torch.distributed.checkpoint as dcp

    root, out = Path(job["ckpt"]), job["out"]
    model, opt = build(1)
    write_full(model, opt, f"{out}.live1")
    sd = state_dict(model, opt)  # today's staging: a CPU tensor per entry
    old = _copy_state_dict(sd, _create_cpu_state_dict(sd), non_blocking=False)
    if dist.get_rank() == 0:
        (root / "old").mkdir(parents=True, exist_ok=True)  # another rank's dcp.save may have made it
        (root / "old/state.json").write_text("{}")
    dcp.save(old, checkpoint_id=str(root / "old/dcp"))
    committer = new_committer()
    how = [background(committer, root / "one/policy", model, opt)]  # 1 role: the 2nd save refills the 1st's copy
    first = committer.cpu_copy("policy")
    train(model, opt)
    write_full(model, opt, f"{out}.live2")
    how.append(background(committer, root / "two/policy", model, opt))
    copy = committer.cpu_copy("policy")
    # A build's reservation: sized from a model (with a tied head) whose AdamW has not stepped yet; the role's first
    # save (after a step, as the first update's) goes to the background into that slab.
    fresh, fresh_opt = build_tied()
    reserving = new_committer()
    reserving.reserve("policy", checkpoint.trained_state_bytes(fresh))
    train(fresh, fresh_opt)
    write_full(fresh, fresh_opt, f"{out}.live3")
    how.append(background(reserving, root / "three/policy", fresh, fresh_opt))
    for name in ("old", "one/policy", "two/policy", "three/policy"):
        write_full(*load_into_fresh(root / name, None, tied=name == "three/policy"), f"{out}.{name.split('/')[0]}")
    leaves = copy.tensors()
    lo, hi = copy.slab.data_ptr(), copy.slab.data_ptr() + copy.slab.numel()
    reserved = reserving.cpu_copy("policy")
    report = {"leaves": len(leaves), "reused": copy is first,
              "in_slab": all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for t in leaves),
              "exact_storages": all(t.untyped_storage().nbytes() == t.nbytes for t in leaves),
              "how": how, "reserved_fits": dcpio.copy_bytes(state_dict(fresh, fresh_opt)) <= reserved.slab.numel()}
    if dist.get_rank() == 0:
        Path(f"{out}.json").write_text(json.dumps(report))
    dist.barrier()


def new_committer():
    from verlflow.core.stages.runtime.committer import Committer

    return Committer(timedelta(seconds=60))


def fail(job: dict) -> None:
    root, report = Path(job["ckpt"]), {}
    model, opt = build(1)
    try:
        save(root / "inline", model, opt, job["threads"])
        report["inline"] = None
    except BaseException as e:  # noqa: BLE001 - reported to the test (DCP's CheckpointException is no Exception)
        report["inline"] = {"type": type(e).__name__, "no_space": is_no_space(e)}
    report["inline_metadata"] = (root / "inline/dcp/.metadata").exists()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root / "inline", ignore_errors=True)
    dist.barrier()
    committer = new_committer()
    background(committer, Path(job["roomy"]) / "background", model, opt)  # the role's first save: its copy made
    try:
        background(committer, root / "background", model, opt)  # the second through the committer's CPU copy
        report["background"] = None
    except BaseException as e:  # noqa: BLE001
        report["background"] = {"type": type(e).__name__, "message": str(e)[:300]}
    if dist.get_rank() == 0:
        Path(job["out"]).write_text(json.dumps(report))
    dist.barrier()


@record
def main() -> None:
    worker_guard()
    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    if job["op"] == "save":
        model, opt = build(job["steps"])
        save(Path(job["ckpt"]), model, opt, job["threads"])
        write_full(model, opt, job["out"])
    elif job["op"] == "load":
        model, opt = load_into_fresh(Path(job["ckpt"]), job.get("threads"))
        write_full(model, opt, job["out"])
        if job.get("save_to"):
            save(Path(job["save_to"]), model, opt, job["save_threads"])
    elif job["op"] == "stage":
        stage(job)
    else:
        fail(job)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
