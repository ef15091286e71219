"""Stage-boundary benchmark: GRPO iterations as separate stage jobs (rollout -> update -> checkpoint, each a
torchrun job with artifacts between), as the same stages in a warm pool (resources.warm_workers), and as one
process (the monolithic stage), through the real runner and store, at a real model shape with random weights.

    python infra/bench/boundaries.py                      # GPU: Qwen2.5-1.5B shape, 64 prompts x 8, 512 new tokens
    python infra/bench/boundaries.py --smoke              # CPU, tiny kit (the test suite runs this)

The comparison is the last iteration (the steady state: a pool's first iteration still reads the build from disk)
against that iteration's work in one process: its rollout and update plus one checkpoint save and HF export. The
warm pool runs twice: with background checkpoint commits (resources.async_checkpoint, the default: the update
returns once its checkpoint is in CPU memory; the next update waits for the previous write) and with inline ones.
The run's tail, the last background commits after the last stage returned, is printed on its own.
Also printed, per stage: wall, launch -> worker main (spawn + imports), loads, saves, and DCP save/load GB/s and
the commit digest's GB/s for the policy checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SHAPES  # noqa: E402

T0 = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def make_kit(root: Path, shape: str) -> dict:
    """The tiny kit's tokenizer and prompts with a model of `shape` (random bf16 weights). The tokenizer's ids
    stop at 384; sampled ids beyond it decode to nothing, so rewards are ~0 but every cost is the real shape's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verlflow.core.testing.tinykit import make_tiny

    kit = make_tiny(root / "kit")
    if shape == "tiny":
        return kit
    tok_cfg = json.loads((Path(kit["model_dir"]) / "config.json").read_text())
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
                      bos_token_id=tok_cfg["bos_token_id"], eos_token_id=tok_cfg["eos_token_id"],
                      pad_token_id=tok_cfg["pad_token_id"])
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    for f in Path(kit["model_dir"]).glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(kit["model_dir"], safe_serialization=True)
    return kit


