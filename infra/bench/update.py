"""Update benchmark: the update stage's own code (verlflow.core.ml.model.wrap_fsdp, verlflow.core.ml.ppo.score_all and verlflow.core.ml.ppo.train with
verl's losses) under several blueprint settings, against the issue's baseline (FSDP2, activation checkpointing,
padded micro-batches of 8, no compile), in one process, at the same shape, with random weights.

    python infra/bench/update.py                                   # one GPU, Qwen2.5-1.5B shape
    torchrun --nproc_per_node 2 infra/bench/update.py --configs baseline,best   # scaling (same per-GPU batch)
    python infra/bench/update.py --shape 7b --configs best_ac
    python infra/bench/update.py --smoke                           # CPU-sized run (the test suite runs this)

Model FLOPs of a sample with L real tokens, R of them response tokens (no FLOP counted for padding, nor for
recomputation under activation checkpointing, so this is MFU, not hardware utilisation):
    train  6 * (non-embedding params * L + vocab * hidden * R) + 6 * layers * hidden * L^2   (causal attention)
    score  a third of that (forward only)
MFU = FLOPs / seconds / (--peak-tflops per GPU, default 790: bf16 matmul measured on an H200 here).
The batch is ragged like a real GRPO batch (prompts 64..128, responses 128..896 tokens: seq <= 1024) unless
--full, where every sample is 128 + 896 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SHAPES  # noqa: E402  (one table of model shapes for both benchmarks)

from verlflow.core.blueprint import load_blueprint  # noqa: E402
from verlflow.core.ml import compiletime, model as M, ppo  # noqa: E402
from verlflow.core.ml.optim import make_optimizer  # noqa: E402
from verlflow.core.ml.placement import Placement  # noqa: E402
from verlflow.core.stages.update import ppo_spec  # noqa: E402

BASE = {"model.dtype": "float32", "fsdp.mixed_precision": "bf16", "fsdp.reduce_dtype": "fp32",
        "fsdp.version": 2, "fsdp.activation_checkpointing": True, "algorithm.ppo_micro_batch_size_per_gpu": 8,
        "algorithm.use_kl_loss": True, "algorithm.entropy_coeff": 0.0, "rollout.n": 8, "rollout.temperature": 1.0,
        "model.attn_implementation": "sdpa"}
CONFIGS = {  # name -> blueprint overrides on top of BASE (the baseline is BASE itself)
    "baseline": {},
    "fsdp1": {"fsdp.version": 1},
    "no_ac": {"fsdp.activation_checkpointing": False},
    "packed": {"algorithm.use_remove_padding": True},
    "compile": {"fsdp.compile": True},
    "packed_no_ac": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False},
    "best": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False, "fsdp.compile": True},
    "best_16k": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False, "fsdp.compile": True,
                 "algorithm.ppo_max_token_len_per_gpu": 16384},
    "best_32k": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False, "fsdp.compile": True,
                 "algorithm.ppo_max_token_len_per_gpu": 32768},
    "fused_16k": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False, "fsdp.compile": True,
                  "algorithm.ppo_max_token_len_per_gpu": 16384, "algorithm.use_fused_kernels": True},
    "fused_32k": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False, "fsdp.compile": True,
                  "algorithm.ppo_max_token_len_per_gpu": 32768, "algorithm.use_fused_kernels": True},
    "fused_32k_keep": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False,
                       "fsdp.compile": True, "algorithm.ppo_max_token_len_per_gpu": 32768,
                       "algorithm.use_fused_kernels": True, "fsdp.reshard_after_forward": False},
    "fused_32k_foreach": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False,
                          "fsdp.compile": True, "algorithm.ppo_max_token_len_per_gpu": 32768,
                          "algorithm.use_fused_kernels": True, "_foreach_adamw": True},  # the optimizer's share
    "fused_32k_keep_triton": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False,
                              "fsdp.compile": True, "algorithm.ppo_max_token_len_per_gpu": 32768,
                              "algorithm.use_fused_kernels": True, "fsdp.reshard_after_forward": False,
                              "algorithm.fused_kernels_backend": "triton"},  # the GPU blueprint's settings
    "best_defer": {"algorithm.use_remove_padding": True, "fsdp.activation_checkpointing": False, "fsdp.compile": True,
                   "fsdp.defer_grad_sync": True},
    "best_ac": {"algorithm.use_remove_padding": True, "fsdp.compile": True},
}
# model.lora on the fastest full fine-tune settings: fp32 base like it, and a bf16 base (what LoRA users run)
LORA = {"model.lora": {"rank": 16, "alpha": 32}}
CONFIGS["lora_fused_32k"] = {**CONFIGS["fused_32k"], **LORA}
CONFIGS["lora_bf16_fused_32k"] = {**CONFIGS["fused_32k"], **LORA, "model.dtype": "bfloat16"}
CONFIGS["lora"] = {**LORA}
T0 = time.perf_counter()


def say(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def init_dist(device_type: str) -> Placement:
    if "RANK" not in os.environ:  # a plain `python` run: a one-process group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)  # what the stages use (Resources.dist_backend)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return Placement(rank, world, dev)


def model_dir(shape: str, root: Path) -> Path:
    """An HF folder with only config.json: build_module makes random weights from it."""
    from transformers import Qwen2Config

    v = SHAPES[shape]["vocab_size"]
    folder = root / shape
    Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
                eos_token_id=v - 1, pad_token_id=v - 2, bos_token_id=v - 3).save_pretrained(folder)
    return folder


def make_batch(n: int, P: int, R: int, vocab: int, full: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    plen = torch.full((n,), P) if full else torch.randint(P // 2, P + 1, (n,), generator=g)
    rlen = torch.full((n,), R) if full else torch.randint(max(1, R // 7), R + 1, (n,), generator=g)
    pm = (torch.arange(P)[None] >= P - plen[:, None]).long()
    rm = (torch.arange(R)[None] < rlen[:, None]).long()
    return {"prompts": torch.randint(10, vocab - 10, (n, P), generator=g) * pm,
            "responses": torch.randint(10, vocab - 10, (n, R), generator=g) * rm,
            "prompt_mask": pm, "response_mask": rm, "scores": torch.rand(n, generator=g), "group": None}


def flops(cfg, batch: dict) -> tuple[float, float]:
    """(train, score) model FLOPs of the whole batch; see the module docstring."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size  # q, o, k, v, mlp (biases ignored)
    L = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).double()
    R = batch["response_mask"].sum(1).double()
    train = float((6 * (layers * per_layer * L + vocab * h * R) + 6 * layers * h * L * L).sum())
    return train, train / 3


