"""What the engine runs (``Tuned``) and how start-up decides it (``tune``): the resolved options' attention, sampler
and compile, the decode attention attn="auto" times on CUDA (``pick_attention``; kept per machine and shape by
``choices``), and the self-checks (``checks``) that turn off a Triton kernel that fails them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen import checks, choices
from verlflow.core.ml.fastgen.graphs import on_cuda
from verlflow.core.ml.fastgen.kernels import decode_attention_triton
from verlflow.core.ml.fastgen.layers import read_cache
from verlflow.core.ml.fastgen.sampling import SamplingConfig

log = logging.getLogger("verlflow.fastgen")

# the Triton kernel's configurations attn="auto" times; "bounded" skips the blocks of slots with none valid
# (past the row's slot, before its pad or window); "splits" cuts each row's valid slots into that many runs, each one
# program's pipelined loop. Each candidate costs a fresh machine's first rollout a compile and a timing (about 1 s on
# an H100), so the list holds only configurations that won somewhere: the unbounded splits (the same loads, plus the
# empty blocks') were fastest in none of the timings kept (H200 and H100, 1.5B, bf16 and fp8 caches); they stay the
# kernel's default for attn="triton" chosen by hand.
ATTN_CONFIGS = ({"split_n": 64, "block_n": 64, "num_warps": 4, "bounded": True},
                {"split_n": 128, "block_n": 64, "num_warps": 4, "bounded": True},
                {"split_n": 256, "block_n": 64, "num_warps": 4, "bounded": True},
                {"splits": 2, "block_n": 64, "num_warps": 4},
                {"splits": 2, "block_n": 32, "num_warps": 4, "num_stages": 4})


@dataclasses.dataclass
class Tuned:
    """What the engine runs now: the resolved options' ``attn``, ``sampler`` and ``compile``, which the attention
    timing, a failed self-check or a failed compile change; the Triton configuration ``attn_cfg`` and the timings."""

    attn: str
    sampler: str
    compile: bool
    attn_cfg: dict = dataclasses.field(default_factory=dict)
    attn_timings: dict = dataclasses.field(default_factory=dict)
    # continuous batching's decode attention, where timing chose another: its rows sit at spread lengths, and
    # sdpa reads the bucket of the longest for every row while the Triton kernel reads each row's own slots
    ragged_attn: tuple[str, dict] | None = None
    ragged_timings: dict = dataclasses.field(default_factory=dict)

    def record(self) -> dict:
        """The timed attention choices, as kept in the machine's cache folder (the spread-lengths timings even when
        their choice is the one-length one)."""
        ragged = None if self.ragged_attn is None else {"attn": self.ragged_attn[0], "cfg": self.ragged_attn[1]}
        return {"attn": self.attn, "cfg": self.attn_cfg, "timings": self.attn_timings, "ragged": ragged,
                "ragged_timings": self.ragged_timings}

    def take(self, kept: dict):
        """The choices of a ``record()`` (read back from JSON)."""
        self.attn, self.attn_cfg = kept["attn"], dict(kept.get("cfg") or {})
        self.attn_timings = dict(kept.get("timings") or {})
        self.ragged_timings = dict(kept.get("ragged_timings") or {})
        ragged = kept.get("ragged")
        if isinstance(ragged, dict) and ragged.get("attn") in ("sdpa", "triton"):
            self.ragged_attn = (ragged["attn"], dict(ragged.get("cfg") or {}))

    @contextlib.contextmanager
    def ragged(self):
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

    def graph_key(self, kv_len: int, cfg: SamplingConfig) -> tuple:
        """What a captured decode step is specialised to."""
        return kv_len, cfg, self.attn, tuple(sorted(self.attn_cfg.items()))


def tune(w, state, tuned: Tuned, options, auto: bool, configs: tuple) -> float:
    """Start-up on CUDA: under attn="auto" (``auto``) what this shape timed on this machine before, else the timing
    of ``configs`` (kept for the next engine); before timing, the self-checks of the Triton kernels in use. Returns
    the seconds the timing took (0 when none ran)."""
    cuda = on_cuda(w.device)
    timing_key = None
    if cuda and auto and tuned.attn == "triton":  # what this shape timed on this machine before
        timing_key = choices.key(w.device, rows=state.B, slots=state.T, bucket=state.bucket, heads=w.nh,
                                 kv_heads=w.nkv, head_dim=w.hd, dtype=w.dtype, windows=sorted(set(state.windows)),
                                 softcap=w.spec.softcap,
                                 configs=configs,  # a new candidate is timed, not passed over
                                 kv_cache="fp8" if w.spec.kv8 else "model")
        kept = choices.load(timing_key)
        if kept is not None:
            tuned.take(kept)
            log.info("fastgen: decode attention %s %s (continuous batching: %s), as timed before on this "
                     "machine (%s)", tuned.attn, tuned.attn_cfg, tuned.ragged_attn, choices.where())
            timing_key = None
    if cuda and ("triton" in (tuned.attn, tuned.sampler, (tuned.ragged_attn or ("",))[0]) or w.fp8):
        checks.self_check(w, state.windows, options, tuned)
    if timing_key is not None and tuned.attn == "triton":  # (a Triton kernel that failed its check is not timed)
        t0 = time.perf_counter()
        pick_attention(w, state, tuned, configs)
        timing_s = time.perf_counter() - t0
        if tuned.attn_timings:
            choices.store(timing_key, tuned.record())
        return timing_s
    return 0.0


def pick_attention(w, state, tuned: Tuned, configs: tuple):
    """attn="auto" on CUDA: time one layer's decode attention, replayed from CUDA graphs, for the Triton kernel's
    ``configs`` and for sdpa over its cache bucket; keep the fastest. Twice: every row at one mid-generation slot (a
    micro-batch), and rows at slots spread over the whole cache (continuous batching, where sdpa's bucket is the
    longest row's: ``ragged_attn`` when that choice differs)."""
    try:
        B, T, dev = state.B, state.T, w.device
        cur = min(T - 2, state.max_prompt + state.max_new // 2)
        q = torch.randn(B, w.nh, w.hd, device=dev).to(w.dtype)
        kc, vc, ks, vs = state.kT[0], state.vT[0], state.ks[0], state.vs[0]
        pad = torch.zeros(B, dtype=torch.long, device=dev)
        spread = torch.linspace(min(state.max_prompt, T - 2), T - 2, B, device=dev).long()
        scenarios = {  # (each row's slot, the slots sdpa reads)
            "uniform": (torch.full((B,), cur, device=dev), min(T, (cur // state.bucket + 1) * state.bucket)),
            "ragged": (spread[torch.randperm(B, device=dev)], T)}
        variant = dict(window=state.windows[0], softcap=w.spec.softcap)  # layer 0's kernel
        ok_cfgs = []
        for i, cfg in enumerate(configs):  # only a configuration that computes attention is timed
            failed = checks.attn_failure(w, state.windows, cfg)
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
            picked[name] = (("sdpa", {}) if best == "sdpa" else ("triton", dict(configs[int(best[6:])])),
                            {k: round(v, 1) for k, v in times.items()})
        (tuned.attn, tuned.attn_cfg), tuned.attn_timings = picked["uniform"]
        ragged, tuned.ragged_timings = picked["ragged"]
        tuned.ragged_attn = None if ragged == (tuned.attn, tuned.attn_cfg) else ragged
        log.info("fastgen: decode attention %s %s (us per layer: %s); continuous batching: %s (us: %s)", tuned.attn,
                 tuned.attn_cfg, tuned.attn_timings, ragged, tuned.ragged_timings)
    except Exception as e:  # noqa: BLE001
        log.warning("fastgen: attention timing failed (%s); keeping %s", e, tuned.attn)
