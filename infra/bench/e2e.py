"""End-to-end benchmark: GRPO iterations of the GPU blueprint's shape through the real pipeline (run_pipeline, as
`verlflow run` does, warm workers), on a random-weight model of the Qwen2.5-1.5B shape and a local prompt set.

    python infra/bench/e2e.py --root /tmp/e2e --store /dev/shm/e2e --configs baseline --keep --json b.json
    python infra/bench/e2e.py --root /tmp/e2e --store /dev/shm/e2e --configs rollout_logprobs --keep --json r.json
    python infra/bench/e2e.py --smoke                                            # CPU, tiny kit (the test suite)

On one H200 each GPU command is one config (~5-8 min: a 10-minute limit per command holds one, not two); the same
--root and --store make the second reuse the first's kit, build and inductor cache. The store holds the build
(26.6 GB at 1.5B today) plus per iteration the update's checkpoint and the HF export.

The blueprint is blueprints/gpu-qwen2.5-1.5b.yaml itself (its update, rollout, fsdp and storage settings), on
1 GPU, with the model, data, store and reward pointed at the local kit: 256 prompts x 5 samples = 1,280 samples of
<= 1,024 new tokens per iteration. Each config is one pipeline run (validate, build, `--iterations` x rollout ->
update -> checkpoint) under the run id "e2e", forced from build: the blueprint's retention prunes the build's
initial policy once an update is kept instead, so a config cannot restart from the previous config's build; every
config rewrites the same folders, so the store holds one run at a time.

The workload: the model's weights are random and the prompts are the tiny kit's (its tokenizer's ids stop at 384,
prompts are ~20 tokens). A random 152k-vocabulary model picks the tokenizer's EOS with probability ~1/152k per
step, so nearly every response runs to max_new_tokens: 1,280 x ~1,045 tokens, the upper end of "<= 1,024 new
tokens" and the workload today's figures (13.0k tok/s/GPU steady, 6.1k first) were measured on. `tokens` is
counted from the committed batch itself (non-pad prompt + response tokens), so a run with shorter responses
reports what it did, not what was asked for. The rewards are ~0 (the digits task on random tokens); no cost
depends on them.

Reported per config and iteration: wall seconds (from the previous iteration's last step returning to this one's,
as the pipeline loop sees it, less a warm pool's start-up, which `verlflow run` pays in validate), each stage's seconds and its own manifest timings (rollout: load_s, generate_s,
sampling_s, engine_setup_s; update: ref_s, load_s, old_logp_s, train_s, save_s; checkpoint: export...), tokens,
verl's tok/s/GPU = non-pad tokens / iteration wall / GPUs, the store's bytes when the iteration returned; then the
first iteration against the steady state (mean of iterations >= 2), the build, and the store's bytes at the end
(after the warm pool's last background commits). The inductor cache (fsdp.compile, the static engine's kernels)
lives under the benchmark's root and is shared by its configs unless --fresh-inductor-cache: the first config of a
fresh root pays the cold compile in its first iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
BLUEPRINT = ROOT / "blueprints/gpu-qwen2.5-1.5b.yaml"
RUN_ID = "e2e"
CONFIGS = {  # blueprint overrides per config, on top of the GPU blueprint
    "shipped": {},  # the blueprint as it is
    # the blueprint as shipped on 2026-12-06: the update recomputed the old log-probs, the rollout sampled 256 rows
    "shipped_2026_12_06": {"algorithm.old_logprobs": "recompute", "rollout.micro_batch_size": 256},
    "baseline": {"algorithm.old_logprobs": "recompute"},
    "rollout_logprobs": {"algorithm.old_logprobs": "rollout"},  # the rollout's log-probs replace the update's pass
    # On one GPU the blueprint's 160 samples per wave (its share on 8 GPUs) make 8 waves; 640 make 2 (~28 GB of KV
    # cache at 1.5B, prompt 512 + 1,024 new tokens). RESULTS.md: 73.6 s an iteration against 90.5 s.
    "rollout_logprobs_640": {"algorithm.old_logprobs": "rollout", "rollout.micro_batch_size": 640},
    # fp8 projections in the rollout, the update weighs its loss by the truncated ratio to the rollout's log-probs
    # (update/rollout_corr/* in the manifest: the gap the fp8 rollout opens against the bf16 policy)
    "fp8_corrected": {"algorithm.old_logprobs": "recompute", "rollout.weights": "fp8",
                      "algorithm.rollout_correction": "true", "algorithm.rollout_is": "token"},
    # issue 42: one-step-off rollouts on half the GPUs beside the update on the other half, against on-policy with
    # the same loss on all of them (the correction's weights are 1 there); --gpus is the node's split
    "onpolicy_corrected": {"algorithm.old_logprobs": "recompute", "algorithm.rollout_correction": "true"},
    "async": {"algorithm.old_logprobs": "recompute", "algorithm.rollout_correction": "true",
              "rollout.async.staleness": 1},
}
ITER_STAGES = ("rollout", "update", "export")
T0 = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def store_bytes(folder: Path) -> int:
    """Bytes under `folder`. A warm pool's background retention may delete files while this walks (the smoke test
    hit FileNotFoundError in rglob): os.walk skips a vanished folder, and a vanished file counts 0."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def batch_tokens(store: Path, iteration: int) -> dict:
    """Non-pad prompt and response tokens of the iteration's committed rollout batch."""
    from safetensors.torch import load_file

    t = load_file(str(store / f"runs/{RUN_ID}/{iteration}/rollout/batch.safetensors"))
    prompt, response = int(t["prompt_mask"].sum()), int(t["response_mask"].sum())
    return {"samples": int(t["responses"].shape[0]), "prompt_tokens": prompt, "response_tokens": response,
            "tokens": prompt + response}


