"""Test worker: one update of a committed rollout batch per (estimator, loss) pair, through the update's own code.

Job file: {"blueprint", "meta" (build/hf_meta), "ckpt" (a policy checkpoint), "batch" (a rollout folder), "combos":
[{algorithm overrides}], "out"}. Every pair starts from the same weights (the checkpoint, reloaded) and runs the
update's steps: old log-probs, advantages by verl's estimator, ppo.train with verl's policy loss on FSDP2. Rank 0
writes, per pair, the metrics of its last mini-batch or the error it raised.
"""

import json
import math
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from verlflow.core.blueprint import Blueprint
from verlflow.core.ml import checkpoint, model as M, ppo
from verlflow.core.ml.optim import make_optimizer
from verlflow.core.ml.placement import Placement
from verlflow.core.ml.rollout import load_batch
from verlflow.core.stages.runtime.entry import worker_guard
from verlflow.core.stages.update import ppo_spec


def one(base: Blueprint, overrides: dict, job: dict, model, at: Placement) -> dict:
    algo = base.algorithm.model_validate({**base.algorithm.model_dump(), **overrides})
    bp = base.model_copy(update={"algorithm": algo})
    opt = make_optimizer(model, algo.optim)
    checkpoint.load(Path(job["ckpt"]), model, opt)
    batch = load_batch(Path(job["batch"]))
    spec = ppo_spec(bp)
    old = ppo.old_logprobs(model, batch, spec, at)
    data, _ = ppo.prepare(algo, batch, old, old.clone(), iteration=1)
    rows = ppo.train(spec, ppo.Models(ppo.Trainee(model, opt)), data, at)
    last = rows[-1]
    finite = all(math.isfinite(v) for v in last.values() if isinstance(v, float))
    return {"ok": finite, "pg_loss": last["pg_loss"], "grad_norm": last["grad_norm"],
            "adv_abs_mean": round(float(data.adv.abs().mean()), 6), "steps": len(rows)}


@record
def main() -> None:
    worker_guard()
    job = json.loads(Path(sys.argv[1]).read_text())
    base = Blueprint.model_validate(job["blueprint"])
    dist.init_process_group("gloo")
    at = Placement(dist.get_rank(), dist.get_world_size(), M.torch.device("cpu"))
    model, _ = M.wrap_fsdp(M.build_module(job["meta"], base.model, meta=True), base.fsdp, at.device,
                           base.algorithm.fused_head)
    results = []
    for overrides in job["combos"]:
        try:
            results.append({**overrides, **one(base, overrides, job, model, at)})
        except Exception as e:  # noqa: BLE001 - the test reports every pair that fails, not the first
            results.append({**overrides, "ok": False, "error": f"{type(e).__name__}: {e}"})
    if at.rank == 0:
        Path(job["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
