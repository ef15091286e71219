"""FastGen: the static-cache, CUDA-graph engine, and `sample`, the rollout stage's entry point."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
import weakref

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen.kernels import (HAVE_TRITON, _cands_from_stats, _first_decided, _pick, block_stats_triton,
                                    combine_splits, decode_attention_triton, first_mass_triton, member_mass_triton,
                                    reference_decode_attention, sample_logits_triton, silu_mul_fp8)
from verlflow.core.ml.fastgen import choices
from verlflow.core.ml.fastgen.options import EngineOptions
from verlflow.core.ml.fastgen.layers import (FP8, FP8_MAX, PROJECTIONS, _decode_layer, _fp8_linear, _head, _logits,
                                            _norm, _post_attn, _pre_attn, _prefill_layer, _Weights,
                                            quantize_slots, read_cache, silu_mul_fp8_reference)
from verlflow.core.ml.fastgen.sampling import SamplingConfig, _Stats, sample_logits
from verlflow.core.ml.generate import chosen_logprobs, sampling_temperature

log = logging.getLogger("verlflow.fastgen")

# ----------------------------------------------------------------------------------------------- engine


def _sampled_logp(logits: torch.Tensor, nxt: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log_softmax(logits / temperature) of the sampled tokens (one fused pass when compiled)."""
    return chosen_logprobs(logits.float() / temperature, nxt)


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _advance_rows(nxt, logp, live, out, out_logp, col, pos, slot, limit, eos, pad_id, tok, max_new: int):
    """Emit the sampled tokens of the unfinished rows (``live``) with their log-probs, in place. A finished row
    stands still (its column, position and slot stay; it is fed pad_id) until it is refilled or the batch ends; it
    finishes at an EOS or at its token budget ``limit``. Compiled on CUDA: its ~15 small kernels become a few."""
    nxt = torch.where(live, nxt, pad_id)
    c = col.clamp(max=max_new - 1).unsqueeze(1)  # a row at its budget rewrites its last column
    out.scatter_(1, c, torch.where(live, nxt, out.gather(1, c).squeeze(1)).unsqueeze(1))
    out_logp.scatter_(1, c, torch.where(live, logp, out_logp.gather(1, c).squeeze(1)).unsqueeze(1))
    step = live.long()
    col += step
    pos += step
    slot += step
    live &= ~(nxt.unsqueeze(1) == eos.unsqueeze(0)).any(1) & (col < limit)
    tok.copy_(nxt)


