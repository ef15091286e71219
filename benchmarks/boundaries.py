"""Stage-boundary benchmark: one GRPO iteration as separate stage jobs (rollout -> update -> checkpoint, each a
torchrun job with artifacts between) against the same iteration in one process (the monolithic stage), through
the real runner and store, at a real model shape with random weights.

    python benchmarks/boundaries.py                      # GPU: Qwen2.5-1.5B shape, 64 prompts x 8, 512 new tokens
    python benchmarks/boundaries.py --smoke              # CPU, tiny kit (the test suite runs this)

Prints the staged (fresh jobs, and a warm pool: resources.warm_workers) and monolithic wall times, their ratios, and where the staged path's extra time goes: per stage,
launch -> worker main (spawn + imports), loads (GB/s), saves (GB/s) and commit (checksums); plus sha256 GB/s
and DCP save/load GB/s of the policy measured directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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

    from core.tinykit import make_tiny

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
    ap.add_argument("--set", action="append", default=[], help="more blueprint overrides, a.b=value")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.prompts, args.n, args.new_tokens, args.nproc = "tiny", 4, 4, 8, 2

    from core.blueprint import load_blueprint
    from core.pipeline import run_pipeline
    from core.runner import run_stage

    root = Path(tempfile.mkdtemp(prefix="verlflow-bound-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))  # persistent across stage jobs
    kit = make_kit(root, args.shape)
    say(f"kit at {root} ({size_gb(Path(kit['model_dir'])):.2f} GB of model files)")
    gpu = not args.smoke
    over = {
        "model.path": kit["model_dir"], "data.train_files": json.dumps([kit["train_file"]]),
        "storage.uri": str(root / "store"), "reward.function": "tiny_digits", "iterations": 1,
        "data.batch_size": args.prompts, "data.max_prompt_length": 128, "rollout.n": args.n,
        "rollout.max_new_tokens": args.new_tokens, "rollout.micro_batch_size": args.prompts * args.n // args.nproc,
        "algorithm.ppo_mini_batch_size": max(1, args.prompts // 4), "algorithm.ppo_micro_batch_size_per_gpu": 8,
        "resources.nproc_per_node": args.nproc, "resources.stage_timeout_s": 1200,
        "model.dtype": "float32",
    }
    if gpu:
        over.update({"resources.device": "cuda", "fsdp.mixed_precision": "bf16", "rollout.engine": "static",
                     "algorithm.use_remove_padding": "true", "fsdp.activation_checkpointing": "false"})
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

    def pipeline(run_id, blueprint):
        try:
            return run_pipeline(blueprint, run_id, on_line=log, on_step=progress)
        except Exception:
            print("\n".join(lines[-60:]), flush=True)  # the failing stage's own output
            raise

    iter_stages = ["rollout", "update", "checkpoint"]
    say("staged: validate, build, then rollout -> update -> checkpoint as separate jobs")
    staged = pipeline("staged", bp)
    by = {r.manifest["stage"]: r for r in staged}
    staged_s = sum(by[s].seconds for s in iter_stages)
    say("staged in a warm pool (resources.warm_workers): the same stages in one torchrun job")
    warm = pipeline("warm", load_blueprint(None, ["resources.warm_workers=true"], data=bp.model_dump(mode="json")))
    warm_by = {r.manifest["stage"]: r for r in warm}
    warm_s = sum(warm_by[s].seconds for s in iter_stages)

    say("monolithic: the same iteration in one job")
    try:
        mono = run_stage("monolithic", bp, "staged", "mono", {"build": "runs/staged/init/build"}, on_line=log)
    except Exception:
        print("\n".join(lines[-60:]), flush=True)
        raise
    mt = mono.manifest["timings"]

    store = root / "store"
    policy_dir = store / "runs/staged/1/update/policy"
    ckpt_gb = size_gb(policy_dir)
    res = {"shape": args.shape, "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
           "nproc": args.nproc, "staged_s": round(staged_s, 2), "monolithic_job_s": round(mono.seconds, 2),
           "monolithic_work_s": round(sum(mt.get(k, 0) for k in ("rollout_s", "update_s", "save_s", "export_s")), 2),
           "policy_checkpoint_gb": round(ckpt_gb, 2), "stages": {}}
    res["ratio_vs_job"] = round(staged_s / mono.seconds, 3)
    res["ratio_vs_work"] = round(staged_s / max(res["monolithic_work_s"], 1e-9), 3)
    res["warm_staged_s"] = round(warm_s, 2)
    res["warm_ratio_vs_job"] = round(warm_s / mono.seconds, 3)
    res["warm_ratio_vs_work"] = round(warm_s / max(res["monolithic_work_s"], 1e-9), 3)
    res["warm_stages"] = {s: {"wall_s": round(warm_by[s].seconds, 2), **warm_by[s].manifest["timings"]}
                          for s in iter_stages}
    for s in iter_stages + ["monolithic"]:
        r = mono if s == "monolithic" else by[s]
        t = r.manifest["timings"]
        res["stages"][s] = {"wall_s": round(r.seconds, 2), **{k: v for k, v in t.items() if isinstance(v, (int, float))}}
    up = res["stages"]["update"]
    if up.get("save_s"):
        res["dcp_save_gb_per_s"] = round(ckpt_gb / up["save_s"], 2)
    res["sha256_gb_per_s"] = _hash_rate(policy_dir)

    say(json.dumps(res, indent=1))
    rows = [("one iteration, staged (3 jobs)", f"{staged_s:.1f} s"),
            ("same iteration, monolithic job", f"{mono.seconds:.1f} s"),
            ("  of which the iteration's work", f"{res['monolithic_work_s']:.1f} s"),
            ("ratio staged / monolithic job", f"{res['ratio_vs_job']:.3f}x"),
            ("ratio staged / monolithic work", f"{res['ratio_vs_work']:.3f}x"),
            ("one iteration, staged in a warm pool", f"{warm_s:.1f} s"),
            ("ratio warm staged / monolithic job", f"{res['warm_ratio_vs_job']:.3f}x"),
            ("ratio warm staged / monolithic work", f"{res['warm_ratio_vs_work']:.3f}x"),
            ("policy checkpoint (params + Adam)", f"{ckpt_gb:.2f} GB"),
            ("DCP save", f"{res.get('dcp_save_gb_per_s', '-')} GB/s"),
            ("sha256", f"{res['sha256_gb_per_s']} GB/s")]
    for s in iter_stages:
        st = res["stages"][s]
        rows.append((f"{s}: wall / launch->main / stage", f"{st['wall_s']:.1f} / {st.get('launch_to_worker_s', 0):.1f} / "
                     f"{st.get('stage_s', 0):.1f} s; " + ", ".join(f"{k} {v:.1f}" for k, v in st.items()
                                                            if k.endswith("_s") and k not in
                                                            ("wall_s", "launch_to_worker_s", "stage_s"))))
    print("| measure | value |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


def _hash_rate(folder: Path) -> float:
    from core.store import file_digest

    files = [f for f in folder.rglob("*") if f.is_file()]
    t = time.perf_counter()
    for f in files:
        file_digest(f)
    return round(sum(f.stat().st_size for f in files) / 1e9 / (time.perf_counter() - t), 2)


if __name__ == "__main__":
    sys.exit(main())
