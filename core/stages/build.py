"""build: HF folder -> FSDP policy (+ critic for gae) -> initial DCP checkpoint and frozen reference policy.

Outputs: `hf_meta/` (config + tokenizer, what later stages build the model from), `policy/` (model + optimizer
+ state.json), `ref/` (model only), `critic/` for PPO.
"""

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from core import checkpoint, model as M
from core.errors import InputError
from core.optim import make_optimizer
from core.stages.common import StageContext, stage_main

log = logging.getLogger("verlflow.build")

META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def copy_meta(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in META_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def run(ctx: StageContext) -> dict:
    bp = ctx.bp
    warm = ctx.job["inputs"].get("warm_start")
    src = Path(bp.model.path)
    problems = M.check_model_dir(src)
    if problems:
        raise InputError(" ".join(problems))
    if ctx.is_main():
        copy_meta(src, ctx.out / "hf_meta")
    M.load_tokenizer(src)  # fails early on a tokenizer without chat template

    metrics: dict = {}
    roles = [("policy", False), ("ref", False)] + ([("critic", True)] if bp.algorithm.adv_estimator == "gae" else [])
    for role, critic in roles:
        with ctx.timed(f"{role}_load_s"):
            # FSDP2: ranks > 0 start from meta and receive rank 0's weights through the load below.
            meta = bp.fsdp.version == 2 and ctx.rank > 0
            module = M.build_module(src, bp, critic=critic, meta=meta)
            full = None if meta else module.state_dict()
        with ctx.timed(f"{role}_wrap_s"):
            model, rep = M.wrap_fsdp(module, bp, ctx.device)
            if bp.fsdp.version == 2:
                _broadcast_weights(model, full)
        problems = M.check_shards(rep, bp)
        if problems:
            raise RuntimeError(f"{role}: " + "; ".join(problems))
        metrics[f"{role}_fsdp_units"] = rep.units
        metrics[f"{role}_params"] = rep.total_numel
        metrics[f"{role}_shard_balance_rank{ctx.rank}"] = round(rep.balance, 4)
        if role == "policy" and warm:
            checkpoint.load(ctx.input("warm_start") / "policy", model)
        if role == "ref" and warm:
            checkpoint.load(ctx.input("warm_start") / "policy", model)
        opt = make_optimizer(model, bp, critic=critic) if role != "ref" else None
        state = {"step": 0, "data_cursor": 0, "role": role, "warm_start": warm,
                 "lineage": ctx.input_manifest("warm_start").get("lineage", []) if warm else []}
        if warm and role == "policy":
            prev = checkpoint.read_state(ctx.input("warm_start") / "policy")
            state["data_cursor"] = prev.get("data_cursor", 0)
        with ctx.timed(f"{role}_save_s"):
            checkpoint.save(ctx.out / role, model, opt, state)
        del model, opt
    balances = [torch.tensor(metrics[f"policy_shard_balance_rank{ctx.rank}"])]
    if ctx.world > 1:
        gathered = [torch.zeros(()) for _ in range(ctx.world)]
        dist.all_gather(gathered, balances[0])
        balances = gathered
    metrics["policy_shard_balance"] = [round(float(b), 4) for b in balances]
    log.info("build: %s", json.dumps(metrics))
    return metrics


def _broadcast_weights(model, full: dict | None) -> None:
    """Rank 0's real weights into every rank's shards (the others were meta-initialised)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))


main = stage_main(run)

if __name__ == "__main__":
    main()
