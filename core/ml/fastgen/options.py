"""How a FastGen engine is asked to run, as plain data (driver or rank side; no torch).

``EngineOptions`` holds every switch an engine takes besides its model and shape. Each one is decided in one
place, ``resolved``: an "auto" or None becomes a concrete choice for the device, and the environment's A/B
variables (VERLFLOW_FASTGEN_*) fill what the caller left open. A bad value is refused there with the field's name."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

ATTN = ("bmm", "sdpa", "triton")
SAMPLERS = ("torch", "triton")


class Fp8Choices(NamedTuple):
    """rollout.weights=fp8's A/B switches. ``gemm``: "unit" (a unit-scaled GEMM, cuBLASLt's tensor-scaled kernels,
    the token and channel scales applied after it), "rowwise" (the row-scaled GEMM: its cuBLASLt kernel ran every
    decode projection at 1.5B on one 128x128 tile, slower than bf16 on the H200) or "autotune" (row-scaled, inductor
    may pick its Triton fp8 templates). ``fast_accum``: Hopper's fast fp8 accumulation."""

    gemm: str = "unit"
    fast_accum: bool = False

    @classmethod
    def from_env(cls) -> Fp8Choices:
        """Each switch from its variable: VERLFLOW_FASTGEN_FP8_GEMM, VERLFLOW_FASTGEN_FP8_FAST_ACCUM=1 (the
        benchmarks' A/Bs)."""
        env = os.environ
        return cls(gemm=env.get("VERLFLOW_FASTGEN_FP8_GEMM", "unit"),
                   fast_accum=env.get("VERLFLOW_FASTGEN_FP8_FAST_ACCUM") == "1")

    def checked(self) -> Fp8Choices:
        _one_of("fp8 gemm", self.gemm, ("unit", "rowwise", "autotune"))
        return self


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What a FastGen engine does besides its model and shape.

    How it runs:
      - ``graphs`` / ``compile``: the decode step as one CUDA graph; the layers through ``torch.compile``. None: on
        CUDA, unless VERLFLOW_FASTGEN_GRAPHS=0 / VERLFLOW_FASTGEN_COMPILE=0; off elsewhere.
      - ``compile_backend``: inductor (the tests count recompiles on a faster one); ``inductor``: extra inductor
        options, None: the JSON object in VERLFLOW_FASTGEN_INDUCTOR ('{"triton.enable_pdl": true}').
      - ``bucket``: sdpa's cache buckets, in slots (raised so there are at most 8); ``bucket_compile``: "dynamic"
        (one decode compile for every bucket) or "static" (one each, its length known to inductor: the 0.5B step
        was 2.69 ms dynamic, 2.01 static), None: VERLFLOW_FASTGEN_BUCKET_COMPILE or dynamic.
      - ``check_every``: decode steps between the host's looks for all rows finished; ``prefill_tokens``: prompt
        tokens a prefill chunk holds.
      - ``turn_cache``: multi-turn sources (``generate_turns``): a row whose turn ended keeps its cache for its
        trajectory's next turn, which goes on there, fed its new tokens (the observation, up to ``forced_tokens``)
        through the decode step instead of its whole context prefilled again; a row kept waiting longer than a
        prefill of its context would cost is given to another turn (turncache.py). ``prefill_cost``: a prefilled
        cache slot's cost in row-steps (one row of one decode step) for those choices; None: measured as it runs.
      - ``attn``: decode attention, "triton", "sdpa" or "bmm" (``FastGen``'s docstring); "auto": triton on CUDA with
        Triton (timed against sdpa), sdpa on CUDA without it (bmm for a soft-capped model), bmm elsewhere.
      - ``sampler``: "triton" or "torch" for the top-p passes; "auto": triton on CUDA with Triton. ``nucleus``: the
        Triton nucleus test, "two_pass" (each row's first candidate alone, then the rows it did not settle) or
        "one_pass" (147 us a step at 1.5B on the H200), None: VERLFLOW_FASTGEN_NUCLEUS or two_pass.
    What it computes:
      - ``weights``: "model" or "fp8" (e4m3 per output channel, activations per token); ``fp8``: fp8's A/B switches,
        None: from the environment (``Fp8Choices.from_env``).
      - ``kv_cache``: "model" or "fp8" (e4m3 with a scale per KV head and slot)."""

    graphs: bool | None = None
    compile: bool | None = None
    compile_backend: str = "inductor"
    inductor: dict | None = None
    bucket: int = 64
    bucket_compile: str | None = None
    check_every: int = 16
    prefill_tokens: int = 32768
    turn_cache: bool = True
    forced_tokens: int = 128
    prefill_cost: float | None = None
    attn: str = "auto"
    sampler: str = "auto"
    nucleus: str | None = None
    weights: str = "model"
    kv_cache: str = "model"
    fp8: Fp8Choices | None = None

    def numerics(self) -> EngineOptions:
        """These options with what the engine computes decided: the fp8 switches (from the environment when not
        given), checked. The weights are read with them, before the device-dependent rest is decided."""
        return dataclasses.replace(self, fp8=(self.fp8 or Fp8Choices.from_env()).checked())

    def resolved(self, *, cuda: bool, have_triton: bool, softcap: float, model_type: str) -> EngineOptions:
        """Every open choice made for this device and model, every value checked: nothing "auto" or None is left.
        ``softcap``: the model's attention logit soft-capping, which SDPA cannot apply."""
        env = os.environ
        graphs = (cuda and env.get("VERLFLOW_FASTGEN_GRAPHS", "1") != "0") if self.graphs is None else self.graphs
        compiled = (cuda and env.get("VERLFLOW_FASTGEN_COMPILE", "1") != "0") if self.compile is None else self.compile
        if graphs and not cuda:
            raise ValueError("graphs=True: CUDA graphs need a CUDA device")
        attn = self.attn
        if attn == "auto":
            attn = ("triton" if have_triton else ("bmm" if softcap else "sdpa")) if cuda else "bmm"
        _one_of("attn", attn, ("auto",) + ATTN)
        if attn == "sdpa" and softcap:
            raise ValueError(f"attn='sdpa' cannot apply attn_logit_softcapping={softcap} ({model_type}); use "
                             "attn='bmm', 'triton' or 'auto'")
        sampler = ("triton" if cuda and have_triton else "torch") if self.sampler == "auto" else self.sampler
        _one_of("sampler", sampler, ("auto",) + SAMPLERS)
        if "triton" in (attn, sampler) and not (have_triton and (cuda or env.get("TRITON_INTERPRET") == "1")):
            raise ValueError(f"attn={attn!r}, sampler={sampler!r}: 'triton' needs Triton and a CUDA device")
        done = dataclasses.replace(
            self.numerics(), graphs=graphs, compile=compiled, attn=attn, sampler=sampler,
            inductor=_inductor_from_env() if self.inductor is None else dict(self.inductor),
            bucket_compile=self.bucket_compile or env.get("VERLFLOW_FASTGEN_BUCKET_COMPILE", "dynamic"),
            nucleus=self.nucleus or env.get("VERLFLOW_FASTGEN_NUCLEUS", "two_pass"),
            check_every=max(1, int(self.check_every)), prefill_tokens=int(self.prefill_tokens),
            forced_tokens=int(self.forced_tokens),
            bucket=int(self.bucket))
        _one_of("bucket_compile" + ("" if self.bucket_compile else " (VERLFLOW_FASTGEN_BUCKET_COMPILE)"),
                done.bucket_compile, ("dynamic", "static"))
        _one_of("nucleus" + ("" if self.nucleus else " (VERLFLOW_FASTGEN_NUCLEUS)"), done.nucleus,
                ("two_pass", "one_pass"))
        if done.forced_tokens < 1:
            raise ValueError(f"forced_tokens must be at least 1, got {done.forced_tokens}")
        if done.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be at least 1, got {done.prefill_tokens}")
        return done


def _one_of(field: str, value, allowed: tuple):
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")


def _inductor_from_env() -> dict:
    """Inductor options from VERLFLOW_FASTGEN_INDUCTOR, a JSON object (an A/B hook: '{"triton.enable_pdl": true}',
    '{"max_autotune_gemm": true}')."""
    raw = os.environ.get("VERLFLOW_FASTGEN_INDUCTOR", "").strip()
    if not raw:
        return {}
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"VERLFLOW_FASTGEN_INDUCTOR is not JSON ({e}): give an object such as "
                         '\'{"triton.enable_pdl": true}\'') from e
    if not isinstance(opts, dict):
        raise ValueError(f"VERLFLOW_FASTGEN_INDUCTOR must be a JSON object of inductor options, got {raw!r}")
    return opts
