"""build: HF folder -> FSDP policy (+ critic for gae) -> initial DCP checkpoint and frozen reference policy.

Outputs: `hf_meta/` (config + tokenizer, what later stages build the model from), `policy/` (model + optimizer
+ state.json; with model.lora the adapters + their optimizer), `ref/` (model only; with model.lora the base every
later LoRA load starts from), `critic/` for PPO.

state.json says where the policy starts in the prompts (`data_cursor`, in the order of `data_seed`): a run of a
recurring chain (schedule.init_from: previous) where the chain left off (verlflow.core.store.chain), any other
warm start where its policy left off, else at the first prompt. The manifest's metrics record that, the seed, and
which policy the build starts from and why (`start`).
"""

import json
import logging
import shutil
from pathlib import Path

import torch.distributed as dist

from verlflow.core.errors import InputError
from verlflow.core.ml import checkpoint, model as M
from verlflow.core.ml.modeldir import model_dir_problems
from verlflow.core.ml.optim import make_optimizer
from verlflow.core.stages.common import StageContext, stage_main
from verlflow.core.store import chain

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
    warm = ctx.job.inputs.get("warm_start")
    src = Path(bp.model.path)
    problems = model_dir_problems(src)
    if problems:
        raise InputError(" ".join(problems))
    if ctx.is_main():
        copy_meta(src, ctx.out / "hf_meta")
    M.load_tokenizer(src)  # fails early on a tokenizer without chat template

    warm_policy = ctx.input("warm_start") / "policy" if warm else None
    start = {"start": _start_reason(ctx, warm), **_data_start(ctx, warm_policy), "seed": bp.seed}
    if ctx.is_main():
        own = " (the run's own: schedule.init_from previous derives it from the blueprint's seed and the run id)"
        log.info("build: starts from %s; prompts from position %s (order seed %s)%s; seed %s%s", start["start"],
                 start["data_cursor"], start["data_seed"],
                 f", run {start['chain_position'] + 1} of the chain" if "chain_position" in start else "", bp.seed,
                 own if bp.schedule.init_from == "previous" else "")
    metrics: dict = dict(start)
    roles = [("policy", False), ("ref", False)] + ([("critic", True)] if bp.algorithm.adv_estimator == "gae" else [])
    for role, critic in roles:
        with ctx.timed(f"{role}_load_s"):
            # FSDP2: ranks > 0 start from meta and receive rank 0's weights through the load below.
            meta = bp.fsdp.version == 2 and ctx.rank > 0
            # packed as the update builds its modules: in a warm pool this very module is the first update's
            module = M.build_module(src, bp.model, critic=critic, meta=meta, adapters=role == "policy",
                                    packed=bp.algorithm.use_remove_padding)
            full = None if meta else module.state_dict()
            trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)  # model.lora: the adapters
        with ctx.timed(f"{role}_wrap_s"):
            model, rep = M.wrap_fsdp(module, bp.fsdp, ctx.device, bp.algorithm.fused_head)
            if bp.fsdp.version == 2:
                _broadcast_weights(model, full)
        problems = M.check_shards(rep, bp.fsdp)
        if problems:
            raise RuntimeError(f"{role}: " + "; ".join(problems))
        if role != "ref":
            metrics[f"{role}_trainable_params"] = trainable
        balances = [None] * ctx.world
        dist.all_gather_object(balances, round(rep.balance, 4))
        metrics.update({f"{role}_fsdp_units": rep.units, f"{role}_params": rep.total_numel,
                        f"{role}_shard_balance": balances})
        state = {"step": 0, "data_cursor": start["data_cursor"], "data_seed": start["data_seed"], "role": role,
                 "warm_start": warm}
        # Warm start: the previous policy is both the new policy and ref; with LoRA the previous adapters are the
        # new policy's (on the model folder's weights) and the reference stays the base model.
        if warm_policy and (role == "policy" or role == "ref" and bp.model.lora is None):
            checkpoint.load(warm_policy, model)
        opt = (make_optimizer(model, bp.algorithm.critic_optim if critic else bp.algorithm.optim)
               if role != "ref" else None)
        with ctx.timed(f"{role}_save_s"):
            checkpoint.save(ctx.out / role, model, opt, state)
        if opt is not None:
            # A warm pool keeps the policy (and critic) for the first rollout and update, which would read these
            # files back, and starts making the CPU copy of the first update's background save (its page-locking
            # runs beside the first rollout); the reference is the policy's weights until an update trains it.
            ctx.models.keep(role, model, opt, state)
        del model, opt
    log.info("build: %s", json.dumps(metrics))
    return metrics


def _in_chain(ctx: StageContext) -> bool:
    """A recurring run's own build (not an rl phase's): its prompts continue its blueprint's chain. Phases keep
    their own data cursors."""
    return ctx.bp.schedule.init_from == "previous" and not ctx.bp.phases and ctx.job.iteration == "init"


def _data_start(ctx: StageContext, warm_policy: Path | None) -> dict:
    """{data_cursor, data_seed[, chain_position]}: where the policy starts in the prompts, in whose order."""
    warm = checkpoint.read_state(warm_policy) if warm_policy else {}
    own = {"data_cursor": warm.get("data_cursor", 0), "data_seed": warm.get("data_seed", ctx.bp.seed)}
    if not _in_chain(ctx):
        return own
    place = [None]
    if ctx.is_main():  # one conditional write; a rerun gets the place it recorded
        joined = chain.join(ctx.store, ctx.bp.name, ctx.job.run_id, cursor=own["data_cursor"],
                            data_seed=own["data_seed"])
        place[0] = {"data_cursor": joined["data_cursor"], "data_seed": joined["data_seed"],
                    "chain_position": joined["position"]}
    if ctx.world > 1:
        dist.broadcast_object_list(place, src=0)
    return place[0]


def _start_reason(ctx: StageContext, warm: str | None) -> str:
    """Which policy the build starts from, and why, in words."""
    bp, latest = ctx.bp, f"pointers/blueprints/{ctx.bp.name}/latest.json"
    if warm and ctx.job.iteration != "init":
        return f"the policy of {warm}: this rl phase starts from it (phases)"
    if warm:
        _, run_id, iteration, _ = warm.split("/")
        return (f"the policy of run {run_id} iteration {iteration} ({warm}): schedule.init_from is previous and "
                f"{latest} named it when this run's build first ran (a rerun keeps its start)")
    if bp.schedule.init_from == "previous":
        return (f"the base model {bp.model.path}: schedule.init_from is previous, but {latest} named no policy of "
                "another run when this run's build first ran")
    return f"the base model {bp.model.path}: schedule.init_from is base"


def _broadcast_weights(model, full: dict | None) -> None:
    """Rank 0's real weights into every rank's shards (the others were meta-initialised)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))


main = stage_main(run)

if __name__ == "__main__":
    main()
