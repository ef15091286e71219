"""Test worker: load a DCP policy checkpoint into FSDP at this job's world size, write the full weights."""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.elastic.multiprocessing.errors import record

from verlflow.core.blueprint import Blueprint
from verlflow.core.ml import checkpoint, model as M
from verlflow.core.stages.runtime.entry import worker_guard


@record
def main() -> None:
    worker_guard()
    job = json.loads(Path(sys.argv[1]).read_text())
    bp = Blueprint.model_validate(job["blueprint"])
    dist.init_process_group("gloo")
    model, _ = M.wrap_fsdp(M.build_module(job["meta"], bp.model, meta=bp.fsdp.version == 2), bp.fsdp,
                           M.torch.device("cpu"), bp.algorithm.fused_head)
    checkpoint.load(Path(job["ckpt"]), model)
    full = checkpoint.full_state_dict(model)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, job["out"])
    dist.barrier()  # no rank tears gloo down while another still uses it (seen once: SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