def size_gb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=2, help="the last one is compared (steady state)")
    ap.add_argument("--set", action="append", default=[], help="more blueprint overrides, a.b=value")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-fresh", action="store_true", help="only the warm pool and the monolithic job")
    ap.add_argument("--pools", default="async,sync", help="warm-pool runs: async (background checkpoint commits, "
                    "the default) and/or sync (resources.async_checkpoint=false)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        # One rank and a short rollout: the smoke checks every path and column, not the speed of the maths.
        args.shape, args.prompts, args.n, args.new_tokens, args.nproc = "tiny", 4, 2, 4, 1
        args.pools = "async"

    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.orchestrate.pipeline import run_pipeline
    from verlflow.core.orchestrate.runner import RunContext, run_stage

    root = Path(tempfile.mkdtemp(prefix="verlflow-bound-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))  # persistent across stage jobs
    kit = make_kit(root, args.shape)
    say(f"kit at {root} ({size_gb(Path(kit['model_dir'])):.2f} GB of model files)")
    gpu = not args.smoke
    over = {
        "model.path": kit["model_dir"], "data.train_files": json.dumps([kit["train_file"]]),
        "storage.uri": str(root / "store"), "reward.function": "tiny_digits", "iterations": args.iterations,
        "data.batch_size": args.prompts, "data.max_prompt_length": 128, "rollout.n": args.n,
        "rollout.max_new_tokens": args.new_tokens, "rollout.micro_batch_size": args.prompts * args.n // args.nproc,
        "algorithm.ppo_mini_batch_size": max(1, args.prompts // 4), "algorithm.ppo_micro_batch_size_per_gpu": 8,
        "resources.nproc_per_node": args.nproc, "resources.stage_timeout_s": 1200,
        "model.dtype": "float32",
        # every pass below restarts from the build's policy (--from rollout[1], monolithic): retention keeps it
        "storage.keep_last_checkpoints": args.iterations + 1,
    }
    if gpu:
        over.update({"resources.device": "cuda", "fsdp.mixed_precision": "bf16", "rollout.engine": "static",
                     "algorithm.use_remove_padding": "true", "fsdp.activation_checkpointing": "false",
                     # blueprints/gpu-qwen2.5-1.5b.yaml's update settings
                     "algorithm.ppo_max_token_len_per_gpu": 16384, "algorithm.use_fused_kernels": "true",
                     "fsdp.compile": "true"})
    else:
        over.update({"algorithm.ppo_micro_batch_size_per_gpu": 4, "algorithm.ppo_mini_batch_size": 2})
    for kv in args.set:
        k, v = kv.split("=", 1)
        over[k] = v
    bp = load_blueprint(None, [f"{k}={v}" for k, v in over.items()])
    lines = []
    log = lines.append if not args.smoke else (lambda line: None)

    def progress(step, res):  # a line per stage, so a run cut short still shows what it measured
        t = res.manifest["timings"]
        say(f"  {step.stage}[{step.iteration}] {res.seconds:.1f} s (launch->main {t.get('launch_to_worker_s', 0):.1f} "
            f"s) " + json.dumps({k: v for k, v in t.items() if k not in ("launch_to_worker_s",)}))

    def pipeline(run_id, blueprint, force_from=None):
        """The run's results by (stage, iteration), and its tail: the seconds from the last stage's return to the
        end of the run (the warm pool's last background commits)."""
        last = []
        try:
            results = run_pipeline(blueprint, run_id, on_line=log, force_from=force_from,
                                   on_step=lambda step, res: (progress(step, res), last.append(time.perf_counter())))
        except Exception:
            print("\n".join(lines[-60:]), flush=True)  # the failing stage's own output
            raise
        return {(r.manifest["stage"], r.manifest["iteration"]): r for r in results}, time.perf_counter() - last[-1]

    iter_stages = ["rollout", "update", "export"]
    k = bp.iterations  # the steady state: the last iteration (a pool's first iteration still loads from disk)
    store = root / "store"
    policy_dir = store / f"runs/staged/{k}/update/policy"
    staged = None
    if not args.skip_fresh:
        say(f"staged: validate, build, then {k} x (rollout -> update -> checkpoint) as separate jobs")
        staged, _ = pipeline("staged", bp)

    pools, tails = {}, {}
    for mode in args.pools.split(","):
        say(f"staged in a warm pool (resources.warm_workers), {mode} checkpoint commits: the same stages in one job")
        # Same run id, forced from rollout[1]: build is reused and the iterations' folders are rewritten, so the
        # disk holds one run's checkpoints (18 GB each at 1.5B), not two.
        warm_bp = load_blueprint(None, ["resources.warm_workers=true", f"resources.async_checkpoint={mode == 'async'}"],
                                 data=bp.model_dump(mode="json"))
        ran_before = staged is not None or pools
        pools[mode], tails[mode] = pipeline("staged", warm_bp, force_from="rollout[1]" if ran_before else None)
    warm = pools.get("async") or pools["sync"]
    inline = pools.get("sync") if "async" in pools else None
    ckpt_gb = size_gb(policy_dir)
    hash_rate = _hash_rate(policy_dir)

    say(f"monolithic: the same {k} iterations in one job")
    try:
        mono = run_stage(RunContext(bp, "staged", on_line=log), "monolithic", "mono",
                         {"build": "runs/staged/init/build"})
    except Exception:
        print("\n".join(lines[-60:]), flush=True)
        raise
    mt = mono.manifest["timings"]
    last = mono.manifest["metrics"]["iterations"][-1]
    # The same work in one process: iteration k's rollout and update, plus one checkpoint save and HF export.
    mono_work = last["rollout_s"] + last["update_s"] + mt.get("save_s", 0) + mt.get("export_s", 0)

    def per_iter(runs: dict | None, it) -> float:
        return sum(runs[(s, it)].seconds for s in iter_stages) if runs else float("nan")

    res = {"shape": args.shape, "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
           "nproc": args.nproc, "iterations": k, "steady_iteration": k,
           "staged_s": round(per_iter(staged, k), 2), "staged_first_s": round(per_iter(staged, 1), 2),
           "warm_staged_s": round(per_iter(warm, k), 2), "warm_first_s": round(per_iter(warm, 1), 2),
           "warm_mode": "async" if "async" in pools else "sync", "warm_tail_s": round(tails.get("async", 0.0), 2),
           "warm_inline_s": round(per_iter(inline, k), 2),
           "monolithic_job_s": round(mono.seconds, 2), "monolithic_work_s": round(mono_work, 2),
           "monolithic_per_iteration": mono.manifest["metrics"]["iterations"],
           "monolithic_timings": {k_: v for k_, v in mt.items() if isinstance(v, (int, float))},
           "policy_checkpoint_gb": round(ckpt_gb, 2), "sha256_gb_per_s": hash_rate, "stages": {}, "warm_stages": {},
           "warm_inline_stages": {}}
    for name, base in (("ratio", "staged_s"), ("warm_ratio", "warm_staged_s"), ("warm_inline_ratio", "warm_inline_s")):
        res[f"{name}_vs_work"] = round(res[base] / max(res["monolithic_work_s"], 1e-9), 3)  # of the rounded values shown
    for s in iter_stages:
        for key, runs in (("stages", staged), ("warm_stages", warm), ("warm_inline_stages", inline)):
            if runs is None:
                continue
            r = runs[(s, k)]
            res[key][s] = {"wall_s": round(r.seconds, 2), **{k_: v for k_, v in r.manifest["timings"].items()
                                                             if isinstance(v, (int, float))}}
    res["stages"]["monolithic"] = {"wall_s": round(mono.seconds, 2), **res["monolithic_timings"]}
    # save_s is the whole DCP save only where the save is inline (the async pool's is its copy to CPU memory)
    up = res["stages"].get("update") or res["warm_inline_stages"].get("update") or (
        res["warm_stages"]["update"] if res["warm_mode"] == "sync" else {})
    if up.get("save_s"):
        res["dcp_save_gb_per_s"] = round(ckpt_gb / up["save_s"], 2)
    if res["stages"].get("update", {}).get("load_s"):  # a warm pool's update loads from memory
        res["dcp_load_gb_per_s"] = round(ckpt_gb / up["load_s"], 2)  # policy + optimizer, fresh job

    say(json.dumps(res, indent=1))
    # The table: measure | baseline (one process) | ours (warm pool) | ratio | and the fresh-job path beside.
    def cell(runs, s):
        return f"{runs[(s, k)].seconds:.1f} s" if runs else "-"

    one = {"rollout": last["rollout_s"], "update": last["update_s"] + mt.get("save_s", 0),
           "export": mt.get("export_s", 0)}
    def inline_cell(s=None):
        if inline is None:
            return "-"
        return cell(inline, s) if s else f"{res['warm_inline_s']:.1f} s ({res['warm_inline_ratio_vs_work']:.2f}x)"

    table = [(f"iteration {k}: rollout + update + export", f"{mono_work:.1f} s", f"{res['warm_staged_s']:.1f} s",
              f"{res['warm_ratio_vs_work']:.3f}x", inline_cell(), f"{res['staged_s']:.1f} s ({res['ratio_vs_work']:.2f}x)")]
    for s in iter_stages:
        ratio = warm[(s, k)].seconds / one[s] if one[s] else float("nan")
        table.append((f"  {s}" + (" (incl. DCP save)" if s == "update" else " (HF export)" if s == "export"
                                  else ""), f"{one[s]:.1f} s", cell(warm, s), f"{ratio:.2f}x", inline_cell(s),
                      cell(staged, s)))
    table.append(("iteration 1 (first-time costs)", "-", f"{res['warm_first_s']:.1f} s", "-",
                  f"{per_iter(inline, 1):.1f} s" if inline else "-", f"{res['staged_first_s']:.1f} s"))
    if res["warm_mode"] == "async":
        table.append(("end of run: the last background commits", "-", f"{res['warm_tail_s']:.1f} s", "-", "-", "-"))
    print(f"| measure | one process (baseline) | warm pool (ours, {res['warm_mode']} commits) | ratio | "
          "warm pool, commits inline | fresh stage jobs |\n| --- | --- | --- | --- | --- | --- |\n"
          + "\n".join("| " + " | ".join(r) + " |" for r in table), flush=True)
    rows = [(f"monolithic job, all {k} iterations", f"{mono.seconds:.1f} s"),
            ("policy checkpoint (params + Adam)", f"{ckpt_gb:.2f} GB"),
            ("DCP save / load (update; load from a fresh job only)", f"{res.get('dcp_save_gb_per_s', '-')} / "
                                                    f"{res.get('dcp_load_gb_per_s', '-')} GB/s"),
            ("commit digest (sha256 of 64 MiB pieces, 8 threads)", f"{hash_rate} GB/s")]
    for key, label in (("stages", "fresh"), ("warm_stages", "warm"), ("warm_inline_stages", "warm inline")):
        for s in iter_stages if res[key].get("update") else []:
            st = res[key][s]
            rows.append((f"{label} {s}[{k}]: wall / launch->main / stage", f"{st['wall_s']:.1f} / "
                         f"{st.get('launch_to_worker_s', 0):.2f} / {st.get('stage_s', 0):.1f} s; " + ", ".join(
                             f"{k_} {v:.1f}" for k_, v in st.items() if k_.endswith("_s") and k_ not in
                             ("wall_s", "launch_to_worker_s", "stage_s"))))
    print("| measure | value |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


def _hash_rate(folder: Path) -> float:
    from verlflow.core.store.digests import file_digest

    files = [f for f in folder.rglob("*") if f.is_file()]
    t = time.perf_counter()
    for f in files:
        file_digest(f)
    return round(sum(f.stat().st_size for f in files) / 1e9 / (time.perf_counter() - t), 2)


if __name__ == "__main__":
    sys.exit(main())
