"""The start-up self-checks on the GPU the engine runs on: each Triton kernel against its torch path on small random
inputs (a mismatch turns the kernel off), and the fp8 matmul against its definition (a mismatch refuses the engine)."""

from __future__ import annotations

import logging

import torch

from verlflow.core.ml.fastgen.kernels import (block_stats_triton, combine_splits, decode_attention_triton,
                                              first_mass_triton, member_mass_triton, reference_decode_attention)
from verlflow.core.ml.fastgen.layers import FP8, FP8_MAX, PROJECTIONS, _fp8_linear, quantize_slots
from verlflow.core.ml.fastgen.sampling import _Stats

log = logging.getLogger("verlflow.fastgen")


def self_check(w, windows: list[int], options, tuned):
    """The Triton kernels ``tuned`` runs (and ``w``'s fp8 matmuls) against the torch paths; a failing kernel is
    turned off in ``tuned``, a failing fp8 matmul raises."""
    dev = w.device
    if w.fp8:
        try:  # fp8 matmuls are not on every GPU and torch build (some Blackwell parts lack the row-scaled one)
            err = fp8_error(w)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, ValueError or NotImplementedError
            raise RuntimeError(f"rollout.weights=fp8: torch._scaled_mm ({options.fp8.gemm}) fails on {dev} "
                               f"({e}); use rollout.weights=model") from e
        if not err < 1e-2:  # bf16 output rounding is ~4e-3; a wrong scale layout is off by O(1)
            raise RuntimeError(f"rollout.weights=fp8: torch._scaled_mm on this GPU differs from its reference "
                               f"(relative error {err:.3g}); use rollout.weights=model")
    if tuned.attn == "triton":
        failed = attn_failure(w, windows, tuned.attn_cfg)
        if failed is not None:
            fallback = "bmm" if w.spec.softcap else "sdpa"
            log.warning("fastgen: Triton decode attention failed its check (%s); using %s", failed, fallback)
            tuned.attn = fallback
    if tuned.ragged_attn is not None and tuned.ragged_attn[0] == "triton":
        failed = attn_failure(w, windows, tuned.ragged_attn[1])
        if failed is not None:
            log.warning("fastgen: Triton decode attention %s failed its check (%s); continuous batching uses %s",
                        tuned.ragged_attn[1], failed, tuned.attn)
            tuned.ragged_attn = None
    if tuned.sampler == "triton":
        try:
            _check_sampler(w)
        except Exception as e:  # noqa: BLE001
            log.warning("fastgen: Triton sampler failed its check (%s); using the torch sampler", e)
            tuned.sampler = "torch"


def attn_failure(w, windows: list[int], cfg: dict) -> str | None:
    """Why the Triton decode attention with configuration ``cfg`` is not to be used (None: it passed)."""
    try:
        err = attn_error(w, windows, cfg)
    except Exception as e:  # noqa: BLE001 - Triton's compile and launch errors vary by version
        return f"{type(e).__name__}: {e}"
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2  # fp32: IEEE dots, where TF32's error shows
    return None if err < tol else f"max abs error {err:.3g}, tolerance {tol:g}"  # (NaN fails too)


def attn_error(w, windows: list[int], cfg: dict) -> float:
    """The Triton decode attention with configuration ``cfg`` against the torch reference on small random
    inputs (rows of their own pad and slot), every variant the layers use (each of ``windows``, soft-cap): max abs
    error."""
    dev, dt = w.device, w.dtype
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
    for win in sorted(set(windows)):
        extra = dict(window=win, softcap=w.spec.softcap)
        got = combine_splits(*decode_attention_triton(q, kc, vc, pad, slot, w.scaling, w.nkv, **cfg, **extra,
                                                      **scales), w.nh // w.nkv)
        want = reference_decode_attention(q, kc, vc, pad, slot, w.scaling, **extra, **scales)
        errs.append((got - want).abs().max())
    return torch.stack(errs).max().item()  # NaN stays NaN (Python's max would drop it) and fails the check


def fp8_error(w) -> float:
    """The fp8 projections' matmul against its definition, x8 * sx @ (w8 * sw).T in fp32, on each quantized
    projection of layer 0 with random rows: the largest error relative to the output's largest value."""
    L, dev = w.layers[0], w.device
    g = torch.Generator(device=dev).manual_seed(1)
    errs = [torch.zeros((), device=dev)]
    for p in PROJECTIONS:
        w8, sw = L["w" + p], L["s" + p]
        if sw is None:
            continue
        x = torch.randn(5, w8.shape[1], generator=g, device=dev).to(w.dtype)
        got = _fp8_linear(x, w8, sw, None, w.spec.fp8_fast, w.spec.fp8_unit).float()
        sx = x.float().abs().amax(-1, keepdim=True) / FP8_MAX
        want = ((x.float() / sx).to(FP8).float() * sx) @ (w8.float() * sw.t()).t()
        errs.append((got - want).abs().max() / want.abs().max())
    return torch.stack(errs).max().item()  # NaN stays NaN and fails


def _check_sampler(w):
    """The Triton sampler's block stats and nucleus masses (both passes) against the torch path; raises if off."""
    dev, dt = w.device, w.dtype
    g = torch.Generator(device=dev).manual_seed(0)
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
