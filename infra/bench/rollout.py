"""Rollout benchmark: HF ``generate`` (dynamic cache) against ``verlflow.core.ml.fastgen`` (rollout.engine=static), in one
process, at the same shape, with random weights (nothing is downloaded).

    python infra/bench/rollout.py                         # GPU: Qwen2.5-1.5B shape, batch 256, prompt 128, 256 new
    python infra/bench/rollout.py --shape 0.5b --shape 7b
    python infra/bench/rollout.py --smoke                 # CPU-sized run (the test suite runs this)

Prints, per shape, a table: measure | baseline | ours | ratio | floor. The floor of a decode step is the
memory-bound one: bytes of weights read per step (everything but the embedding table) plus the KV cache bytes
of the valid positions, over the HBM bandwidth (--hbm-tbs, 4.8 TB/s for an H200). The compute floor
(2 x weights x batch + attention FLOPs over --peak-tflops) is printed beside it. ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verlflow.core.ml.fastgen import EngineOptions, FastGen, Fp8Choices, SamplingConfig  # noqa: E402

SHAPES = {  # Qwen2.5 shapes (Qwen2Config); "tiny" is the CPU smoke
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=384, tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    # Qwen3 dense (Qwen3Config: per-head q/k RMSNorm, head_dim 128)
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    # the other families the engine serves, at their public models' shapes (the issue's "per family")
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                        rope_theta=500000.0),
    "mistral-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=32768, tie_word_embeddings=False, sliding_window=None),
    "phi3-mini": dict(hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=8192, vocab_size=32064, tie_word_embeddings=False, sliding_window=2047),
    "gemma2-2b": dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True,
                      query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0),
    "gemma3-1b": dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=256, intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True,
                      query_pre_attn_scalar=256, sliding_window=512,
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
    "olmo2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                     intermediate_size=8192, vocab_size=100352, tie_word_embeddings=False, rope_theta=500000.0),
}
# the config class of each shape's family (Qwen2 where unnamed); Gemma-2 runs HF's eager attention, which applies
# its attention soft-cap (HF's sdpa path drops it)
FAMILY_OF = {"qwen3": ("Qwen3Config", "sdpa"), "llama": ("LlamaConfig", "sdpa"), "mistral": ("MistralConfig", "sdpa"),
             "phi3": ("Phi3Config", "sdpa"), "gemma2": ("Gemma2Config", "eager"), "gemma3": ("Gemma3TextConfig", "sdpa"),
             "olmo2": ("Olmo2Config", "sdpa")}

T_START = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - T_START:7.1f}s]", *a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def model_config(shape: str):
    """The shape's HF config (random prompts never contain its EOS, pad or BOS ids) and attention implementation."""
    import transformers

    config_name, attn = next((v for k, v in FAMILY_OF.items() if shape.startswith(k)), ("Qwen2Config", "sdpa"))
    v = SHAPES[shape]["vocab_size"]
    extra = dict(use_sliding_window=False) if config_name in ("Qwen2Config", "Qwen3Config") else {}
    cfg = getattr(transformers, config_name)(**{**dict(rms_norm_eps=1e-6, **extra), **SHAPES[shape]},
                                             max_position_embeddings=32768, eos_token_id=v - 1, pad_token_id=v - 2,
                                             bos_token_id=v - 3)
    return cfg, attn


def build_model(shape: str, dtype: torch.dtype, dev: torch.device):
    from transformers import AutoModelForCausalLM

    cfg, attn = model_config(shape)
    eos, pad = cfg.eos_token_id, cfg.pad_token_id
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    finally:
        torch.set_default_dtype(old)
    model.to(dtype).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    return model, eos, pad


