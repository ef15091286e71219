"""validate: everything the run needs, checked at the blueprint's world size, every problem reported at once.

Output: report.json / report.md. Any fatal problem fails the stage (nothing committed) with the full list. The
input checks are core/checks/preflight.py's (the CLI runs its cheap ones before this stage; a flow run starts here).
"""

import json
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist
from packaging.version import Version

from verlflow.core.errors import InputError
from verlflow.core.ml import model as M
from verlflow.core.ml.modeldir import model_dir_problems
from verlflow.core.stages.common import StageContext, stage_main

log = logging.getLogger("verlflow.validate")

MINIMUMS = {"torch": ("2.6", None), "transformers": ("5.5.3", "5.11"), "verl": ("0.9.1", "0.10")}


class Report:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, check: str, ok: bool, detail: str, fatal: bool = True):
        self.rows.append({"check": check, "ok": bool(ok), "detail": detail, "fatal": fatal and not ok})

    def guard(self, check: str, fn):
        """Run one check (its value, or None); an exception is a failed check, not a crashed stage."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every problem is reported, not just the first
            self.add(check, False, f"{type(e).__name__}: {e}")


def check_versions(r: Report):
    r.add("python", sys.version_info >= (3, 10), f"{sys.version.split()[0]} (need >= 3.10)")
    for pkg, (lo, hi) in MINIMUMS.items():
        try:
            v = version(pkg)
        except PackageNotFoundError:
            r.add(pkg, False, f"{pkg} is not installed; pip install 'verlflow' brings it")
            continue
        base = Version(Version(v).base_version)
        ok = base >= Version(lo) and (hi is None or base < Version(hi))
        lenient = os.environ.get("VERLFLOW_ALLOW_UNTESTED_VERSIONS") == "1"
        r.add(pkg, ok, f"{v} (need >= {lo}{f', < {hi}' if hi else ''})"
              + (" - allowed by VERLFLOW_ALLOW_UNTESTED_VERSIONS=1" if lenient and not ok else ""), fatal=not lenient)


def check_devices(ctx: StageContext, r: Report):
    res = ctx.bp.resources
    if res.device == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        r.add("accelerators", n >= res.nproc_per_node,
              f"{n} CUDA device(s) visible, resources.nproc_per_node={res.nproc_per_node}")
        if n:
            free, total = torch.cuda.mem_get_info(ctx.device)
            r.add("device_memory", True, f"rank {ctx.rank}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free",
                  fatal=False)
            fp8 = [f"rollout.{f}" for f in ("weights", "kv_cache") if getattr(ctx.bp.rollout, f) == "fp8"]
            if fp8:  # before build: the engine would refuse it at the first rollout
                from verlflow.core.ml.fastgen.layers import fp8_gpu_problem

                problem = fp8_gpu_problem(ctx.device, fp8[0])
                r.add("fp8_support", problem is None, problem or f"{', '.join(fp8)}=fp8: "
                      f"{torch.cuda.get_device_name(ctx.device)} has fp8 support")
    else:
        r.add("accelerators", True, f"cpu with gloo, {res.nproc_per_node} rank(s) per node", fatal=False)


def check_allreduce(ctx: StageContext, r: Report):
    t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(t)
    want = ctx.world * (ctx.world + 1) / 2
    r.add("all_reduce", t.item() == want, f"sum over {ctx.world} ranks = {t.item()} (want {want})")


def check_fsdp_sharding(ctx: StageContext, r: Report):
    """The tutorial's silent failure: FSDP that runs but does not shard. A toy model must split ~1/world."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(ctx.device)
    total = sum(p.numel() for p in net.parameters())
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in net.parameters())
    share = local * ctx.world / total
    r.add("fsdp_shard", 0.75 <= share <= 1.25,
          f"rank {ctx.rank} holds {local} of {total} parameters ({share:.2f} x 1/world at world={ctx.world})")