class FastGen:
    """A reusable generator for one model: static cache and captured decode steps for up to ``batch_size``
    rows, prompts up to ``max_prompt_len`` and ``max_new_tokens`` new tokens.

    ``options`` (``EngineOptions``) holds the switches and their defaults. Decode attention (``attn``), none of
    which expands the shared K/V heads: "triton" (our split-KV kernel: the group's query heads against their KV
    head, valid slots [pad_b, slot] only, so one captured step serves every length), "sdpa"
    (F.scaled_dot_product_attention with enable_gqa over a bucket of the cache), "bmm" (q viewed as
    (B, kv_heads, group, D), matmul against the cache's heads, over a bucket). All three apply sliding windows
    (Mistral, Phi-3, Gemma, Qwen with use_sliding_window: per layer, HF's rule that query slot q sees key slot n iff
    q - n < window). Attention logit soft-capping (Gemma-2 under eager attention) is in "bmm" and "triton" only:
    such a model refuses attn="sdpa", and "auto" never picks it; its prefill runs the math attention instead of
    SDPA. With ``weights="fp8"`` the log-probs the engine returns are the fp8 model's, the policy it sampled from;
    with ``kv_cache="fp8"`` (half the cache's bytes, which the Triton kernel reads directly) every token, the
    prompt's too, attends to the rounded keys and values, so the log-probs returned are that model's.

    ``self.options`` is the resolved record (``EngineOptions.resolved``); ``attn``, ``sampler`` and ``compile`` are
    what the engine runs now: the attention timing, a failed self-check or a failed compile change them."""

    def __init__(self, model, batch_size: int, max_prompt_len: int, max_new_tokens: int,
                 options: EngineOptions | None = None):
        asked = (options or EngineOptions()).numerics()
        self.w = _Weights(model, asked)
        self.device = self.w.device
        cuda = _on_cuda(self.device)
        self.options = asked.resolved(cuda=cuda, have_triton=HAVE_TRITON, softcap=self.w.spec.softcap,
                                      model_type=model.config.model_type)
        # what the engine runs now, from the options: the start-up checks and timing may change them
        self.attn, self.sampler, self.compile = self.options.attn, self.options.sampler, self.options.compile
        self.B = int(batch_size)
        self.max_prompt = int(max_prompt_len)
        self.max_new = int(max_new_tokens)
        self.T = self.max_prompt + self.max_new
        self.bucket = max(self.options.bucket, math.ceil(self.T / 8 / 64) * 64)  # <= 8 buckets, a compile each
        w, dev, dt = self.w, self.device, self.w.dtype
        # One spare slot, never read or written: every bucket, the last too, is then a strided view of the cache,
        # and one compiled decode step serves them all (a whole-cache view is contiguous: a graph of its own)
        kv8 = w.spec.kv8
        cdt = FP8 if kv8 else dt
        self.kc = [torch.zeros(self.B, w.nkv, self.T + 1, w.hd, dtype=cdt, device=dev) for _ in range(w.n_layers)]
        self.vc = [torch.zeros(self.B, w.nkv, self.T + 1, w.hd, dtype=cdt, device=dev) for _ in range(w.n_layers)]
        # an fp8 cache's scales, one per (row, KV head, slot); None per layer otherwise
        self.ks = [torch.zeros(self.B, w.nkv, self.T + 1, device=dev) if kv8 else None for _ in range(w.n_layers)]
        self.vs = [torch.zeros(self.B, w.nkv, self.T + 1, device=dev) if kv8 else None for _ in range(w.n_layers)]
        # the Triton kernel splits the slots it is given: without the spare one it runs no split of masked slots
        self._kT, self._vT = [c[:, :, :self.T] for c in self.kc], [c[:, :, :self.T] for c in self.vc]
        pos = torch.arange(self.T, device=dev)
        self.rope = w.rope_tables(pos)  # [(cos, sin) (T, rot)] per distinct rotary table (Gemma-3: two)
        # each layer's sliding window; one at least as long as the cache is no window (Llama's path)
        self.windows = [win if 0 < win < self.T else 0 for win in w.windows]
        self.slots = pos
        # decode state: everything a captured step reads or advances
        self.tok = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.pad_off = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.slot = torch.zeros(self.B, dtype=torch.long, device=dev)  # each row's cache slot of its current token
        self.col = torch.zeros(self.B, dtype=torch.long, device=dev)  # each row's next output column
        self.limit = torch.full((self.B,), self.max_new, dtype=torch.long, device=dev)  # each row's token budget
        self.unfinished = torch.ones(self.B, dtype=torch.bool, device=dev)
        self.out = torch.zeros(self.B, self.max_new, dtype=torch.long, device=dev)
        self.out_logp = torch.zeros(self.B, self.max_new, dtype=torch.float32, device=dev)  # of the chosen tokens
        self.last_logprobs: torch.Tensor | None = None
        self.eos = torch.full((self.MAX_EOS,), -1, dtype=torch.long, device=dev)  # -1: no token matches
        self.pad_id = torch.zeros((), dtype=torch.long, device=dev)
        self._eos_key: tuple | None = None
        self._refill_ready = False
        self._set_fns(self.compile)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.last_stats: dict = {}
        self.attn_cfg: dict = {}
        self.attn_timings: dict = {}
        # continuous batching's decode attention, where timing chose another: its rows sit at spread lengths, and
        # sdpa reads the bucket of the longest for every row while the Triton kernel reads each row's own slots
        self.ragged_attn: tuple[str, dict] | None = None
        self.ragged_timings: dict = {}
        # where the set-up goes (logged by prepare): the kernel checks and attention timing, the decode steps'
        # compiles and captures, the refills' prefill compile
        self.setup_parts = {"checks_s": 0.0, "captures": 0, "capture_s": 0.0, "refill_compile_s": 0.0}
        t0 = time.perf_counter()
        timing_key = None
        if cuda and asked.attn == "auto" and self.attn == "triton":  # what this shape timed on this machine before
            timing_key = choices.key(dev, rows=self.B, slots=self.T, bucket=self.bucket, heads=w.nh, kv_heads=w.nkv,
                                     head_dim=w.hd, dtype=dt, windows=sorted(set(self.windows)), softcap=w.spec.softcap,
                                     configs=self._ATTN_CONFIGS,  # a new candidate is timed, not passed over
                                     kv_cache="fp8" if w.spec.kv8 else "model")
            kept = choices.load(timing_key)
            if kept is not None:
                self._take_choice(kept)
                log.info("fastgen: decode attention %s %s (continuous batching: %s), as timed before on this "
                         "machine (%s)", self.attn, self.attn_cfg, self.ragged_attn, choices.where())
                timing_key = None
        if cuda and ("triton" in (self.attn, self.sampler, (self.ragged_attn or ("",))[0]) or w.fp8):
            self._self_check()
        if timing_key is not None and self.attn == "triton":  # (a Triton kernel that failed its check is not timed)
            self._pick_attention()
            if self.attn_timings:
                choices.store(timing_key, self._choice())
        self.setup_parts["checks_s"] = round(time.perf_counter() - t0, 3)

    def _set_fns(self, compiled: bool):
        fns = dict(layer=_decode_layer, pre=_pre_attn, post=_post_attn, logits=_logits, head=_head, norm=_norm,
                   sample=sample_logits,
                   cands=_cands_from_stats, pick=_pick, decided=_first_decided, prefill=_prefill_layer,
                   logp=_sampled_logp, advance=_advance_rows)
        self._eager = dict(fns)  # a refill's first tokens: a new row count each time, not worth a compile each
        if compiled:  # the prefill sees a new (rows, width) per micro-batch: _prefill marks those two dims dynamic
            # (dynamic=True would make every size and float symbolic: a slower compile, even from the cache)
            # Inductor autotunes fp8 matmuls against its Triton templates even without max-autotune: set-up time
            # on a cold cache, and a kernel the start-up check never ran. Fp8Choices.gemm "unit"/"rowwise" keep the
            # op's own kernel (cuBLASLt), as for the bf16 matmuls; "autotune" lets inductor choose (an A/B)
            o = self.options
            options = ({"max_autotune_gemm_backends": "ATEN"}
                       if self.w.fp8 and o.fp8.gemm != "autotune" and o.compile_backend == "inductor" else {})
            options.update(o.inductor)
            opts = {"options": options} if options else {}
            fns = {k: torch.compile(f, fullgraph=k not in ("sample",), backend=o.compile_backend, **opts)
                   for k, f in fns.items()}
        self._fn = fns

    MAX_EOS = 8  # EOS ids a generation may stop at (a fixed-size buffer: captured steps need not change)

    # the Triton kernel's configurations attn="auto" times; "bounded" skips the blocks of slots with none valid
    # (past the row's slot, before its pad or window), which the others load as nothing but still compute;
    # "splits" cuts each row's valid slots into that many runs, each one program's pipelined loop
    _ATTN_CONFIGS = ({"split_n": 64, "block_n": 64, "num_warps": 4}, {"split_n": 128, "block_n": 64, "num_warps": 4},
                     {"split_n": 128, "block_n": 128, "num_warps": 4}, {"split_n": 128, "block_n": 128, "num_warps": 8},
                     {"split_n": 64, "block_n": 32, "num_warps": 2},
                     {"split_n": 64, "block_n": 64, "num_warps": 4, "bounded": True},
                     {"split_n": 128, "block_n": 64, "num_warps": 4, "bounded": True},
                     {"split_n": 256, "block_n": 64, "num_warps": 4, "bounded": True},
                     {"splits": 2, "block_n": 64, "num_warps": 4},
                     {"splits": 2, "block_n": 32, "num_warps": 4, "num_stages": 4})

    def _pick_attention(self):
        """attn="auto" on CUDA: time one layer's decode attention, replayed from CUDA graphs, for the Triton kernel's
        configurations and for sdpa over its cache bucket; keep the fastest. Twice: every row at one mid-generation
        slot (a micro-batch), and rows at slots spread over the whole cache (continuous batching, where sdpa's bucket
        is the longest row's: ``ragged_attn`` when that choice differs)."""
        try:
            w, B, dev = self.w, self.B, self.device
            cur = min(self.T - 2, self.max_prompt + self.max_new // 2)
            q = torch.randn(B, w.nh, w.hd, device=dev).to(w.dtype)
            kc, vc, ks, vs = self._kT[0], self._vT[0], self.ks[0], self.vs[0]
            pad = torch.zeros(B, dtype=torch.long, device=dev)
            spread = torch.linspace(min(self.max_prompt, self.T - 2), self.T - 2, B, device=dev).long()
            scenarios = {  # (each row's slot, the slots sdpa reads)
                "uniform": (torch.full((B,), cur, device=dev), min(self.T, (cur // self.bucket + 1) * self.bucket)),
                "ragged": (spread[torch.randperm(B, device=dev)], self.T)}
            variant = dict(window=self.windows[0], softcap=w.spec.softcap)  # layer 0's kernel
            ok_cfgs = []
            for i, cfg in enumerate(self._ATTN_CONFIGS):  # only a configuration that computes attention is timed
                failed = self._attn_failure(cfg)
                if failed is None:
                    ok_cfgs.append((i, cfg))
                else:
                    log.warning("fastgen: Triton decode attention %s failed its check (%s); not timed", cfg, failed)
            picked = {}
            for name, (slot, kv) in scenarios.items():
                bias = torch.zeros(B, 1, 1, kv, dtype=w.dtype, device=dev)
                fns = {} if w.spec.softcap else {"sdpa": (0.0, lambda kv=kv, bias=bias: F.scaled_dot_product_attention(
                    q.unsqueeze(2), *read_cache(kc, vc, ks, vs, kv, w.dtype), attn_mask=bias, scale=w.scaling,
                    enable_gqa=True))}
                for i, cfg in ok_cfgs:  # + the split merge, fused into the next projection in the compiled step
                    # (~4 us on the H200): timing it eagerly here would count its launches
                    fns[f"triton{i}"] = (4.0, lambda cfg=cfg, slot=slot: decode_attention_triton(
                        q, kc, vc, pad, slot, w.scaling, w.nkv, **cfg, **variant, ks=ks, vs=vs))
                times = choices.graph_times(fns, dev)
                best = min(times, key=times.get)
                picked[name] = (("sdpa", {}) if best == "sdpa" else ("triton", dict(self._ATTN_CONFIGS[int(best[6:])])),
                                {k: round(v, 1) for k, v in times.items()})
            (self.attn, self.attn_cfg), self.attn_timings = picked["uniform"]
            ragged, self.ragged_timings = picked["ragged"]
            self.ragged_attn = None if ragged == (self.attn, self.attn_cfg) else ragged
            log.info("fastgen: decode attention %s %s (us per layer: %s); continuous batching: %s (us: %s)", self.attn,
                     self.attn_cfg, self.attn_timings, ragged, self.ragged_timings)
        except Exception as e:  # noqa: BLE001
            log.warning("fastgen: attention timing failed (%s); keeping %s", e, self.attn)

    def _choice(self) -> dict:
        """The timed attention choices, as kept in the machine's cache folder (the spread-lengths timings even when
        their choice is the one-length one)."""
        ragged = None if self.ragged_attn is None else {"attn": self.ragged_attn[0], "cfg": self.ragged_attn[1]}
        return {"attn": self.attn, "cfg": self.attn_cfg, "timings": self.attn_timings, "ragged": ragged,
                "ragged_timings": self.ragged_timings}

    def _take_choice(self, kept: dict):
        self.attn, self.attn_cfg = kept["attn"], dict(kept.get("cfg") or {})
        self.attn_timings = dict(kept.get("timings") or {})
        self.ragged_timings = dict(kept.get("ragged_timings") or {})
        ragged = kept.get("ragged")
        if isinstance(ragged, dict) and ragged.get("attn") in ("sdpa", "triton"):
            self.ragged_attn = (ragged["attn"], dict(ragged.get("cfg") or {}))

    def _attn_failure(self, cfg: dict) -> str | None:
        """Why the Triton decode attention with configuration ``cfg`` is not to be used (None: it passed)."""
        try:
            err = self._attn_error(cfg)
        except Exception as e:  # noqa: BLE001 - Triton's compile and launch errors vary by version
            return f"{type(e).__name__}: {e}"
        tol = 1e-4 if self.w.dtype == torch.float32 else 2e-2  # fp32: IEEE dots, where TF32's error shows
        return None if err < tol else f"max abs error {err:.3g}, tolerance {tol:g}"  # (NaN fails too)

    def _attn_error(self, cfg: dict) -> float:
        """The Triton decode attention with configuration ``cfg`` against the torch reference on small random
        inputs (rows of their own pad and slot), every variant the layers use (window, soft-cap): max abs error."""
        w, dev, dt = self.w, self.device, self.w.dtype
        g = torch.Generator(device=dev).manual_seed(0)
        B, T = 3, 200
        q = torch.randn(B, w.nh, w.hd, generator=g, device=dev).to(dt)
        kc = torch.randn(B, w.nkv, T, w.hd, generator=g, device=dev).to(dt)
        vc = torch.randn(B, w.nkv, T, w.hd, generator=g, device=dev).to(dt)
        scales = {}
        if w.spec.kv8:  # as the cache holds them: e4m3 with a scale per slot, the slots' sizes over 4 decades
            spread = torch.logspace(-2, 2, T, device=dev).view(T, 1)
            (kc, ks), (vc, vs) = quantize_slots(kc * spread.to(dt)), quantize_slots(vc * spread.flip(0).to(dt))
            scales = dict(ks=ks, vs=vs)
        pad = torch.tensor([0, 37, 150], device=dev)
        slot = torch.tensor([170, 120, 199], device=dev)
        errs = []
        for win in sorted(set(self.windows)):
            extra = dict(window=win, softcap=w.spec.softcap)
            got = combine_splits(*decode_attention_triton(q, kc, vc, pad, slot, w.scaling, w.nkv, **cfg, **extra,
                                                          **scales), w.nh // w.nkv)
            want = reference_decode_attention(q, kc, vc, pad, slot, w.scaling, **extra, **scales)
            errs.append((got - want).abs().max())
        return torch.stack(errs).max().item()  # NaN stays NaN (Python's max would drop it) and fails the check

    def _fp8_error(self) -> float:
        """The fp8 projections' matmul against its definition, x8 * sx @ (w8 * sw).T in fp32, on each quantized
        projection of layer 0 with random rows: the largest error relative to the output's largest value."""
        L, dev = self.w.layers[0], self.device
        g = torch.Generator(device=dev).manual_seed(1)
        errs = [torch.zeros((), device=dev)]
        for p in PROJECTIONS:
            w8, sw = L["w" + p], L["s" + p]
            if sw is None:
                continue
            x = torch.randn(5, w8.shape[1], generator=g, device=dev).to(self.w.dtype)
            got = _fp8_linear(x, w8, sw, None, self.w.spec.fp8_fast, self.w.spec.fp8_unit).float()
            sx = x.float().abs().amax(-1, keepdim=True) / FP8_MAX
            want = ((x.float() / sx).to(FP8).float() * sx) @ (w8.float() * sw.t()).t()
            errs.append((got - want).abs().max() / want.abs().max())
        return torch.stack(errs).max().item()  # NaN stays NaN and fails

    def _act_failure(self) -> str | None:
        """Why the Triton kernel between the gate/up and down fp8 GEMMs is not to be used (None: it equals its
        definition on layer 0's channel scales, rows a decade apart in size)."""
        L, dev = self.w.layers[0], self.device
        g = torch.Generator(device=dev).manual_seed(2)
        try:
            y = (torch.randn(5, L["wgu"].shape[0], generator=g, device=dev)
                 * torch.logspace(-1, 1, 5, device=dev).view(5, 1)).to(self.w.dtype)
            sy = torch.rand(5, 1, generator=g, device=dev) + 0.5
            x8, sx = silu_mul_fp8(y, sy, L["sgu"], FP8_MAX)
            r8, rs = silu_mul_fp8_reference(y, sy, L["sgu"])
        except Exception as e:  # noqa: BLE001 - Triton's compile and launch errors vary by version
            return f"{type(e).__name__}: {e}"
        off = (x8.float() != r8.float()).float().mean().item()  # exp's last bits may tip a value's rounding
        err = ((sx - rs).abs() / rs).max().item()
        return None if off < 1e-3 and err < 1e-5 else f"{off:.2%} of its e4m3 values differ, its scales by {err:.2g}"

    def _self_check(self):
        """The Triton kernels against the torch paths on small random inputs; a mismatch turns them off."""
        w, dev, dt = self.w, self.device, self.w.dtype
        g = torch.Generator(device=dev).manual_seed(0)
        if w.fp8:
            try:  # fp8 matmuls are not on every GPU and torch build (some Blackwell parts lack the row-scaled one)
                err = self._fp8_error()
            except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, ValueError or NotImplementedError
                raise RuntimeError(f"rollout.weights=fp8: torch._scaled_mm ({self.options.fp8.gemm}) fails on {dev} "
                                   f"({e}); use rollout.weights=model") from e
            if not err < 1e-2:  # bf16 output rounding is ~4e-3; a wrong scale layout is off by O(1)
                raise RuntimeError(f"rollout.weights=fp8: torch._scaled_mm on this GPU differs from its reference "
                                   f"(relative error {err:.3g}); use rollout.weights=model")
        if w.spec.fp8_act:
            failed = self._act_failure()
            if failed is not None:
                log.warning("fastgen: the fp8 SiLU x up kernel failed its check (%s); the compiled step makes the down "
                            "projection's input", failed)
                w.spec = w.spec._replace(fp8_act=False)
        if self.attn == "triton":
            failed = self._attn_failure(self.attn_cfg)
            if failed is not None:
                fallback = "bmm" if w.spec.softcap else "sdpa"
                log.warning("fastgen: Triton decode attention failed its check (%s); using %s", failed, fallback)
                self.attn = fallback
        if self.ragged_attn is not None and self.ragged_attn[0] == "triton":
            failed = self._attn_failure(self.ragged_attn[1])
            if failed is not None:
                log.warning("fastgen: Triton decode attention %s failed its check (%s); continuous batching uses %s",
                            self.ragged_attn[1], failed, self.attn)
                self.ragged_attn = None
        if self.sampler == "triton":
            try:
                V = w.vocab
                logits = (torch.randn(4, V, generator=g, device=dev) * 2).to(dt)
                bmax, bsl = block_stats_triton(logits, 0.7)
                st = _Stats(logits.float() / 0.7)
                cand = torch.randint(0, V, (4, 5), generator=g, device=dev)
                cand[:, 0] = logits.argmax(-1)  # one candidate whose mass is the row's whole mass
                m, raw = st.m.squeeze(-1).contiguous(), logits.gather(1, cand)
                le = member_mass_triton(logits, 0.7, m, raw)
                done = torch.tensor([True, False, True, False], device=dev)  # the two-pass sampler's second pass
                gated = member_mass_triton(logits, 0.7, m, raw, done=done)
                first = first_mass_triton(logits, 0.7, m, raw).sum(1)  # ... and its first
                xc = st.xb.view(4, -1).gather(1, cand)
                want = torch.stack([torch.where(st.xb <= xc[:, c].view(4, 1, 1), torch.exp(st.xb - st.m.unsqueeze(-1)),
                                                0.0).sum((1, 2)) for c in range(5)], -1)
                scale = torch.exp(bmax - st.m)

                def close(got, want, z=st.z):  # masses as fractions of the row's total, as the nucleus test uses
                    return torch.allclose(got / z, want / z, rtol=1e-3, atol=1e-6)

                ok = (torch.allclose(bmax, st.bmax, rtol=1e-5, atol=1e-5)
                      and torch.allclose(bsl * scale, st.bsum, rtol=1e-3, atol=1e-6)
                      and close(le, want) and close(first.unsqueeze(1), want[:, :1])
                      and torch.equal(gated[done], torch.zeros_like(gated[done]))
                      and close(gated[~done], want[~done], st.z[~done]))
                if not ok:
                    raise RuntimeError("block stats / nucleus mass differ from the torch path")
            except Exception as e:  # noqa: BLE001
                log.warning("fastgen: Triton sampler failed its check (%s); using the torch sampler", e)
                self.sampler = "torch"

    def refresh_weights(self):
        self.w.refresh()

    # ---- one decode step (what a graph captures)

    def _next_norms(self) -> tuple[list, bool]:
        """The norm each layer's graph applies to its output: the next layer's input norm, and after the last layer
        the final norm where it is the same kind (then the head reads it directly). Read each step: refresh() may
        replace the weights' tensors."""
        w = self.w
        layers = w.layers
        final = all(L["ln1"] is not None for L in layers) and w.norm_eps == w.spec.eps
        return [L["ln1"] for L in layers[1:]] + [w.norm_w if final else None], final

    def _step(self, kv_len: int, cfg: SamplingConfig):
        w, fn, S = self.w, self._fn, self.w.spec
        x = self._embed(self.tok)
        h = fn["norm"](x, w.layers[0]["ln1"], S)
        nexts, final = self._next_norms()
        rope = [(c[self.pos], s[self.pos]) for c, s in self.rope]
        if self.attn == "triton":
            for i, L in enumerate(w.layers):
                cos, sin = rope[w.rope_of[i]]
                q = fn["pre"](h, L, self.kc[i], self.vc[i], self.slot, cos, sin, S, self.ks[i], self.vs[i])
                mp, lp, op = decode_attention_triton(q, self._kT[i], self._vT[i], self.pad_off, self.slot,
                                                     S.scaling, S.nkv, window=self.windows[i], softcap=S.softcap,
                                                     ks=self.ks[i], vs=self.vs[i], **self.attn_cfg)
                x, h = fn["post"](x, mp, lp, op, L, nexts[i], S)
        else:
            s, cur = self.slots[:kv_len].unsqueeze(0), self.slot.unsqueeze(1)
            valid = (s >= self.pad_off.unsqueeze(1)) & (s <= cur)
            bias = {}  # per sliding window (0: none): HF's window keeps key n for query q iff q - n < window
            for win in sorted(set(self.windows)):
                ok = valid & (s > cur - win) if win else valid
                bias[win] = torch.zeros(ok.shape, dtype=torch.float32, device=x.device).masked_fill_(
                    ~ok, float("-inf"))
                if self.compile and self.options.bucket_compile == "dynamic":  # one compile for every cache bucket
                    torch._dynamo.maybe_mark_dynamic(bias[win], 1)
                elif self.compile:  # a graph per bucket (dynamo would otherwise turn the size dynamic itself)
                    torch._dynamo.mark_static(bias[win], 1)
            for i, L in enumerate(w.layers):
                cos, sin = rope[w.rope_of[i]]
                x, h = fn["layer"](x, h, L, nexts[i], self.kc[i], self.vc[i], self.slot, cos, sin,
                                   bias[self.windows[i]], S, self.attn, self.ks[i], self.vs[i])
        if final:
            logits = fn["head"](h, w.lm_w, w.final_cap)
        else:
            logits = fn["logits"](x, w.norm_w, w.lm_w, w.norm_eps, S.norm32, w.final_cap)
        self._advance(*self._sample(logits, cfg))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.w.embed)
        if self.w.embed_scale is not None:  # Gemma: times sqrt(hidden) in the model dtype
            x = x * self.w.embed_scale
        return x

    def _sample(self, logits: torch.Tensor, cfg: SamplingConfig, fn: dict | None = None):
        """The next tokens and their fp32 log-probs under the sampling logits (logits / T; greedy: T = 1): the
        rollout's old log-probs. The Triton sampler has them from its own block pass; otherwise one more pass over
        the vocabulary."""
        fn = fn or self._fn
        u = None if cfg.greedy else torch.rand(logits.shape[0], cfg.candidates(), 2, device=logits.device)
        if self.sampler == "triton" and cfg.method(logits.shape[1]) == "reject":
            return sample_logits_triton(logits, cfg, u, fn["cands"], fn["pick"], fn["decided"],
                                        two_pass=self.options.nucleus == "two_pass")
        nxt = fn["sample"](logits, cfg, u)
        return nxt, fn["logp"](logits, nxt, sampling_temperature(cfg.temperature))

    def _advance(self, nxt: torch.Tensor, logp: torch.Tensor):
        self._fn["advance"](nxt, logp, self.unfinished, self.out, self.out_logp, self.col, self.pos, self.slot,
                            self.limit, self.eos, self.pad_id, self.tok, self.max_new)

    def _reset_state(self):
        self.slot.zero_()
        self.col.zero_()
        self.pos.zero_()
        self.tok.zero_()
        self.pad_off.zero_()
        self.limit.fill_(self.max_new)
        self.unfinished.fill_(True)

    def _graph_key(self, kv_len: int, cfg: SamplingConfig) -> tuple:
        return kv_len, cfg, self.attn, tuple(sorted(self.attn_cfg.items()))

    def _graph(self, kv_len: int, cfg: SamplingConfig) -> torch.cuda.CUDAGraph:
        """The captured decode step for this cache length (captured now, before generation, if it is new)."""
        key = self._graph_key(kv_len, cfg)
        g = self._graphs.get(key)
        if g is not None:
            return g
        t0 = time.perf_counter()
        self._reset_state()  # warm-up steps run for real: keep them inside the cache
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._step(kv_len, cfg)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._reset_state()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(kv_len, cfg)
        torch.cuda.synchronize(self.device)
        self._graphs[key] = g
        took = time.perf_counter() - t0
        self.setup_parts["captures"] += 1
        self.setup_parts["capture_s"] = round(self.setup_parts["capture_s"] + took, 3)
        log.info("fastgen: captured decode step for kv_len=%d %s in %.1fs", kv_len, cfg, took)
        return g

    def _kv_len(self, slot: int) -> int:
        if self.attn == "triton":  # the kernel reads the valid slots itself: one step for every length
            return self.T
        return min(self.T, (slot // self.bucket + 1) * self.bucket)

    def _warm_kvs(self, prompt_len: int, every_slot: bool) -> list[int]:
        """The cache lengths of every decode step a generation may run: a micro-batch of prompts ``prompt_len``
        wide decodes from slot prompt_len - 1 to prompt_len + max_new - 2; continuous batching up to slot T - 1 (its
        bound on the rows' slots stops there)."""
        first, last = (prompt_len - 1, self.T - 1) if every_slot else (prompt_len, prompt_len + self.max_new - 2)
        return sorted({self._kv_len(s) for s in range(max(0, min(first, last)), last + 1)})

    def warmup(self, prompt_len: int, cfg: SamplingConfig, every_slot: bool = False):
        """Compile and capture every step a generate() with this prompt width will need (``every_slot``: every
        step any prompt may need, as continuous batching does: a capture mid-generation would reset the rows). A
        compile failure falls back to eager kernels (still captured), with a warning."""
        if not self.options.graphs:
            return
        kvs = self._warm_kvs(prompt_len, every_slot)
        try:
            for kv in kvs:
                self._graph(kv, cfg)
        except Exception as e:  # noqa: BLE001 - inductor/dynamo failures vary by version
            if not self.compile:
                raise
            log.warning("fastgen: torch.compile failed (%s: %s); capturing eager kernels instead",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.compile = False
            self._set_fns(False)
            self._graphs.clear()
            torch.cuda.synchronize(self.device)
            for kv in kvs:
                self._graph(kv, cfg)

    # ---- prefill

    def _prefill(self, ids: torch.Tensor, pad: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Fill cache slots [0, P) of the cache rows ``rows`` (default: the first n) with prompts ids (n, P),
        left-padded by ``pad`` (n,); return the last position's hidden state (n, H)."""
        w = self.w
        B, P = ids.shape
        per = max(1, self.options.prefill_tokens // P)
        outs = []
        ar = torch.arange(P, device=ids.device)
        for r0 in range(0, B, per):
            r1 = min(B, r0 + per)
            pid = ids[r0:r1]
            po = pad[r0:r1]
            n = r1 - r0
            if self.compile and n == 1:  # dynamo specialises a size of 1 (a graph of its own, compiled mid-call):
                pid, po = pid.expand(2, -1), po.expand(2)  # the row twice takes the graph every other count takes
            posn = (ar.unsqueeze(0) - po.unsqueeze(1)).clamp_(min=0)
            rope = [(c[posn].unsqueeze(1), s[posn].unsqueeze(1)) for c, s in self.rope]  # (n, 1, P, rot)
            keyok = ar.unsqueeze(0) >= po.unsqueeze(1)  # (n, P)
            mask = (ar.view(1, P, 1) >= ar.view(1, 1, P)) & keyok.unsqueeze(1)
            mask |= torch.eye(P, dtype=torch.bool, device=ids.device).unsqueeze(0)  # pad queries see themselves
            mask = mask.unsqueeze(1)  # (n, 1, P, P)
            masks = {win: mask & ((ar.view(1, 1, P, 1) - ar.view(1, 1, 1, P)) < win) if win else mask
                     for win in set(self.windows)}  # sliding-window layers: the banded causal mask
            x = self._embed(pid)
            if self.compile:  # rows and width vary; the rest is the model's (one compile, not one per shape)
                for t, dims in ((x, (0, 1)), *((t, (0, 2)) for cs in rope for t in cs),
                                *((m, (0, 2, 3)) for m in masks.values())):
                    torch._dynamo.maybe_mark_dynamic(t, dims)
            for i, L in enumerate(w.layers):
                cos, sin = rope[w.rope_of[i]]
                args = (L, cos, sin, masks[self.windows[i]], w.spec)
                try:
                    x2, k, v, sk, sv = self._fn["prefill"](x, *args)
                except Exception as e:  # noqa: BLE001 - a compile failure: eager from now on
                    if self._fn["prefill"] is _prefill_layer:
                        raise
                    log.warning("fastgen: compiled prefill failed (%s: %s); eager prefill", type(e).__name__,
                                str(e).splitlines()[0] if str(e) else "")
                    self._fn["prefill"] = _prefill_layer
                    x2, k, v, sk, sv = _prefill_layer(x, *args)
                x = x2
                dst = slice(r0, r1) if rows is None else rows[r0:r1]
                self.kc[i][dst, :, :P] = k[:n]
                self.vc[i][dst, :, :P] = v[:n]
                if sk is not None:
                    self.ks[i][dst, :, :P] = sk[:n]
                    self.vs[i][dst, :, :P] = sv[:n]
            outs.append(x[:n, -1])
        return torch.cat(outs)

    # ---- generate

    # Without grad, as generation runs: dynamo guards on grad mode, and a set-up with grad on compiled graphs that
    # generation could not use (benchmarks/ragged.py compiled three again in its first micro-batches: 3 s, H200)
    @torch.no_grad()
    def prepare(self, eos_ids, pad_id: int, cfg: SamplingConfig, width: int, every_slot: bool = False) -> float:
        """Set the EOS ids and pad id; compile and capture what a generation from prompts of ``width`` slots needs
        (``every_slot``: what continuous batching may need). Returns the seconds it took (set-up, not generation)."""
        eos = sorted({int(e) for e in (eos_ids if isinstance(eos_ids, (list, tuple, set)) else [eos_ids])})
        if len(eos) > self.MAX_EOS:
            raise ValueError(f"fastgen: {len(eos)} EOS ids {eos}; the engine takes at most {self.MAX_EOS}")
        if self._eos_key != tuple(eos):  # in place: captured steps read self.eos by address
            self.eos.fill_(-1)
            self.eos[:len(eos)] = torch.tensor(eos, dtype=torch.long)
            self._eos_key = tuple(eos)
        self.pad_id.fill_(int(pad_id))
        t0 = time.perf_counter()
        if self.options.graphs:  # warm-up steps draw random numbers: keep the caller's seed meaning the same
            rng = torch.cuda.get_rng_state(self.device)
            with self._ragged_attention() if every_slot else contextlib.nullcontext():  # the steps it will replay
                self.warmup(width, cfg, every_slot)
            torch.cuda.set_rng_state(rng, self.device)
        if every_slot and self.compile and not self._refill_ready:  # compile the refills' prefill (any rows, any
            t1 = time.perf_counter()
            for n, p in ((2, 3), (3, 5)):  # width) now, in the set-up (a single row runs as two: _prefill)
                rows = torch.arange(min(n, self.B), device=self.device)  # an engine of 1 or 2 rows has no third
                self._prefill(torch.zeros(len(rows), p, dtype=torch.long, device=self.device), torch.zeros_like(rows),
                              rows)
            self._refill_ready = True
            self._sync()
            self.setup_parts["refill_compile_s"] = round(time.perf_counter() - t1, 3)
        self._sync()
        took = time.perf_counter() - t0
        if took > 0.05:
            log.info("fastgen: set-up %.1fs in prepare (%s)", took, self.setup_parts)
        return took

    def _sync(self):
        if _on_cuda(self.device):
            torch.cuda.synchronize(self.device)

    def _start_rows(self, rows: torch.Tensor, ids: torch.Tensor, pad: torch.Tensor, limits: torch.Tensor,
                    cfg: SamplingConfig):
        """Put left-padded prompts ids (n, P) (``pad`` (n,) pad slots each) into cache rows ``rows`` (n,): prefill
        them, sample each one's first token, and set the rows' decode state so the next step continues them."""
        P = ids.shape[1]
        every = len(rows) == self.B  # all rows (a micro-batch): plain slices, not an index_put over the cache
        for c in [c for c in self.kc + self.vc + self.ks + self.vs if c is not None]:
            if every:
                c[:, :, P:].zero_()  # slots past the prompt: no stale non-finite values under a zero weight
            else:
                c[rows, :, P:] = 0
        h = self._prefill(ids, pad, None if every else rows)
        w = self.w
        logits = _logits(h, w.norm_w, w.lm_w, w.norm_eps, w.spec.norm32, w.final_cap)
        fn = self._fn if len(rows) == self.B else self._eager
        first, logp = self._sample(logits, cfg, fn)
        self.out[rows] = self.pad_id
        self.out_logp[rows] = 0.0
        self.out[rows, 0] = first
        self.out_logp[rows, 0] = logp
        self.tok[rows] = first
        self.pad_off[rows] = pad
        self.pos[rows] = P - pad  # the first new token's position (its prompt's length)
        self.slot[rows] = P  # ... and its cache slot
        self.col[rows] = 1
        self.limit[rows] = limits
        self.unfinished[rows] = ~(first.unsqueeze(1) == self.eos.unsqueeze(0)).any(1) & (limits > 1)

    def _decode(self, kv_len: int, cfg: SamplingConfig):
        if self.options.graphs:
            g = self._graphs.get(self._graph_key(kv_len, cfg))
            if g is None:  # capturing now would reset every row being generated: say so, never corrupt them
                raise RuntimeError(f"fastgen: no decode step was captured for kv_len={kv_len} ({self.attn} "
                                   f"{self.attn_cfg}) before generation; the warm-up missed it (a bug)")
            g.replay()
        else:
            self._step(kv_len, cfg)

    def _check_prompts(self, lens: list[int]):
        if lens and max(lens) > self.max_prompt:
            raise ValueError(f"fastgen: prompt width {max(lens)} > engine max_prompt_len {self.max_prompt}")
        if lens and min(lens) < 1:
            raise ValueError("fastgen: an empty prompt (every prompt needs at least one token)")

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg: SamplingConfig,
                 eos_ids, pad_id: int, limits: torch.Tensor | None = None) -> torch.Tensor:
        """Responses (b, max_new_tokens) for left-padded prompts (b, P), all rows started together and run until
        the last one ends; after a row's EOS (or its ``limits`` budget, default max_new_tokens) it holds pad_id.
        Seed torch (torch.manual_seed) before the call for reproducible samples."""
        b, P = input_ids.shape
        if b > self.B:
            raise ValueError(f"fastgen: batch {b} > engine batch {self.B}")
        self._check_prompts([P])
        mask = attention_mask.to(self.device).bool()
        lens = mask.sum(1)
        if (lens == 0).any() or not torch.equal(mask, torch.arange(P, device=self.device).unsqueeze(0) >= (P - lens).unsqueeze(1)):
            raise ValueError("fastgen: prompts must be left-padded (mask = zeros then ones) and non-empty")
        setup_s = self.prepare(eos_ids, pad_id, cfg, P)
        t1 = time.perf_counter()
        ids = torch.full((self.B, P), int(pad_id), dtype=torch.long, device=self.device)
        ids[:b] = input_ids.to(self.device)
        pad = torch.full((self.B,), P - 1, dtype=torch.long, device=self.device)  # dummy rows: 1 token
        pad[:b] = P - lens
        budget = torch.full((self.B,), self.max_new, dtype=torch.long, device=self.device)
        if limits is not None:
            budget[:b] = limits.to(self.device).clamp(1, self.max_new)
        self._start_rows(torch.arange(self.B, device=self.device), ids, pad, budget, cfg)
        self.unfinished[b:] = False
        self._sync()
        t2 = time.perf_counter()
        steps = 1
        for t in range(1, self.max_new):
            if (t == 1 or t % self.options.check_every == 0) and not bool(self.unfinished.any()):
                break
            self._decode(self._kv_len(P + t - 1), cfg)
            steps += 1
        self._sync()
        t3 = time.perf_counter()
        tokens = int(self.col[:b].sum())
        self.last_stats = {"setup_s": setup_s, "prefill_s": t2 - t1, "decode_s": t3 - t2, "steps": steps,
                           "decode_ms_per_step": 1e3 * (t3 - t2) / max(steps - 1, 1), "batch": b, "prompt": P,
                           "tokens": tokens, "occupancy": tokens / (steps * self.B)}
        self.last_logprobs = self.out_logp[:b].clone()
        return self.out[:b].clone()

    REFILL_WIDTH = 16  # a refill's prompts are left-padded to a multiple of this many slots

    def _refill_width(self, longest: int) -> int:
        return min(self.max_prompt, -(-longest // self.REFILL_WIDTH) * self.REFILL_WIDTH)

    @contextlib.contextmanager
    def _ragged_attention(self):
        """Decode attention as timed for rows at spread lengths (``ragged_attn``), for the duration."""
        if self.ragged_attn is None:
            yield
            return
        kept = self.attn, self.attn_cfg
        self.attn, self.attn_cfg = self.ragged_attn[0], dict(self.ragged_attn[1])
        try:
            yield
        finally:
            self.attn, self.attn_cfg = kept

    def generate_many(self, prompts: list[list[int]], cfg: SamplingConfig, eos_ids, pad_id: int,
                      limits: list[int] | None = None, refill_min: int | None = None, progress=None):
        """Continuous batching (see ``_generate_many``), with the decode attention timed for it."""
        with self._ragged_attention():
            return self._generate_many(prompts, cfg, eos_ids, pad_id, limits, refill_min, progress)

    @torch.no_grad()
    def _generate_many(self, prompts: list[list[int]], cfg: SamplingConfig, eos_ids, pad_id: int,
                       limits: list[int] | None = None, refill_min: int | None = None, progress=None):
        """Continuous batching: (responses, log-probs), one list per prompt in order, each response's tokens up to
        and with its EOS (no padding). The engine's rows start with the first prompts; every ``check_every``
        steps the rows that finished hand their tokens back and, once ``refill_min`` rows (default 1/32 of the
        batch: 8 of 256 was 2x faster than 32 on the H200, benchmarks/ragged.py) are free, take the next waiting prompts (prefilled into those rows alone: the other rows'
        caches and positions stay). A long response no longer holds a whole batch of short ones.
        Seed torch before the call for reproducible samples (they depend on the seed and the batch size).
        ``progress(line)`` gets a line whenever another batch's worth of responses has ended."""
        n, B, dev = len(prompts), self.B, self.device
        self._check_prompts([len(p) for p in prompts])
        budgets = [self.max_new] * n if limits is None else [max(1, min(int(x), self.max_new)) for x in limits]
        refill_min = max(1, B // 32 if refill_min is None else int(refill_min))
        setup_s = self.prepare(eos_ids, pad_id, cfg, min((len(p) for p in prompts), default=1), every_slot=True)
        self._reset_state()
        self.unfinished.fill_(False)
        self.out.fill_(int(pad_id))
        owner = [-1] * B  # the prompt each row is generating, -1: free
        waiting = list(range(n))[::-1]  # popped from the end: prompts in order
        responses: list = [None] * n
        logprobs: list = [None] * n
        prefill_s = decode_s = 0.0
        steps = refills = 0
        bound = 0  # an upper bound of every row's slot (the bucketed paths attend over slots [0, bound])
        ended = told = 0
        shapes: set = set()  # the refills' (rows, width)
        t_start = time.perf_counter()
        while True:
            free = [r for r in range(B) if owner[r] < 0]
            if waiting and free and (len(free) >= min(refill_min, len(waiting)) or len(free) == B):
                t0 = time.perf_counter()
                # Few distinct prefill shapes: per-shape work (an attention plan, say) is paid once a shape, 4 s of
                # the H200's first call. So a multiple of refill_min rows while more prompts wait than rows are
                # free (the rest at the next check), and the width rounded up to REFILL_WIDTH slots.
                k = min(len(free), len(waiting))
                if k < len(waiting):
                    k = max(1, k // refill_min) * refill_min
                take = free[:k]
                idx = [waiting.pop() for _ in take]
                width = self._refill_width(max(len(prompts[i]) for i in idx))
                shapes.add((len(take), width))
                ids = torch.full((len(idx), width), int(pad_id), dtype=torch.long)
                for j, i in enumerate(idx):
                    ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
                pad = torch.tensor([width - len(prompts[i]) for i in idx], dtype=torch.long, device=dev)
                self._start_rows(torch.tensor(take, device=dev), ids.to(dev), pad,
                                 torch.tensor([budgets[i] for i in idx], device=dev), cfg)
                for r, i in zip(take, idx):
                    owner[r] = i
                bound = max(bound, width)
                refills += 1
                self._sync()
                prefill_s += time.perf_counter() - t0
            if all(o < 0 for o in owner):
                break
            t0 = time.perf_counter()
            for _ in range(self.options.check_every):
                self._decode(self._kv_len(min(bound, self.T - 1)), cfg)
                bound += 1
                steps += 1
            done = (~self.unfinished).tolist()  # syncs
            decode_s += time.perf_counter() - t0
            rows = [r for r in range(B) if owner[r] >= 0 and done[r]]
            if rows:
                ix = torch.tensor(rows, device=dev)
                cols, out, logp = self.col[ix].tolist(), self.out[ix].cpu(), self.out_logp[ix].cpu()
                for j, r in enumerate(rows):
                    responses[owner[r]] = out[j, :cols[j]].tolist()
                    logprobs[owner[r]] = logp[j, :cols[j]].tolist()
                    owner[r] = -1
                ended += len(rows)
                if progress and (ended - told >= B or ended == n):
                    told = ended
                    dt = time.perf_counter() - t_start
                    tokens = sum(len(responses[i]) for i in range(n) if responses[i] is not None)
                    progress(f"generated {ended}/{n} sequences, {tokens} tokens, {tokens / max(dt, 1e-9):.0f} tok/s")
            bound = int(self.slot.max())
        tokens = sum(len(r) for r in responses)
        self.last_stats = {"setup_s": setup_s, "prefill_s": prefill_s, "decode_s": decode_s, "steps": steps,
                           "decode_ms_per_step": 1e3 * decode_s / max(steps, 1), "batch": B, "refills": refills,
                           "refill_shapes": len(shapes), "tokens": tokens, "occupancy": tokens / max(steps * B, 1)}
        return responses, logprobs


# ------------------------------------------------------------------------------------ the rollout entry


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model, batch_size: int, max_prompt_len: int, max_new_tokens: int,
               options: EngineOptions = EngineOptions()) -> FastGen:
    """A cached engine for this model object big enough for the request, with its weights' and cache's precision
    (weights re-read on reuse)."""
    eng = _ENGINES.pop(model, None)
    if (eng is not None and eng.B >= batch_size and eng.max_prompt >= max_prompt_len and eng.max_new == max_new_tokens
            and (eng.options.weights, eng.options.kv_cache) == (options.weights, options.kv_cache)):
        eng.refresh_weights()
        _ENGINES[model] = eng
        return eng
    if eng is not None:  # the old engine's cache and graphs go before the new one's come (two would not fit)
        cuda = _on_cuda(eng.device)
        del eng
        gc.collect()  # captured graphs hold their memory pool until the engine is collected
        if cuda:
            torch.cuda.empty_cache()
    eng = FastGen(model, batch_size, max_prompt_len, max_new_tokens, options)
    _ENGINES[model] = eng
    return eng


@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], cfg, device, seed: int, progress=None,
           timings: dict | None = None, logprobs: list | None = None) -> list[list[int]]:
    """Same contract as ``verlflow.core.ml.generate.sample`` (responses without padding, EOS kept), on the static engine.

    cfg: a RolloutSpec (temperature, top_p, top_k, max_new_tokens, micro_batch_size: the engine's rows, batching,
    weights, kv_cache).
    top_k=0 means off.
    The engine's set-up (building it, compiling, capturing graphs) is added to ``timings["setup_s"]``;
    ``logprobs`` (a list) gets each response's fp32 log-probs under the sampling logits, as from HF's path."""
    from verlflow.core.ml.generate import eos_ids as end_ids, in_micro_batches

    model.eval()
    eos_ids = sorted(end_ids(tok))
    scfg = SamplingConfig(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k or 0))
    mb = min(cfg.micro_batch_size, max(1, len(prompts)))
    width = max((len(p) for p in prompts), default=1)
    t0 = time.perf_counter()
    asked = EngineOptions(weights=getattr(cfg, "weights", "model"), kv_cache=getattr(cfg, "kv_cache", "model"))
    eng = engine_for(model, mb, width, cfg.max_new_tokens, asked)
    setup_s = [time.perf_counter() - t0]

    def generate(ids, mask):
        out = eng.generate(ids, mask, scfg, eos_ids, tok.pad_token_id)
        setup_s[0] += eng.last_stats["setup_s"]  # this micro-batch's compile and captures
        return out, eng.last_logprobs

    if getattr(cfg, "batching", "micro_batches") == "continuous":
        torch.manual_seed(seed)
        responses, lps = eng.generate_many(prompts, scfg, eos_ids, tok.pad_token_id, progress=progress)
        setup_s[0] += eng.last_stats["setup_s"]
        if logprobs is not None:
            logprobs.extend(lps)
    else:
        responses = in_micro_batches(generate, tok, prompts, cfg, seed, progress, logprobs)
    if timings is not None:
        timings["setup_s"] = timings.get("setup_s", 0.0) + setup_s[0]
    return responses
