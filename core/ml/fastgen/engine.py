"""FastGen: the static-cache, CUDA-graph engine, and `sample`, the rollout stage's entry point.

FastGen is a façade over its parts: ``state.py`` (the KV cache and decode state), ``runner.py`` (the decode step and
the prefill), ``graphs.py`` (compile, capture, replay), ``autotune.py`` with ``checks.py`` (what runs: the attention
timing and the kernels' self-checks) and ``batching.py`` (micro-batches and continuous batching)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import weakref

import torch

from verlflow.core.ml.fastgen import autotune, batching, checks, graphs
from verlflow.core.ml.fastgen.autotune import Tuned
from verlflow.core.ml.fastgen.kernels import HAVE_TRITON
from verlflow.core.ml.fastgen.layers import _Weights
from verlflow.core.ml.fastgen.options import EngineOptions
from verlflow.core.ml.fastgen.runner import Runner
from verlflow.core.ml.fastgen.sampling import SamplingConfig
from verlflow.core.ml.fastgen.state import DecodeState

log = logging.getLogger("verlflow.fastgen")


def _of(part: str, *names: str) -> list[property]:
    """Attributes of one of the engine's parts, read and written through the engine (as its callers do)."""
    def through(name):
        return property(lambda self: getattr(getattr(self, part), name),
                        lambda self, value: setattr(getattr(self, part), name, value))
    return [through(name) for name in names]


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
    what the engine runs now (``self.tuned``): the attention timing, a failed self-check or a failed compile change
    them."""

    _ATTN_CONFIGS = autotune.ATTN_CONFIGS  # what attn="auto" times (read here by tests and benchmarks)

    attn, attn_cfg, sampler, compile, ragged_attn, attn_timings, ragged_timings = _of(
        "tuned", "attn", "attn_cfg", "sampler", "compile", "ragged_attn", "attn_timings", "ragged_timings")
    B, T, bucket, max_prompt, max_new, rope, windows = _of(
        "state", "B", "T", "bucket", "max_prompt", "max_new", "rope", "windows")
    kc, vc, ks, vs, slot, col, pos, unfinished = _of(
        "state", "kc", "vc", "ks", "vs", "slot", "col", "pos", "unfinished")

    def __init__(self, model, batch_size: int, max_prompt_len: int, max_new_tokens: int,
                 options: EngineOptions | None = None):
        asked = (options or EngineOptions()).numerics()
        self.w = _Weights(model, asked)
        self.device = self.w.device
        self.options = asked.resolved(cuda=graphs.on_cuda(self.device), have_triton=HAVE_TRITON,
                                      softcap=self.w.spec.softcap, model_type=model.config.model_type)
        self.tuned = Tuned(self.options.attn, self.options.sampler, self.options.compile)
        self.state = DecodeState(self.w, batch_size, max_prompt_len, max_new_tokens, self.options.bucket,
                                 self.options.forced_tokens if self.options.turn_cache else 1)
        self.runner = Runner(self.w, self.state, self.tuned, self.options)
        self.last_logprobs: torch.Tensor | None = None
        self.last_stats: dict = {}
        # where the set-up goes (logged by prepare): the kernel checks and attention timing (timing_s of checks_s),
        # the decode steps' compiles and captures, the refills' prefill compile
        self.setup_parts = {"checks_s": 0.0, "timing_s": 0.0, "captures": 0, "capture_s": 0.0, "refill_compile_s": 0.0}
        self.graphs = graphs.Graphs(self.device, self.setup_parts)
        self._refill_ready = False
        t0 = time.perf_counter()
        timing_s = autotune.tune(self.w, self.state, self.tuned, self.options, asked.attn == "auto",
                                 self._ATTN_CONFIGS)
        self.setup_parts["checks_s"] = round(time.perf_counter() - t0, 3)
        self.setup_parts["timing_s"] = round(timing_s, 3)

    def refresh_weights(self):
        self.w.refresh()

    # Without grad, as generation runs: dynamo guards on grad mode, and a set-up with grad on compiled graphs that
    # generation could not use (infra/bench/ragged.py compiled three again in its first micro-batches: 3 s, H200)
    @torch.no_grad()
    def prepare(self, eos_ids, pad_id: int, cfg: SamplingConfig, width: int, every_slot: bool = False) -> float:
        """Set the EOS ids and pad id; compile and capture what a generation from prompts of ``width`` slots needs
        (``every_slot``: what continuous batching may need). Returns the seconds it took (set-up, not generation)."""
        self.state.set_stop(eos_ids, pad_id)
        t0 = time.perf_counter()
        if self.options.graphs:  # warm-up steps draw random numbers: keep the caller's seed meaning the same
            rng = torch.cuda.get_rng_state(self.device)
            with self.tuned.ragged() if every_slot else contextlib.nullcontext():  # the steps it will replay
                self.warmup(width, cfg, every_slot)
            torch.cuda.set_rng_state(rng, self.device)
        if every_slot and self.compile and not self._refill_ready:  # the refills' prefill, compiled in the set-up
            self.setup_parts["refill_compile_s"] = self.runner.compile_refills()
            self._refill_ready = True
        graphs.sync(self.device)
        took = time.perf_counter() - t0
        if took > 0.05:
            log.info("fastgen: set-up %.1fs in prepare (%s)", took, self.setup_parts)
        return took

    def warmup(self, prompt_len: int, cfg: SamplingConfig, every_slot: bool = False):
        """Compile and capture every step a generate() with this prompt width will need (``every_slot``: every
        step any prompt may need, as continuous batching does: a capture mid-generation would reset the rows). A
        compile failure falls back to eager kernels (still captured), with a warning."""
        if self.options.graphs:
            graphs.capture_all(self._warm_kvs(prompt_len, every_slot), lambda kv: self._graph(kv, cfg),
                               self.compile, self._to_eager)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg: SamplingConfig,
                 eos_ids, pad_id: int, limits: torch.Tensor | None = None) -> torch.Tensor:
        """Responses (b, max_new_tokens) for left-padded prompts (b, P), all rows started together and run until
        the last one ends; after a row's EOS (or its ``limits`` budget, default max_new_tokens) it holds pad_id.
        Their log-probs are left in ``last_logprobs``. Seed torch (torch.manual_seed) before the call for
        reproducible samples."""
        out, logprobs, self.last_stats = batching.micro_batch(self, input_ids, attention_mask, cfg, eos_ids, pad_id,
                                                              limits)
        self.last_logprobs = logprobs
        return out

    def generate_many(self, prompts: list[list[int]], cfg: SamplingConfig, eos_ids, pad_id: int,
                      limits: list[int] | None = None, refill_min: int | None = None, progress=None):
        """Continuous batching (see ``batching.continuous``): (responses, log-probs), one list per prompt, with the
        decode attention timed for it."""
        with self.tuned.ragged():
            responses, logprobs, self.last_stats = batching.continuous(self, prompts, cfg, eos_ids, pad_id, limits,
                                                                       refill_min, progress)
        return responses, logprobs

    def generate_turns(self, source, cfg: SamplingConfig, eos_ids, pad_id: int, refill_min: int | None = None,
                       progress=None) -> dict:
        """Continuous batching over a TurnSource (see ``batching.continuous_turns``: each turn's tokens and log-probs
        go to ``source.done``), with the decode attention timed for it. Returns the stats."""
        with self.tuned.ragged():
            self.last_stats = batching.continuous_turns(self, source, cfg, eos_ids, pad_id, refill_min, progress)
        return self.last_stats

    # ---- the parts' hooks, through the engine (batching calls them; tests and benchmarks wrap and call them)

    def _start_rows(self, rows, ids, pad, limits, cfg: SamplingConfig):
        self.runner.start_rows(rows, ids, pad, limits, cfg)

    def _kv_len(self, slot: int) -> int:
        return self.state.kv_len(slot, self.attn)

    def _step(self, kv_len: int, cfg: SamplingConfig):
        self.runner.step(kv_len, cfg)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.runner.embed(ids)

    def _decode(self, kv_len: int, cfg: SamplingConfig):
        if not self.options.graphs:
            return self._step(kv_len, cfg)
        g = self.graphs.get(self.tuned.graph_key(kv_len, cfg))
        if g is None:  # capturing now would reset every row being generated: say so, never corrupt them
            raise RuntimeError(f"fastgen: no decode step was captured for kv_len={kv_len} ({self.attn} "
                               f"{self.attn_cfg}) before generation; the warm-up missed it (a bug)")
        g.replay()

    def _graph(self, kv_len: int, cfg: SamplingConfig) -> torch.cuda.CUDAGraph:
        """The captured decode step for this cache length (captured now, before generation, if it is new)."""
        key = self.tuned.graph_key(kv_len, cfg)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs.capture(key, lambda: self._step(kv_len, cfg), self.state.reset, f"kv_len={kv_len} {cfg}")
        return g

    def _warm_kvs(self, prompt_len: int, every_slot: bool) -> list[int]:
        return graphs.warm_kvs(self.state, self._kv_len, prompt_len, every_slot)

    def _to_eager(self):
        self.compile = False
        self.runner.set_fns(False)
        self.graphs.clear()
        torch.cuda.synchronize(self.device)

    def _self_check(self):
        checks.self_check(self.w, self.windows, self.options, self.tuned)

    def _fp8_error(self) -> float:
        return checks.fp8_error(self.w)

    def _pick_attention(self):
        autotune.pick_attention(self.w, self.state, self.tuned, self._ATTN_CONFIGS)

    def _choice(self) -> dict:
        return self.tuned.record()

    def _take_choice(self, kept: dict):
        self.tuned.take(kept)


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
        cuda = graphs.on_cuda(eng.device)
        del eng
        gc.collect()  # captured graphs hold their memory pool until the engine is collected
        if cuda:
            torch.cuda.empty_cache()
    eng = FastGen(model, batch_size, max_prompt_len, max_new_tokens, options)
    _ENGINES[model] = eng
    return eng


def _rollout_engine(model, tok, cfg, rows: int, width: int) -> tuple[FastGen, SamplingConfig, list[int], float]:
    """(engine, sampling config, EOS ids, seconds taken to build or reuse the engine) for a RolloutSpec ``cfg``:
    ``rows`` rows, prompts up to ``width`` tokens."""
    from verlflow.core.ml.generate import eos_ids as end_ids

    model.eval()
    scfg = SamplingConfig(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k or 0))
    t0 = time.perf_counter()
    asked = EngineOptions(weights=getattr(cfg, "weights", "model"), kv_cache=getattr(cfg, "kv_cache", "model"))
    eng = engine_for(model, rows, width, cfg.max_new_tokens, asked)
    return eng, scfg, sorted(end_ids(tok)), time.perf_counter() - t0


@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], cfg, device, seed: int, progress=None,
           timings: dict | None = None, logprobs: list | None = None) -> list[list[int]]:
    """Same contract as ``verlflow.core.ml.generate.sample`` (responses without padding, EOS kept), on the static engine.

    cfg: a RolloutSpec (temperature, top_p, top_k, max_new_tokens, micro_batch_size: the engine's rows, batching,
    weights, kv_cache).
    top_k=0 means off.
    The engine's set-up (building it, compiling, capturing graphs) is added to ``timings["setup_s"]``;
    ``logprobs`` (a list) gets each response's fp32 log-probs under the sampling logits, as from HF's path."""
    from verlflow.core.ml.generate import in_micro_batches

    mb = min(cfg.micro_batch_size, max(1, len(prompts)))
    width = max((len(p) for p in prompts), default=1)
    eng, scfg, eos_ids, built_s = _rollout_engine(model, tok, cfg, mb, width)
    setup_s = [built_s]

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


@torch.no_grad()
def sample_turns(model, tok, source, cfg, device, seed: int, max_context: int, timings: dict | None = None,
                 progress=None) -> dict:
    """Serve a TurnSource (core/agent/loop.py: multi-turn agent rollouts) on the static engine, by continuous
    batching: each turn's sampled ids (EOS kept) and their fp32 log-probs go to ``source.done``, as ``sample``
    gives them. ``max_context``: the longest context a turn may have (the trajectories' max_total_tokens): the
    engine's prompt width, a turn's whole trajectory being prefilled into its row. cfg and ``timings`` as for
    ``sample`` (each turn at most cfg.max_new_tokens, or its own smaller budget). Returns the engine's stats."""
    eng, scfg, eos_ids, built_s = _rollout_engine(model, tok, cfg, cfg.micro_batch_size, max_context)
    torch.manual_seed(seed)
    stats = eng.generate_turns(source, scfg, eos_ids, tok.pad_token_id, progress=progress)
    if timings is not None:
        timings["setup_s"] = timings.get("setup_s", 0.0) + built_s + stats["setup_s"]
    return stats