def check_model(ctx: StageContext, r: Report):
    """The model folder, its tokenizer, its decoder layers and the memory estimate; returns the tokenizer."""
    bp = ctx.bp
    problems = model_dir_problems(bp.model.path)
    r.add("model_folder", not problems, "; ".join(problems) or bp.model.path)
    if problems:
        return None
    tok = r.guard("tokenizer", lambda: M.load_tokenizer(bp.model.path))
    if tok is not None:
        r.add("tokenizer", True, "loads, has chat template")
    r.guard("model", lambda: check_layers(ctx, r))
    return tok


def check_layers(ctx: StageContext, r: Report):
    bp = ctx.bp
    meta = M.build_module(bp.model.path, bp.model, meta=True, adapters=True)  # model.lora: its targets must exist
    cls = M.decoder_layer_class(meta, bp.fsdp.wrap_class)
    layers = sum(1 for m in meta.modules() if isinstance(m, cls))
    r.add("decoder_layer", layers > 0, f"{cls.__name__} x {layers}")
    trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    if bp.model.lora is not None:
        r.add("lora", True, f"{trainable:,} adapter parameters")
    if bp.algorithm.fused_kernels_backend == "triton":
        hidden = meta.config.hidden_size
        r.add("fused_kernels_backend", hidden % 128 == 0,
              f"triton: hidden size {hidden}" + ("" if hidden % 128 == 0 else " is not a multiple of 128, which verl's "
                                                 "kernels need; set algorithm.fused_kernels_backend=torch"))


def check_memory(ctx: StageContext, r: Report) -> dict | None:
    """The memory plan (core/checks/memplan.py) of the blueprint as written (its `auto` settings chosen for this
    rank's card), refused where it does not fit, and its peak against what is free on the card now (another
    process may hold some). Rank 0 prints the table and writes memory_plan.{txt,json}; returns the plan's record."""
    from verlflow.core.checks import memplan

    if model_dir_problems(ctx.bp.model.path):  # check_model names them; there is no shape to plan with
        return None
    plan = memplan.plan_for(ctx.job.blueprint, ctx.device)
    r.add("memory_plan", plan.fits, f"rank {ctx.rank}: " + (plan.problem or plan.summary()))
    if ctx.device.type == "cuda" and plan.fits:
        free, _ = torch.cuda.mem_get_info(ctx.device)
        r.add("memory_free", free >= plan.peak, f"rank {ctx.rank}: {memplan.gib(free)} free on the card for a plan "
              f"peak of {memplan.gib(plan.peak)} ({plan.peak_stage})" + ("" if free >= plan.peak else
              "; another process holds the rest: free the GPU or lower the settings the plan names"))
    if ctx.is_main():
        table = plan.table()
        (ctx.out / "memory_plan.txt").write_text(table)
        (ctx.out / "memory_plan.json").write_text(json.dumps(plan.record(), indent=1))
        log.info("memory plan per GPU (%s):\n%s", plan.summary(), table)
    return plan.record()


def check_inputs(ctx: StageContext, r: Report, tok):
    """The driver's checks again (a flow run starts here: core/checks/preflight.py check_blueprint, as the CLI
    runs them), then what only the rollout's tokenizer and reward call can tell."""
    from verlflow.core.checks.preflight import check_blueprint, rollout_problems
    from verlflow.core.ml.data import load_prompts

    bp = ctx.bp
    found = check_blueprint(bp, ctx.job.run_id)
    for problem in found.problems:
        r.add("inputs", False, problem)
    if found.space is not None:
        r.add("store_space", found.space.fits, found.space.problem() or found.space.summary())
    if found.problems or tok is None:  # the rollout's checks need the dataset, the reward and the tokenizer
        return
    prompts = load_prompts(bp.data.train_files, bp.data.prompt_key)
    r.add("inputs", True, f"{len(prompts)} prompts, reward {bp.reward.function}")
    problems = rollout_problems(bp, tok, prompts)
    for problem in problems:
        r.add("rollout_inputs", False, problem)
    if not problems:
        r.add("rollout_inputs", True, f"prompts within data.max_prompt_length={bp.data.max_prompt_length}, "
              "the reward scores a sample")
    if bp.eval.files:
        check_eval_inputs(ctx, r, tok)
    if any(ph.kind in ("sft", "dpo") for ph in bp.phases):
        check_phase_inputs(ctx, r, tok)