def make_prompts(batch: int, plen: int, vocab: int, ragged: bool, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 10, (batch, plen), generator=g)
    mask = torch.ones(batch, plen, dtype=torch.long)
    if ragged:  # lengths in [plen/2, plen], left-padded
        lens = torch.randint(plen // 2, plen + 1, (batch,), generator=g)
        for i, n in enumerate(lens.tolist()):
            mask[i, :plen - n] = 0
    return ids.to(dev), mask.to(dev)


def n_tokens(resp: torch.Tensor, eos: int, pad: int) -> int:
    """Generated tokens: up to and including each row's first EOS."""
    is_eos = resp == eos
    has = is_eos.any(1)
    first = torch.where(has, is_eos.float().argmax(1) + 1, torch.full_like(has, resp.shape[1], dtype=torch.long))
    return int(first.sum())


def floors(model, batch: int, lens: torch.Tensor, new: int, hbm_tbs: float, peak_tflops: float) -> dict:
    """Per decode step: memory-bound floor (weights + valid KV bytes) and compute floor, in ms."""
    c = model.config
    el = next(model.parameters()).element_size()
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if c.tie_word_embeddings:
        params += model.lm_head.weight.numel()  # tied: read once per step as the head
    w_bytes = params * el
    per_pos = c.num_hidden_layers * 2 * c.num_key_value_heads * hd * el
    avg_len = float(lens.float().mean()) + (new - 1) / 2 + 1  # mean attended length over the decode steps
    kv_bytes = batch * avg_len * per_pos
    mem_ms = (w_bytes + kv_bytes) / (hbm_tbs * 1e12) * 1e3
    flops = 2 * params * batch + 4 * batch * c.num_hidden_layers * c.num_attention_heads * hd * avg_len
    comp_ms = flops / (peak_tflops * 1e12) * 1e3
    return {"weight_gb": w_bytes / 1e9, "kv_gb_avg": kv_bytes / 1e9, "mem_floor_ms": mem_ms,
            "compute_floor_ms": comp_ms, "gflop_per_step": flops / 1e9}


def run_hf(model, ids, mask, new, cfg: SamplingConfig, eos, pad, dev, seed=0, static=False):
    """HF ``generate``: its dynamic cache, or (``static``) its static cache, with which transformers compiles the
    decode forward itself (CUDA)."""
    kw = dict(max_new_tokens=new, pad_token_id=pad, eos_token_id=eos, use_cache=True)
    if static:
        kw["cache_implementation"] = "static"
    if cfg.greedy:
        kw.update(do_sample=False)
    else:
        kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    with torch.no_grad():
        sync(dev)
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1)  # prefill alone, to split the time
        sync(dev)
        t_pre = time.perf_counter() - t0
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        sync(dev)
        dt = time.perf_counter() - t0
    resp = out[:, ids.shape[1]:]
    steps = resp.shape[1]
    return resp, {"total_s": dt, "prefill_s": t_pre, "steps": steps, "tokens": n_tokens(resp, eos, pad),
                  "ms_per_step": 1e3 * max(dt - t_pre, 0) / max(steps - 1, 1)}


def run_ours(eng: FastGen, ids, mask, cfg, eos, pad, dev, seed=0, repeats=2):
    """First call compiles and captures (setup); the timed call is the last one."""
    setup = 0.0
    for _ in range(repeats):
        torch.manual_seed(seed)
        sync(dev)
        t0 = time.perf_counter()
        resp = eng.generate(ids, mask, cfg, [eos], pad)
        sync(dev)
        dt = time.perf_counter() - t0
        setup += eng.last_stats["setup_s"]
    st = dict(eng.last_stats)
    total = dt - st["setup_s"]
    return resp, {"total_s": total, "prefill_s": st["prefill_s"], "steps": st["steps"],
                  "tokens": n_tokens(resp, eos, pad), "ms_per_step": st["decode_ms_per_step"], "setup_s": setup}


def scored_rows(model, ids, mask, resp, eos: int, rows: int):
    """HF's forward over prompt + response, row by row (teacher forcing): per row the response's fp32 logits (n, V),
    its tokens, and which of them count (up to and with the first EOS)."""
    ids, mask, resp = ids[:rows], mask[:rows], resp[:rows].to(ids.device)
    P, n = ids.shape[1], resp.shape[1]
    is_eos = resp == eos
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(resp[:, 0], n - 1))
    valid = torch.arange(n, device=ids.device)[None] <= first[:, None]
    for r in range(ids.shape[0]):
        full = torch.cat([ids[r:r + 1], resp[r:r + 1]], 1)
        fm = torch.cat([mask[r:r + 1], valid[r:r + 1].long()], 1)
        yield model(input_ids=full, attention_mask=fm).logits[0, P - 1:P - 1 + n].float(), resp[r], valid[r]


@torch.no_grad()
def teacher_forced(model, ids, mask, resp, eos: int, cfg: SamplingConfig, rows: int = 16) -> dict:
    """Score generated tokens under HF's full forward over prompt + response (teacher forcing)."""
    temp = cfg.temperature if cfg.temperature > 0 else 1.0
    gaps, exact, in_nuc, logps = [], [], [], []
    for lg, tok, v in scored_rows(model, ids, mask, resp, eos, rows):
        tl_ = lg.gather(1, tok[:, None]).squeeze(1)
        gap = lg.max(1).values - tl_
        x = lg / temp
        p = x.softmax(-1)
        mass_le = (p * (x <= (tl_ / temp)[:, None])).sum(-1)
        gaps.append(gap[v])
        exact.append((gap[v] == 0).float())
        in_nuc.append((mass_le[v] > 1 - cfg.top_p - 1e-3).float())
        logps.append(torch.log_softmax(x, -1).gather(1, tok[:, None]).squeeze(1)[v])
    gaps, exact, in_nuc, logps = (torch.cat(t) for t in (gaps, exact, in_nuc, logps))
    return {"tokens": int(gaps.numel()), "argmax_exact": float(exact.mean()), "mean_gap_to_max": float(gaps.mean()),
            "gap_le_1_16": float((gaps <= 0.0625).float().mean()), "in_nucleus": float(in_nuc.mean()),
            "mean_logp": float(logps.mean()), "logp_se": float(logps.std() / max(1, logps.numel()) ** 0.5)}