def overrides(args, kit: dict, store: Path, config: str) -> list[str]:
    over = {"model.path": kit["model_dir"], "data.train_files": json.dumps([kit["train_file"]]),
            "storage.uri": str(store), "reward.function": "tiny_digits", "iterations": args.iterations,
            "resources.nproc_per_node": args.gpus,
            # validate's key holds the resources: a timeout of this run's own makes validate run again (seconds;
            # the build is reused), so every config's warm pool starts in validate, as `verlflow run`'s does, and
            # its first job's costs (process group, first imports) are not charged to iteration 1
            "resources.stage_timeout_s": 1800 + int(time.time() * 1000) % 100_000}
    if args.prompts:  # the blueprint's 4 mini-batches per iteration
        over.update({"data.batch_size": args.prompts, "algorithm.ppo_mini_batch_size": max(1, args.prompts // 4)})
    if args.new_tokens:
        over["rollout.max_new_tokens"] = args.new_tokens
    if args.smoke:  # the tiny kit on CPU: eager, fp32, small batches (the pipeline and the report are the subject)
        over.update({"resources.device": "cpu", "fsdp.mixed_precision": "fp32", "fsdp.compile": "false",
                     "data.batch_size": 4, "data.max_prompt_length": 64, "rollout.n": 2, "rollout.max_new_tokens": 8,
                     "rollout.micro_batch_size": 8, "algorithm.ppo_mini_batch_size": 2,
                     "algorithm.ppo_micro_batch_size_per_gpu": 2, "algorithm.ppo_max_token_len_per_gpu": 64,
                     "algorithm.use_fused_kernels": "false", "algorithm.fused_kernels_backend": "torch"})
    over.update(CONFIGS[config])
    for kv in args.set:
        k, v = kv.split("=", 1)
        over[k] = v
    return [f"{k}={v}" for k, v in over.items()]


def run_config(args, kit: dict, store: Path, config: str) -> dict:
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.orchestrate.pipeline import run_pipeline

    bp = load_blueprint(BLUEPRINT, overrides(args, kit, store, config))
    gpus = bp.resources.world_size
    lines: list[str] = []
    marks: dict = {}  # (stage, iteration) -> (seconds since the loop began when it returned, store bytes then)
    t_loop = time.perf_counter()

    def on_step(step, res):
        marks[(step.stage, step.iteration)] = (time.perf_counter() - t_loop,
                                               store_bytes(store) if step.stage == "export" else None)
        t = res.manifest.get("timings", {})
        say(f"  {config}: {step.name} {res.seconds:.1f} s" + (" (reused)" if res.skipped else "") + " "
            + json.dumps({k: v for k, v in t.items() if isinstance(v, (int, float))}))

    say(f"{config}: {bp.data.batch_size} prompts x {bp.rollout.n}, <= {bp.rollout.max_new_tokens} new tokens, "
        f"{args.iterations} iterations on {gpus} {bp.resources.device} rank(s), "
        f"algorithm.old_logprobs={bp.algorithm.old_logprobs}")
    try:
        results = run_pipeline(bp, RUN_ID, on_line=lines.append, on_step=on_step, force_from="build")
    except Exception:
        print("\n".join(lines[-80:]), flush=True)  # the failing stage's own output
        raise
    finally:
        if args.log:  # the stages' own output (compiles, the engine's set-up parts), one file per config
            args.log.with_suffix(f".{config}.log").write_text("\n".join(lines) + "\n")
    end_bytes = store_bytes(store)
    by = {(r.manifest["stage"], r.manifest["iteration"]): r for r in results}
    out = {"config": config, "overrides": CONFIGS[config], "gpus": gpus, "device": bp.resources.device,
           "samples_per_iteration": bp.data.batch_size * bp.rollout.n, "max_new_tokens": bp.rollout.max_new_tokens,
           "keep_last_checkpoints": bp.storage.keep_last_checkpoints, "keep_last": bp.storage.keep_last,
           "setup": {s: stage_row(by[(s, "init")]) for s in ("validate", "build")},
           "iterations": [], "store_bytes_end": end_bytes}
    prev = marks[("build", "init")][0]
    for i in range(1, bp.iterations + 1):
        done, bytes_then = marks[("export", i)]
        stages = {s: stage_row(by[(s, i)]) for s in ITER_STAGES}
        # A config whose validate and build were reused starts its pool in rollout[1]; `verlflow run` starts it in
        # validate: the pool's start-up is reported apart, not in the iteration.
        pool_start = sum(st.get("pool_start_s", 0.0) for st in stages.values())
        wall = done - prev - pool_start
        prev = done
        tok = batch_tokens(store, i)
        out["iterations"].append({"iteration": i, "wall_s": round(wall, 3), "pool_start_s": round(pool_start, 3),
                                  **tok,
                                  "tok_per_s_per_gpu": round(tok["tokens"] / wall / gpus, 1),
                                  "store_bytes": bytes_then, "stages": stages})
    out["first"], out["steady"] = summary(out["iterations"][:1]), summary(out["iterations"][1:])
    if out["steady"]:
        out["first_over_steady"] = round(out["first"]["wall_s"] / out["steady"]["wall_s"], 3)
        out["first_extra_s"] = first_extra(out["first"], out["steady"])
    return out


def first_extra(first: dict, steady: dict) -> dict:
    """Where the first iteration's fixed costs go: each stage timing's first-iteration excess over the steady
    state, largest first (engine set-up, loads from disk, compile warm-up inside train_s...)."""
    extra = {f"{s}.{k}": round(v - steady["stages"][s].get(k, 0.0), 3)
             for s in ITER_STAGES for k, v in first["stages"][s].items()
             if k.endswith("_s") and k not in ("stage_s", "background_s", "launch_to_worker_s", "pool_start_s")}
    return dict(sorted(extra.items(), key=lambda kv: -kv[1]))


def stage_row(res) -> dict:
    t = res.manifest.get("timings", {})
    row = {"wall_s": round(res.seconds, 3), "skipped": res.skipped,
           **{k: v for k, v in t.items() if isinstance(v, (int, float))}}
    metrics = res.manifest.get("metrics", {})
    # whether models came from a warm pool's memory; how the update's background save got its CPU copy
    # memory: the card's peak against the memory plan's; memory_plan: validate's plan and its auto choices
    for k in ("warm_cache_hits", "ref_source", "save_copy", "compiles", "memory", "memory_plan"):
        if k in metrics:
            row[k] = metrics[k]
    for k in ("kl", "k3_kl", "rollout_is_mean", "rollout_is_ratio_fraction_high"):  # algorithm.rollout_correction:
        if f"rollout_corr/{k}" in metrics:  # the rollout's gap to the trained policy
            row[f"rollout_corr_{k}"] = metrics[f"rollout_corr/{k}"]
    if metrics.get("mini_batches"):  # the first step's policy is the rollout's: its PPO KL is the log-prob mismatch
        first = metrics["mini_batches"][0]  # between the sampler and the update (0 when the update recomputes)
        row.update(first_ppo_kl=first["ppo_kl"], first_pg_clipfrac=first["pg_clipfrac"])
    return row


def summary(its: list[dict]) -> dict:
    """Mean wall, tokens and tok/s/GPU of these iterations, and each stage timing's mean."""
    if not its:
        return {}
    n = len(its)
    wall = sum(it["wall_s"] for it in its) / n
    tokens = sum(it["tokens"] for it in its) / n
    gpus_tps = sum(it["tok_per_s_per_gpu"] for it in its) / n
    stages: dict = {}
    for s in ITER_STAGES:
        keys = {k for it in its for k, v in it["stages"][s].items() if isinstance(v, (int, float))}
        stages[s] = {k: round(sum(it["stages"][s].get(k, 0.0) for it in its) / n, 3) for k in sorted(keys)}
    return {"iterations": [it["iteration"] for it in its], "wall_s": round(wall, 3), "tokens": round(tokens),
            "tok_per_s_per_gpu": round(gpus_tps, 1), "stages": stages}


_SHOWN = {"rollout": ("load_s", "generate_s", "engine_setup_s", "sampling_s"),
          "update": ("ref_s", "load_s", "old_logp_s", "train_s", "save_s"),
          "export": ("export_s",)}


def table(res: dict) -> str:
    head = ["config", "iteration", "wall s", "tokens", "tok/s/GPU", "store GB"]
    for s in ITER_STAGES:
        head += [f"{s} s"] + [f"{s[:3]}.{k[:-2]}" for k in _SHOWN[s]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in res["configs"].values():
        rows = [(str(it["iteration"]), it) for it in c["iterations"]]
        rows += [("first", c["first"])] + ([("steady (>= 2)", c["steady"])] if c["steady"] else [])
        for label, it in rows:
            gb = f"{it['store_bytes'] / 1e9:.2f}" if it.get("store_bytes") is not None else "-"
            cells = [c["config"], label, f"{it['wall_s']:.1f}", f"{it['tokens']:,}", f"{it['tok_per_s_per_gpu']:,.0f}",
                     gb]
            for s in ITER_STAGES:
                st = it["stages"][s]
                cells += [f"{st['wall_s']:.1f}"] + [f"{st[k]:.1f}" if k in st else "-" for k in _SHOWN[s]]
            lines.append("| " + " | ".join(cells) + " |")
    foot = [f"{c['config']}: first/steady {c.get('first_over_steady', '-')}, build {c['setup']['build']['wall_s']:.1f} s, "
            f"store after {len(c['iterations'])} iterations {c['store_bytes_end'] / 1e9:.2f} GB; first iteration's "
            "extra s: " + ", ".join(f"{k} {v:.1f}" for k, v in list(c.get("first_extra_s", {}).items())[:6])
            + "; update's first-step PPO KL per iteration: "
            + ", ".join(f"{it['stages']['update'].get('first_ppo_kl', 0):.2e}" for it in c["iterations"])
            for c in res["configs"].values()]
    return "\n".join(lines + [""] + foot)


def memory_table(res: dict) -> str:
    """Each stage's measured peak (torch.cuda.max_memory_allocated) beside the memory plan's, per config."""
    lines = ["| config | stage | auto chose | start GiB | peak GiB | planned GiB | measured / planned |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in res["configs"].values():
        chose = c["setup"]["validate"].get("memory_plan", {})
        chose = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in chose.get("choices", {}).items()
                          if k in chose.get("chosen", ()))
        rows = [(f"{s}", c["setup"][s]) for s in ("build",)]
        rows += [(f"{s}[{it['iteration']}]", it["stages"][s]) for it in c["iterations"] for s in ITER_STAGES]
        for name, row in rows:
            m = row.get("memory")
            if not m:
                continue
            ratio = f"{m['peak_gib'] / m['planned_gib']:.2f}" if m.get("planned_gib") else "-"
            lines.append(f"| {c['config']} | {name} | {chose or '-'} | {m['start_gib']:.1f} | {m['peak_gib']:.1f} | "
                         f"{m['planned_gib'] if m.get('planned_gib') is not None else '-'} | {ratio} |")
    return "\n".join(lines)


def _configs(raw: str) -> str:
    unknown = [c for c in raw.split(",") if c not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    return raw


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="baseline,rollout_logprobs", type=_configs,
                    help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--iterations", type=int, default=2, help="iteration 1 is the first, >= 2 the steady state")
    ap.add_argument("--store", type=Path, help="the artifact store's folder (a RAM disk, say); default under --root. "
                    "Reused as it is: an earlier run's build there is reused")
    ap.add_argument("--root", type=Path, help="kit, inductor cache and default store (default: a new temp folder)")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--shape", default="1.5b", choices=("0.5b", "1.5b", "7b"), help="the random model's Qwen2.5 shape")
    ap.add_argument("--prompts", type=int, help="data.batch_size (default: the blueprint's 256; a multiple of 32, for "
                    "its 4 mini-batches of micro-batches of 8)")
    ap.add_argument("--new-tokens", type=int, help="rollout.max_new_tokens (default: the blueprint's 1,024)")
    ap.add_argument("--set", action="append", default=[], help="more blueprint overrides, a.b=value (every config)")
    ap.add_argument("--fresh-inductor-cache", action="store_true", help="a cold inductor cache for every config")
    ap.add_argument("--keep", action="store_true", help="keep the store and kit (default: the store is removed at "
                    "the end when it is under --root)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log", type=Path, help="write each config's stage output to LOG.<config>.log")
    ap.add_argument("--smoke", action="store_true", help="the tiny kit on CPU, 2 iterations")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.iterations = max(args.iterations, 2)

    from boundaries import make_kit

    root = args.root or Path(tempfile.mkdtemp(prefix="verlflow-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    store = args.store or root / "store"
    shape = "tiny" if args.smoke else args.shape
    made = root / shape / "e2e-kit.json"  # a rerun with the same --root reuses the kit (and so the build)
    kit = json.loads(made.read_text()) if made.exists() else None
    if kit is None:
        kit = make_kit(root / shape, shape)
        made.write_text(json.dumps({k: kit[k] for k in ("model_dir", "train_file")}))
        import torch

        if torch.cuda.is_available():  # the random model was made on the GPU: give its memory back to the stages
            torch.cuda.empty_cache()
    say(f"root {root}, store {store}, kit {kit['model_dir']}")
    os.environ.setdefault("VERLFLOW_ALLOW_UNTESTED_VERSIONS", "1")  # the GPU image's transformers is newer than verl's range
    res = {"blueprint": str(BLUEPRINT.relative_to(ROOT)), "iterations": args.iterations, "smoke": args.smoke,
           "store": str(store), "configs": {}}
    for config in args.configs.split(","):
        cache = root / ("inductor-" + config if args.fresh_inductor_cache else "inductor")
        os.environ["VERLFLOW_CACHE_DIR"] = str(root / "cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # the warm pool's workers inherit it
        res["configs"][config] = run_config(args, kit, store, config)
        say(json.dumps({k: v for k, v in res["configs"][config].items() if k not in ("iterations", "setup")}))
        if args.json:  # after every config: a run cut short keeps what it measured
            args.json.write_text(json.dumps(res, indent=1))
    print(table(res), flush=True)
    if any(it["stages"]["update"].get("memory") for c in res["configs"].values() for it in c["iterations"]):
        print(memory_table(res), flush=True)
    if not args.keep and store.is_relative_to(root):
        shutil.rmtree(store, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