def check_phase_inputs(ctx: StageContext, r: Report, tok):
    """The sft/dpo phases' rows through the tokenizer, as their stages encode them (missing_inputs read their
    columns, types and count)."""
    from verlflow.core.checks.preflight import phase_problems

    problems = phase_problems(ctx.bp, tok)
    for problem in problems:
        r.add("phase_inputs", False, problem)
    if not problems:
        r.add("phase_inputs", True, "every sft/dpo row fits its phase's algorithm.max_length after the chat template")


def check_eval_inputs(ctx: StageContext, r: Report, tok):
    """eval.files as the evaluate stage reads them (missing_inputs checked their columns and rows): the prompt
    lengths and the eval's reward; the data sources found, which promote.metric can name."""
    from verlflow.core.ml.evaluate import load_held_out
    from verlflow.core.checks.preflight import eval_problems, eval_sources_line

    held = load_held_out(ctx.bp.eval)
    problems = eval_problems(ctx.bp, tok, held.prompts)
    for problem in problems:
        r.add("eval_inputs", False, problem)
    if not problems:
        r.add("eval_inputs", True, eval_sources_line(held))


def check_algorithm(ctx: StageContext, r: Report):
    """The estimator and the loss by verl's own registries (the blueprint's enums are verlflow's table of them)."""
    from verl.trainer.ppo import core_algos

    from verlflow.core.algos import registry_drift

    a = ctx.bp.algorithm
    core_algos.get_adv_estimator_fn(a.adv_estimator)  # raises with verl's list if verl lacks it
    core_algos.get_policy_loss_fn(a.policy_loss)
    drift = registry_drift()
    r.add("algorithm", True, f"adv_estimator {a.adv_estimator}, policy_loss {a.policy_loss} (verl registries)")
    if drift:
        r.add("algorithm_registry", False, "; ".join(drift), fatal=False)


def run(ctx: StageContext) -> dict:
    r = Report()
    check_versions(r)
    r.guard("algorithm", lambda: check_algorithm(ctx, r))
    check_devices(ctx, r)
    r.guard("all_reduce", lambda: check_allreduce(ctx, r))
    r.guard("fsdp_shard", lambda: check_fsdp_sharding(ctx, r))
    memory = r.guard("memory_plan", lambda: check_memory(ctx, r))
    if ctx.is_main():
        r.guard("store_probe", lambda: (ctx.store.probe(), r.add("store_probe", True, ctx.store.root_uri)))
        tok = r.guard("model", lambda: check_model(ctx, r))
        r.guard("inputs", lambda: check_inputs(ctx, r, tok))
    rows = [None] * ctx.world
    dist.all_gather_object(rows, r.rows)
    failed = [f"rank {i}: {row['check']}: {row['detail']}" for i, rs in enumerate(rows) for row in rs if row["fatal"]]
    if ctx.is_main():
        (ctx.out / "report.json").write_text(json.dumps(rows, indent=1))
        lines = ["| rank | check | ok | detail |", "|---|---|---|---|"]
        lines += [f"| {i} | {row['check']} | {'yes' if row['ok'] else 'NO'} | {row['detail']} |"
                  for i, rs in enumerate(rows) for row in rs]
        (ctx.out / "report.md").write_text("\n".join(lines) + "\n")
        for line in lines[2:]:
            log.info(line)
    if failed:
        raise InputError("validate found {} problem(s):\n  ".format(len(failed)) + "\n  ".join(failed))
    return {"checks": sum(len(rs) for rs in rows), "problems": 0, **({"memory_plan": memory} if memory else {})}


main = stage_main(run)

if __name__ == "__main__":
    main()