@torch.no_grad()
def policy_gap(model, ids, mask, resp, logp, eos: int, cfg: SamplingConfig, rows: int = 16) -> dict:
    """How far the engine's sampling policy (its recorded log-probs ``logp`` of its tokens ``resp``: the fp8 model's
    with rollout.weights=fp8) is from the model's own, scored under HF's forward over prompt + response: what
    algorithm.rollout_correction sees. r = log p_model - log p_engine per token: KL(engine || model) ~ mean(-r) (k1)
    and mean(exp(r) - 1 - r) (k3), and the token-level importance weights exp(r) (mean, max, share above 2)."""
    logp, temp = logp.to(ids.device), cfg.temperature if cfg.temperature > 0 else 1.0
    rs = [(torch.log_softmax(lg / temp, -1).gather(1, tok[:, None]).squeeze(1) - logp[i].float())[v]
          for i, (lg, tok, v) in enumerate(scored_rows(model, ids, mask, resp, eos, rows))]
    r = torch.cat(rs)
    w = r.exp()
    return {"tokens": int(r.numel()), "k1": float(-r.mean()), "k3": float((w - 1 - r).mean()),
            "is_mean": float(w.mean()), "is_max": float(w.max()), "is_above_2": float((w > 2).float().mean()),
            "abs_logp_diff": float(r.abs().mean())}


def prefix_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    n = min(a.shape[1], b.shape[1])
    eq = (a[:, :n] == b[:, :n]).long()
    common = eq.cumprod(1).sum(1).float()
    return {"first_token": float(eq[:, 0].float().mean()), "mean_common_prefix": float(common.mean()),
            "rows_identical": float((common == n).float().mean()), "compared": n}


# ------------------------------------------------------------------------------------------ micro-benches