def run_config(name: str, args, mdir: Path, at: Placement) -> dict:
    rank, world, dev = at.rank, at.world, at.device
    over = {**BASE, **CONFIGS[name]}
    foreach = over.pop("_foreach_adamw", False)
    over = {**over, "model.path": str(mdir), "data.train_files": [str(mdir / "none.parquet")],
            "storage.uri": str(mdir / "store"), "resources.nproc_per_node": world,
            "resources.device": "cuda" if dev.type == "cuda" else "cpu",
            "algorithm.ppo_mini_batch_size": args.samples_per_gpu * world // 8,
            "data.batch_size": args.samples_per_gpu * world // 8, "algorithm.lr": 1e-6}
    if args.smoke:
        over.update({"model.dtype": "float32", "fsdp.mixed_precision": "fp32", "algorithm.ppo_micro_batch_size_per_gpu": 2})
        if not os.environ.get("VERLFLOW_BENCH_CPU_COMPILE"):  # inductor on 2 CPU cores is slow; the GPU run measures it
            over.pop("fsdp.compile", None)
    bp = load_blueprint(None, [f"{k}={json.dumps(v) if isinstance(v, (list, bool, dict)) else v}"
                               for k, v in over.items()])
    torch._dynamo.reset()
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    with torch.device(dev):
        module = M.build_module(mdir, bp.model, packed=bp.algorithm.use_remove_padding, adapters=True)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)  # model.lora: the adapters
    model, rep = M.wrap_fsdp(module, bp.fsdp, dev, bp.algorithm.fused_head)
    # The stages' optimizer (fused AdamW on CUDA), or the for-each implementation the previous session measured.
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True) if foreach
           else make_optimizer(model, bp.algorithm.optim))
    setup_s = time.perf_counter() - t
    cfg = M.unwrap_config(model)
    n = args.samples_per_gpu * world
    out = {"config": name, "world": world, "setup_s": round(setup_s, 1),
           "trainable_params": trainable}

    def one(seed: int, steps: int) -> tuple[float, float, dict]:
        batch = make_batch(n * steps, args.prompt, args.response, cfg.vocab_size, args.full, seed)
        batch["group"] = torch.arange(n * steps) // bp.rollout.n
        sync(dev)
        t0 = time.perf_counter()
        old = ppo.score_all(model, batch, ppo_spec(bp), at)
        sync(dev)
        t1 = time.perf_counter()
        data, _ = ppo.prepare(bp.algorithm, batch, old, old, iteration=seed)
        ppo.train(ppo_spec(bp), ppo.Models(ppo.Trainee(model, opt)), data, at)
        sync(dev)
        return t1 - t0, time.perf_counter() - t1, batch

    t = time.perf_counter()
    compiles = compiletime.Meter()
    for w in range(args.warmup):
        one(100 + w, 1)
    out["warmup_s"] = round(time.perf_counter() - t, 1)
    count, seconds, parts = compiles.read()  # what the first steps spent compiling (fsdp.compile), and where
    out.update(compiles=count, compile_s=round(seconds, 2), compile_parts=parts)
    score_s, train_s, batch = one(1, args.steps)
    f_train, f_score = flops(cfg, batch)
    peak = args.peak_tflops * 1e12 * world
    real = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    out.update(train_flops_per_s_per_gpu=f_train / train_s / world, train_s_per_step=round(train_s / args.steps, 4),
               floor_s_per_step=round(f_train / peak / args.steps, 4),  # every FLOP at the peak rate
               score_s_per_step=round(score_s / args.steps, 4),
               train_mfu=round(f_train / train_s / peak, 4), score_mfu=round(f_score / score_s / peak, 4),
               tokens_per_s_per_gpu=round(real / train_s / world), real_tokens=real, samples=len(batch["responses"]),
               padded_tokens=int(batch["prompts"].numel() + batch["responses"].numel()))
    if dev.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    if args.profile and rank == 0:
        out["gpu_busy"] = profile_step(lambda: one(7, 1), dev)
    elif args.profile:
        one(7, 1)
    del model, opt, module
    return out