def bench_cuda(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def bench_graph(fn, reps=10) -> float:
    """ms per call of fn replayed from a CUDA graph of ``reps`` calls, as the decode step runs it (timed eagerly,
    a Triton kernel's Python launch, ~50 us, hides its GPU time)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile off the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return bench_cuda(g.replay, iters=5, warm=2) / reps


FP8 = {"weights": "fp8"}
FP8_VARIANTS = {  # --ab-fp8: the engine's options changed for each
    "fp8": FP8, "fp8_fast_accum": {**FP8, "fp8": Fp8Choices(fast_accum=True)},
    "fp8_autotuned": {**FP8, "fp8": Fp8Choices(gemm="autotune")},
    "fp8_rowwise": {**FP8, "fp8": Fp8Choices(gemm="rowwise")},
    "kv8": {"kv_cache": "fp8"}, "fp8_kv8": {**FP8, "kv_cache": "fp8"}}


def _fp8_variants(raw: str) -> str:
    unknown = [v for v in raw.split(",") if v not in FP8_VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(FP8_VARIANTS)}")
    return raw


def _json_object(raw: str) -> str:
    try:
        ok = isinstance(json.loads(raw), dict)
    except json.JSONDecodeError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"not a JSON object: {raw!r}")
    return raw


def micro_attention(B, nh, nkv, hd, T, dtype, dev) -> dict:
    import torch.nn.functional as F

    q = torch.randn(B, nh, 1, hd, dtype=dtype, device=dev)
    K = torch.randn(B, nkv, T, hd, dtype=dtype, device=dev)
    V = torch.randn_like(K)
    bias = torch.zeros(B, T, device=dev)
    bias[:, T - 64:] = float("-inf")
    sc = hd ** -0.5

    def grouped():
        s = torch.matmul(q.view(B, nkv, nh // nkv, hd), K.transpose(-1, -2)) * sc
        p = (s.float() + bias[:, None, None]).softmax(-1).to(dtype)
        return torch.matmul(p, V)

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q, K, V, attn_mask=bias[:, None, None].to(dtype), scale=sc,
                                              enable_gqa=True)

    def expanded():  # what HF's sdpa path does with a static cache
        g = nh // nkv
        return F.scaled_dot_product_attention(q, K.repeat_interleave(g, 1), V.repeat_interleave(g, 1),
                                              attn_mask=bias[:, None, None].to(dtype), scale=sc)

    def read_kv():  # the same bytes read by torch's reduction: what a kernel that only reads them reaches here
        return K.sum(dtype=torch.float32) + V.sum(dtype=torch.float32)

    kv_gb = 2 * K.numel() * K.element_size() / 1e9
    out = {"shape": f"B={B} heads={nh}/{nkv} T={T} hd={hd}", "kv_gb": kv_gb}
    for name, fn in (("grouped_bmm", grouped), ("grouped_bmm_compiled", torch.compile(grouped)),
                     ("sdpa_enable_gqa", sdpa_gqa), ("expand_then_sdpa", expanded), ("read_kv_only", read_kv)):
        try:
            ms = bench_cuda(fn)
            out[name] = {"us": ms * 1e3, "tbs": kv_gb / ms}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def micro_sampler(B, V, dtype, dev, prof_path: Path | None = None) -> dict:
    from verlflow.core.ml.fastgen import sample_logits

    logits = (torch.randn(B, V, device=dev) * 0.8).to(dtype)
    out = {}
    cases = {"greedy": SamplingConfig(0.0), "temp1": SamplingConfig(1.0),
             "top_p0.95": SamplingConfig(1.0, 0.95), "top_k50_top_p0.95": SamplingConfig(1.0, 0.95, 50)}
    for name, cfg in cases.items():
        for mode, fn in (("eager", sample_logits), ("compiled", torch.compile(sample_logits, dynamic=False))):
            try:
                out[f"{name}/{mode}"] = bench_cuda(lambda: fn(logits, cfg), iters=10) * 1e3
            except Exception as e:  # noqa: BLE001
                out[f"{name}/{mode}"] = f"{type(e).__name__}: {e}"[:200]

    def hf_sort():  # HF's TopPLogitsWarper + multinomial
        x = logits.float()
        sl, si = torch.sort(x, descending=False)
        cp = sl.softmax(-1).cumsum(-1)
        rm = (cp <= 0.05).scatter(1, si, cp <= 0.05)
        return torch.multinomial(x.masked_fill(rm, float("-inf")).softmax(-1), 1)

    out["top_p0.95/hf_sort+multinomial"] = bench_cuda(hf_sort, iters=10) * 1e3
    from verlflow.core.ml.fastgen.kernels import HAVE_TRITON, sample_logits_triton

    if HAVE_TRITON:  # the engine's sampler, graph-replayed: the nucleus test in two passes against one
        cfg = cases["top_p0.95"]
        u = torch.rand(B, cfg.candidates(), 2, device=dev)
        for mode in ("two_pass", "one_pass"):
            try:
                out[f"top_p0.95/triton_{mode}_graph"] = bench_graph(
                    lambda two=mode == "two_pass": sample_logits_triton(logits, cfg, u, two_pass=two)) * 1e3
            except Exception as e:  # noqa: BLE001
                out[f"top_p0.95/triton_{mode}_graph"] = f"{type(e).__name__}: {e}"[:200]
    if prof_path is not None:  # kernels of the compiled top_p sampler
        from torch.profiler import ProfilerActivity, profile

        fn = torch.compile(sample_logits, dynamic=False)
        cfg = cases["top_p0.95"]
        fn(logits, cfg)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(logits, cfg)
            torch.cuda.synchronize()
        prof_path.write_text(prof.key_averages().table(sort_by=_sort_key(prof), row_limit=20,
                                                       max_name_column_width=100))
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in out.items()}  # microseconds


def _sort_key(prof) -> str:
    ev = prof.key_averages()
    return "self_device_time_total" if ev and hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"


def profile_step(eng: FastGen, ids, mask, cfg, eos, pad, path: Path, graphs: bool) -> str:
    """torch.profiler over 5 decode steps; the kernel table sorted by device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    eng.generate(ids, mask, cfg, [eos], pad)  # fills the cache; then rewind the state to decode step 60
    P = ids.shape[1]
    kv = eng._kv_len(P + 64)
    eng.slot.fill_(P + 60)
    eng.col.fill_(60)
    eng.pos.fill_(P + 60)
    eng.unfinished.fill_(True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            if graphs:
                eng._graph(kv, cfg).replay()
            else:
                eng._step(kv, cfg)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by=_sort_key(prof), row_limit=25, max_name_column_width=90)
    if not graphs:  # a replayed graph has no CPU ops to name; step by step, who launched the device copies
        table += "\n\ndevice copies, by the ops that launched them (op <- its callers), count over 5 steps:\n"
        table += "\n".join(f"{n:6d}  {chain}" for chain, n in launch_sources(prof, "Memcpy").items())
    path.write_text(table)
    return table


def launch_sources(prof, prefix: str) -> dict[str, int]:
    """The CPU ops under which the device kernels named ``prefix``* were launched, with up to 4 of their callers."""
    out: dict[str, int] = {}
    for e in prof.events():
        if not any(k.name.startswith(prefix) for k in e.kernels):
            continue
        chain, p = [e.name], e.cpu_parent
        while p is not None and len(chain) < 5:
            chain.append(p.name)
            p = p.cpu_parent
        key = " <- ".join(chain)
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------------- main


def fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if abs(v) >= 1000:
        return f"{v:,.0f}{unit}"
    if abs(v) >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.3g}{unit}"


def table(rows: list[tuple]) -> str:
    head = ("measure", "baseline (HF generate)", "ours (fastgen)", "ratio", "floor")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(x) if not isinstance(x, str) else x for x in r) + " |")
    return "\n".join(lines)