def profile_step(fn, dev) -> float:
    """One step under the profiler: prints the top kernels and returns kernel time / wall time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
    wall = time.perf_counter() - t
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    ev = prof.key_averages()
    print(ev.table(sort_by=key, row_limit=22, max_name_column_width=60), flush=True)
    busy = sum(getattr(e, key) for e in ev if dev.type != "cuda" or e.device_type.name == "CUDA") / 1e6
    return round(busy / wall, 3) if dev.type == "cuda" else 0.0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def table(rows: list[dict], base: dict | None) -> str:
    lines = ["| config | world | train MFU | ratio vs baseline | train s/step | floor s/step | score MFU | tok/s/GPU "
             "| peak GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['world']} | {r['error']} | | | | | | |")
            continue
        ratio = f"{r['train_flops_per_s_per_gpu'] / base['train_flops_per_s_per_gpu']:.2f}x" if base else "-"
        lines.append(f"| {r['config']} | {r['world']} | {r['train_mfu']:.1%} | {ratio} | {r['train_s_per_step']:.3f} | "
                     f"{r['floor_s_per_step']:.3f} | {r['score_mfu']:.1%} | {r['tokens_per_s_per_gpu']:,} | "
                     f"{r.get('peak_mem_gib', '-')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--configs", default="baseline,fsdp1,no_ac,packed,compile,packed_no_ac,best,best_16k")
    ap.add_argument("--samples-per-gpu", type=int, default=32, help="samples per optimizer step per GPU")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=896)
    ap.add_argument("--full", action="store_true", help="every sample prompt + response long (no padding)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one more step per config")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, a few steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.samples_per_gpu, args.prompt, args.response, args.steps, args.warmup = "tiny", 8, 16, 24, 1, 1
        if args.configs == ap.get_default("configs"):
            args.configs = "baseline,fsdp1,packed,packed_no_ac"
    dev_type = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    at = init_dist(dev_type)
    rank, world, dev = at.rank, at.world, at.device
    import tempfile

    where = [tempfile.mkdtemp(prefix="verlflow-bench-") if rank == 0 else None]
    dist.broadcast_object_list(where)
    mdir = Path(where[0]) / args.shape
    if rank == 0:
        model_dir(args.shape, Path(where[0]))
    dist.barrier()
    say(f"shape {args.shape}, world {world}, {args.samples_per_gpu} samples/GPU/step, prompt {args.prompt}, "
        f"response {args.response}, {'full' if args.full else 'ragged'}, device {dev}")
    rows = []
    for name in args.configs.split(","):
        try:
            rows.append(run_config(name, args, mdir, at))
        except Exception as e:  # one config's failure (OOM, say) must not lose the others
            kind = "OOM" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            rows.append({"config": name, "world": world, "error": f"{kind}: {str(e).splitlines()[0][:120]}"})
            if rank == 0:
                traceback.print_exc()
            if args.smoke:
                raise
        say(json.dumps(rows[-1]))
        if args.json and rank == 0:
            args.json.write_text(json.dumps({"shape": args.shape, "args": {k: str(v) for k, v in vars(args).items()},
                                             "rows": rows}, indent=1))
    base = next((r for r in rows if r["config"] == "baseline" and "train_mfu" in r), None)
    if rank == 0:
        print(table(rows, base), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