def run_shape(args, shape: str, dev: torch.device, dtype: torch.dtype, res: dict, out_dir: Path | None):
    cuda = dev.type == "cuda"
    B, P, N = args.batch, args.prompt, args.new
    say(f"== shape {shape}: batch {B}, prompt {P}, new {N}, {dtype}, {dev}")
    model, eos, pad = build_model(shape, dtype, dev)
    ids, mask = make_prompts(B, P, model.config.vocab_size, args.ragged, dev)
    fl = floors(model, B, mask.sum(1).cpu(), N, args.hbm_tbs, args.peak_tflops)
    r = res.setdefault(shape, {"config": {"batch": B, "prompt": P, "new": N, "dtype": str(dtype)}, "floor": fl})
    say("floor", json.dumps(fl))
    scfg = SamplingConfig(args.temperature, args.top_p, args.top_k)
    gcfg = SamplingConfig(0.0)

    def dump():
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))

    def attempt(name, fn):
        if args.budget_s and time.perf_counter() - T_START > args.budget_s:
            say(f"skip {name}: over --budget-s")
            r[name] = {"skipped": "budget"}
            return None
        try:
            t0 = time.perf_counter()
            v = fn()
            say(f"{name} done in {time.perf_counter() - t0:.1f}s:", json.dumps(v[1] if isinstance(v, tuple) else v, default=str)[:600])
            r[name] = v[1] if isinstance(v, tuple) else v
            return v
        except Exception as e:  # noqa: BLE001
            say(f"{name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            r[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            return None
        finally:
            dump()

    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if cuda and not args.no_micro:
        attempt("micro_attention", lambda: micro_attention(B, c.num_attention_heads, c.num_key_value_heads, hd,
                                                           P + N, dtype, dev))
        attempt("micro_sampler_us", lambda: micro_sampler(B, c.vocab_size, dtype, dev,
                                                          out_dir / f"profile_{shape}_sampler.txt" if out_dir else None))

    # ours, main variant: graphs + compile (on CUDA), attention and sampler as the engine picks them
    eng = FastGen(model, B, P, N, EngineOptions(attn=args.attn, sampler=args.sampler))
    ours_s = attempt("ours_sampled", lambda: run_ours(eng, ids, mask, scfg, eos, pad, dev))
    ours_g = attempt("ours_greedy", lambda: run_ours(eng, ids, mask, gcfg, eos, pad, dev))

    def same_engine(**changes) -> FastGen:
        """The main engine with ``changes`` to its options, running its attention with its configuration unless
        ``changes`` name another attention or "auto" (timed again)."""
        e = FastGen(model, B, P, N, dataclasses.replace(eng.options, **{"attn": eng.attn, "sampler": eng.sampler,
                                                                        **changes}))
        if e.attn == eng.attn and changes.get("attn") != "auto":
            e.attn_cfg = dict(eng.attn_cfg)
        return e

    def ab(name: str, **changes):
        """ours_{name}_sampled: the main engine with ``changes``, timed in this process (its cache and graphs go
        when this returns, before the next variant's come)."""
        e = same_engine(**changes)
        return attempt(f"ours_{name}_sampled", lambda: run_ours(e, ids, mask, scfg, eos, pad, dev))

    if cuda and args.ab_static_buckets:  # a decode graph per cache bucket (lengths static)
        ab("static_buckets", bucket_compile="static")
    if args.ab_attn and eng.attn != "sdpa":  # sdpa (cuDNN): the choice it replaced
        ab("sdpa_attention", attn="sdpa")
    elif args.ab_attn and eng.attn_timings:  # timing kept sdpa: its fastest Triton configuration in the step itself
        # (the timing charges each +4 us for the split merge, which the compiled step fuses: is that charge right?)
        timed = [k for k in eng.attn_timings if k.startswith("triton")]
        if timed:
            cfg = dict(FastGen._ATTN_CONFIGS[int(min(timed, key=eng.attn_timings.get)[6:])])
            r["ours_triton_attention_cfg"] = cfg
            eng_tr = same_engine(attn="triton")
            eng_tr.attn_cfg = cfg
            attempt("ours_triton_attention_sampled", lambda: run_ours(eng_tr, ids, mask, scfg, eos, pad, dev))
            del eng_tr
    for i, raw in enumerate(args.ab_inductor or []):  # other inductor options
        r[f"ours_inductor{i}_options"] = raw
        ab(f"inductor{i}", inductor=json.loads(raw))
    if cuda and args.ab_nucleus and eng.sampler == "triton":  # the one-pass nucleus test
        ab("one_pass_nucleus", nucleus="one_pass")
    if args.ab_fp8 or args.smoke:  # the same engine with fp8 projections, and how far its policy is from the model's
        # The gap is what algorithm.rollout_correction sees: untruncated sampling (it refuses top_p / top_k), a
        # generation of its own; the speed is at the run's sampling settings.
        ucfg = SamplingConfig(args.temperature, 1.0, 0)

        def gap_of(e):
            torch.manual_seed(1)
            resp = e.generate(ids, mask, ucfg, [eos], pad)
            return policy_gap(model, ids, mask, resp, e.last_logprobs, eos, ucfg, rows=args.tf_rows)

        attempt("model_policy_gap", lambda: gap_of(eng))  # for scale: the engine's own kernels against HF's forward
        variants = [(name, changes) for name, changes in FP8_VARIANTS.items()
                    if (cuda or name in ("fp8", "kv8", "fp8_kv8"))  # the others are CUDA kernels' A/Bs
                    and (not args.fp8_variants or name in args.fp8_variants.split(","))]  # a call's time is short
        for name, changes in variants:
            if "kv_cache" in changes:  # the cache's reader is timed for it (sdpa reads an fp8 cache back first)
                changes = {**changes, "attn": "auto"}
            e = same_engine(**changes)
            if attempt(f"ours_{name}_sampled", lambda: run_ours(e, ids, mask, scfg, eos, pad, dev)):
                attempt(f"{name}_policy_gap", lambda: gap_of(e))
            r[f"ours_{name}_engine"] = {"attn": e.attn, "attn_cfg": e.attn_cfg, "attn_timings_us": e.attn_timings}
            say(f"ours_{name} engine:", r[f"ours_{name}_engine"])
            del e
    r["ours_engine"] = {"graphs": eng.options.graphs, "compile": eng.compile, "bucket": eng.bucket, "attn": eng.attn,
                        "sampler": eng.sampler, "nucleus": eng.options.nucleus, "attn_cfg": eng.attn_cfg,
                        "attn_timings_us": eng.attn_timings, "continuous_batching_attn": eng.ragged_attn,
                        "continuous_batching_timings_us": eng.ragged_timings}
    say("ours engine:", r["ours_engine"])

    # baseline
    if not args.skip_baseline:
        with torch.no_grad():  # HF warm-up (cuBLAS handles, allocator)
            model.generate(input_ids=ids[:8], attention_mask=mask[:8], max_new_tokens=4, do_sample=False,
                           pad_token_id=pad, eos_token_id=eos)
        hf_s = None if args.no_hf_dynamic else attempt("hf_sampled", lambda: run_hf(model, ids, mask, N, scfg, eos,
                                                                                    pad, dev))
        if cuda and not args.no_hf_static:  # the first call compiles (and is the set-up); the second is timed
            def hf_static():
                t0 = time.perf_counter()
                run_hf(model, ids, mask, N, scfg, eos, pad, dev, static=True)
                setup = time.perf_counter() - t0
                resp, st = run_hf(model, ids, mask, N, scfg, eos, pad, dev, static=True)
                return resp, {**st, "first_call_s": setup}
            hf_st = attempt("hf_static_sampled", hf_static)
        else:
            hf_st = None
        if args.hf_greedy_full:
            attempt("hf_greedy", lambda: run_hf(model, ids, mask, N, gcfg, eos, pad, dev))
    else:
        hf_s = hf_st = None
    # greedy agreement with HF on a slice (bf16 on GPU: expect divergence after a while; exact on CPU fp32)
    nr, nn = min(B, 32), min(N, 32)
    hfg = attempt("hf_greedy_slice", lambda: run_hf(model, ids[:nr], mask[:nr], nn, gcfg, eos, pad, dev))
    if hfg and ours_g:
        r["greedy_agreement_vs_hf"] = prefix_agreement(hfg[0].cpu(), ours_g[0][:nr, :nn].cpu())
        say("greedy agreement vs HF", r["greedy_agreement_vs_hf"])

    if cuda and not args.no_variants:
        # graphs off (same compiled kernels): isolates the launch overhead; greedy should match the graph run
        eng_ng = same_engine(graphs=False, compile=True)
        v = attempt("ours_nographs_greedy", lambda: run_ours(eng_ng, ids, mask, gcfg, eos, pad, dev, repeats=1))
        if v and ours_g:
            r["graph_vs_nograph_greedy"] = prefix_agreement(v[0].cpu(), ours_g[0].cpu())
            say("graph vs no-graph (greedy):", r["graph_vs_nograph_greedy"])
        del eng_ng
        ab("graphs_nocompile", graphs=True, compile=False)
        for attn, smp in (("sdpa", eng.sampler), ("bmm", eng.sampler), (eng.attn, "torch")):
            if (attn, smp) == (eng.attn, eng.sampler):
                continue
            e = same_engine(attn=attn, sampler=smp)
            attempt(f"ours_attn_{e.attn}_sampler_{e.sampler}_sampled", lambda: run_ours(e, ids, mask, scfg, eos, pad,
                                                                                     dev))
            if args.profile and out_dir is not None and smp == eng.sampler and attn == "sdpa":
                attempt(f"profile_attn_{attn}", lambda: profile_step(e, ids, mask, scfg, eos, pad,
                                                                     out_dir / f"profile_{shape}_graph_{attn}.txt",
                                                                     True)[:3000])
            del e
    if cuda and args.profile and out_dir is not None:
        attempt("profile", lambda: {"graph_replay": profile_step(eng, ids, mask, scfg, eos, pad,
                                                                 out_dir / f"profile_{shape}_graph.txt", True)[:4000],
                                    "no_graph": profile_step(eng, ids, mask, scfg, eos, pad,
                                                             out_dir / f"profile_{shape}_steps.txt", False)[:4000]})
    # teacher-forced check under HF's own forward: greedy tokens should be (near) argmax, sampled tokens in
    # HF's nucleus, and ours' mean log-prob should match HF's samples' (same distribution)
    tf = {}
    for name, o in (("ours_greedy", ours_g), ("ours_sampled", ours_s), ("hf_sampled", hf_s)):
        if o:
            tf[name] = attempt(f"teacher_forced_{name}", lambda: teacher_forced(model, ids, mask, o[0], eos,
                                                                                  scfg, rows=args.tf_rows))
    r["teacher_forced"] = tf
    # the table
    def g(d, k):
        return None if not d or not isinstance(d, tuple) else d[1].get(k)

    rows = []
    floor_tps = B / fl["mem_floor_ms"] * 1e3
    for label, o, h in (("sampled", ours_s, hf_s),):
        t_o = g(o, "tokens") / g(o, "total_s") if o else None
        t_h = g(h, "tokens") / g(h, "total_s") if h else None
        rows.append((f"generated tok/s, {label} (T={scfg.temperature}, top_p={scfg.top_p}, top_k={scfg.top_k})",
                     t_h, t_o, f"{t_o / t_h:.1f}x" if t_o and t_h else "-", floor_tps))
        rows.append((f"decode ms/step, {label}", g(h, "ms_per_step"), g(o, "ms_per_step"),
                     f"{g(h, 'ms_per_step') / g(o, 'ms_per_step'):.1f}x" if o and h else "-", fl["mem_floor_ms"]))
        rows.append((f"prefill s, {label}", g(h, "prefill_s"), g(o, "prefill_s"), "-", "-"))
        rows.append((f"wall s for {B}x{N} tokens, {label}", g(h, "total_s"), g(o, "total_s"), "-", "-"))
        if hf_st:  # the stronger baseline: HF's own static cache, compiled
            t_st = g(hf_st, "tokens") / g(hf_st, "total_s")
            rows.append((f"generated tok/s, {label}, HF static cache + compile (baseline column)", t_st, t_o,
                         f"{t_o / t_st:.1f}x" if t_o else "-", floor_tps))
            rows.append((f"decode ms/step, {label}, HF static cache + compile", g(hf_st, "ms_per_step"),
                         g(o, "ms_per_step"), "-", fl["mem_floor_ms"]))
    if ours_g:
        t_o = g(ours_g, "tokens") / g(ours_g, "total_s")
        hgf = r.get("hf_greedy")
        t_h = hgf["tokens"] / hgf["total_s"] if isinstance(hgf, dict) and "tokens" in hgf else None
        rows.append(("generated tok/s, greedy", t_h, t_o, f"{t_o / t_h:.1f}x" if t_h else "-", floor_tps))
        rows.append(("decode ms/step, greedy", hgf.get("ms_per_step") if isinstance(hgf, dict) else None,
                     g(ours_g, "ms_per_step"), "-", fl["mem_floor_ms"]))
    for key, what in (("ours_static_buckets_sampled", "a decode graph per cache bucket"),
                      ("ours_one_pass_nucleus_sampled", "the one-pass nucleus test"),
                      ("ours_fp8_sampled", "fp8 projections (rollout.weights=fp8)"),
                      ("ours_fp8_fast_accum_sampled", "fp8 projections, fast accumulation"),
                      ("ours_fp8_autotuned_sampled", "fp8 projections, row-scaled, inductor's autotuned fp8 GEMMs"),
                      ("ours_fp8_rowwise_sampled", "fp8 projections, row-scaled GEMMs"),
                      ("ours_kv8_sampled", "an fp8 KV cache (rollout.kv_cache=fp8)"),
                      ("ours_fp8_kv8_sampled", "fp8 projections and an fp8 KV cache")):
        ab = r.get(key)
        if isinstance(ab, dict) and "ms_per_step" in ab:
            rows.append((f"decode ms/step, sampled, ours with {what}", "-", ab["ms_per_step"], "-",
                         fl["mem_floor_ms"]))
    for key, what in (("ours_fp8_sampled", "fp8 projections"), ("ours_kv8_sampled", "an fp8 KV cache"),
                      ("ours_fp8_kv8_sampled", "fp8 projections and KV cache")):
        f8 = r.get(key)
        if isinstance(f8, dict) and "tokens" in f8 and ours_s:
            t_model, t_f8 = g(ours_s, "tokens") / g(ours_s, "total_s"), f8["tokens"] / f8["total_s"]
            rows.append((f"generated tok/s, sampled: ours (baseline column) and ours with {what} (floor: bf16 "
                         "weights and cache)", t_model, t_f8, f"{t_f8 / t_model:.2f}x", floor_tps))
    for key, what in (("model_policy_gap", "model weights"), ("fp8_policy_gap", "fp8 projections"),
                      ("fp8_fast_accum_policy_gap", "fp8 projections, fast accumulation"),
                      ("fp8_autotuned_policy_gap", "fp8 projections, autotuned GEMMs"),
                      ("fp8_rowwise_policy_gap", "fp8 projections, row-scaled GEMMs"),
                      ("kv8_policy_gap", "an fp8 KV cache"), ("fp8_kv8_policy_gap", "fp8 projections and KV cache")):
        gap = r.get(key)
        if isinstance(gap, dict) and "k3" in gap:
            rows.append((f"sampling policy vs the model's forward ({gap['tokens']} tokens, top_p 1), ours with "
                         f"{what}: KL k3 / IS weight mean / share > 2", "-",
                         f"{gap['k3']:.2e} / {gap['is_mean']:.3f} / {gap['is_above_2']:.2%}", "-", "-"))
    if ours_s:
        rows.append(("fraction of memory floor (floor ms / decode ms), sampled", "-",
                     f"{fl['mem_floor_ms'] / g(ours_s, 'ms_per_step'):.0%}", "-", "100%"))
        rows.append(("setup s (compile + graph capture, once per engine)", 0.0, g(ours_s, "setup_s"), "-", "-"))
    agr = r.get("greedy_agreement_vs_hf")
    if agr:
        rows.append((f"greedy vs HF: rows identical over first {agr['compared']} tokens", "-",
                     f"{agr['rows_identical']:.0%} (mean common prefix {agr['mean_common_prefix']:.1f})", "-", "-"))
    tf = r.get("teacher_forced") or {}

    def tfv(name, key, pct=True):
        d = tf.get(name)
        if not isinstance(d, dict) or key not in d:
            return "-"
        return f"{d[key]:.1%}" if pct else f"{d[key]:.3f} +- {d['logp_se']:.3f}"

    if tf:
        n = args.tf_rows
        rows.append((f"teacher-forced ({n} rows): greedy token = HF argmax / within 1/16 of it", "-",
                     f"{tfv('ours_greedy', 'argmax_exact')} / {tfv('ours_greedy', 'gap_le_1_16')}", "-", "-"))
        rows.append((f"teacher-forced ({n} rows): sampled token inside HF's top-p set", tfv("hf_sampled", "in_nucleus"),
                     tfv("ours_sampled", "in_nucleus"), "-", "-"))
        rows.append((f"teacher-forced ({n} rows): mean log p(sampled token) under HF", tfv("hf_sampled", "mean_logp", False),
                     tfv("ours_sampled", "mean_logp", False), "-", "-"))
    txt = table(rows)
    r["table"] = txt
    note = (f"floor: {fl['weight_gb']:.2f} GB weights + {fl['kv_gb_avg']:.2f} GB KV (mean valid length) per step "
            f"at {args.hbm_tbs} TB/s = {fl['mem_floor_ms']:.2f} ms; compute floor {fl['gflop_per_step']:.0f} GFLOP "
            f"at {args.peak_tflops} TFLOP/s = {fl['compute_floor_ms']:.2f} ms")
    print(f"\n### {shape}: batch {B}, prompt {P}, {N} new tokens, {dtype}, {torch.cuda.get_device_name(dev) if cuda else 'cpu'}\n")
    print(txt)
    print("\n" + note + "\n", flush=True)
    dump()
    del eng, model
    if cuda:
        torch.cuda.empty_cache()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 1.5b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--ragged", action="store_true", help="prompt lengths in [prompt/2, prompt], left-padded")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak of the H200")
    ap.add_argument("--attn", default="auto", choices=["auto", "bmm", "sdpa"], help="decode attention of ours")
    ap.add_argument("--sampler", default="auto", choices=["auto", "torch", "triton"], help="sampler of ours")
    ap.add_argument("--tf-rows", type=int, default=16, help="rows of the teacher-forced check")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--no-hf-dynamic", action="store_true", help="skip HF generate with its dynamic cache")
    ap.add_argument("--no-hf-static", action="store_true", help="skip HF generate with its static cache + compile")
    ap.add_argument("--hf-greedy-full", action="store_true", help="also time HF greedy at the full shape")
    ap.add_argument("--no-variants", action="store_true", help="skip the ablations (no graphs / no compile / sdpa)")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--ab-nucleus", action="store_true",
                    help="also time ours with the one-pass nucleus test of the Triton sampler (nucleus=one_pass)")
    ap.add_argument("--ab-attn", action="store_true",
                    help="also time the engine with sdpa attention where its timing picked the Triton kernel, and "
                         "with its fastest Triton configuration where it picked sdpa")
    ap.add_argument("--ab-inductor", action="append", metavar="JSON", type=_json_object,
                    help="repeatable: also time the engine under these inductor options (EngineOptions.inductor), "
                         "e.g. '{\"triton.enable_pdl\": true}'")
    ap.add_argument("--ab-static-buckets", action="store_true",
                    help="also time ours with one decode compile per cache bucket (bucket_compile=static)")
    ap.add_argument("--ab-fp8", action="store_true",
                    help="also time the engine with fp8 projections (rollout.weights=fp8) and measure its policy gap")
    ap.add_argument("--fp8-variants", default=None, type=_fp8_variants,
                    help=f"--ab-fp8: only these (comma-separated: {', '.join(FP8_VARIANTS)})")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None, help="folder for profiles")
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=0, help="skip remaining parts after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: tiny shape, batch 4, prompt 8, 8 new, fp32")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.smoke:
        args.shape = args.shape or ["tiny"]
        args.batch, args.prompt, args.new = 4, 8, 8
        args.device = args.device or "cpu"
        args.dtype = args.dtype or "fp32"
        args.ragged = True
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    try:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        if hasattr(dynamo.config, "recompile_limit"):
            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
    except Exception:  # noqa: BLE001
        pass
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    import transformers

    say(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}"
        + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    res: dict = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                 "argv": sys.argv if argv is None else argv}
    for shape in args.shape or ["1.5b"]:
        run_shape(args, shape, dev, dtype, res, out_dir)
    return res


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
