"""Sampling with HF's warper semantics (temperature -> top_k -> top_p) without sorting the vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen.support import SUPPORTED_MODEL_TYPES  # noqa: F401 - re-exported
_REJECT_EPS = 1e-9  # P(no candidate accepted) per row per step, for full-vocabulary top_p
_MAX_CANDIDATES = 32  # above this (top_p < ~0.48) the sort path is used instead
_VBLOCK = 128  # vocabulary block of the two-level inverse CDF


# ----------------------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def candidates(self) -> int:
        """Candidates per row for full-vocabulary top_p rejection sampling (1 when top_p is off)."""
        if self.top_p >= 1.0:
            return 1
        return max(1, math.ceil(math.log(_REJECT_EPS) / math.log(1.0 - self.top_p)))

    def method(self, vocab: int) -> str:
        if self.greedy:
            return "greedy"
        if 0 < self.top_k < vocab:
            return "topk"
        if self.top_p < 1.0 and self.candidates() > _MAX_CANDIDATES:
            return "sort"
        return "reject"


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, nb, _VBLOCK), padded with -inf. Every full-vocabulary pass below reduces over a block
    first, so the kernels have B * nb independent rows of work instead of B long ones."""
    extra = (-x.shape[-1]) % _VBLOCK
    if extra:
        x = F.pad(x, (0, extra), value=float("-inf"))
    return x.view(x.shape[0], -1, _VBLOCK)


def _argmax_blocked(xb: torch.Tensor, bmax: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the row (first maximal index), from the block maxima and one gathered block."""
    B, nb, K = xb.shape
    blk = bmax.argmax(-1)  # first block holding the row maximum
    inner = xb.gather(1, blk.view(B, 1, 1).expand(B, 1, K)).squeeze(1).argmax(-1)
    return blk * K + inner


class _Stats:
    """One pass over the scaled logits: per-block max and partition sums, the row max m and total Z."""

    def __init__(self, x: torch.Tensor):
        self.xb = xb = _blocks(x)
        self.bmax = xb.amax(-1)  # (B, nb)
        bsum = torch.exp(xb - self.bmax.unsqueeze(-1)).sum(-1)  # NaN for an all -inf block
        self.m = self.bmax.amax(-1, keepdim=True)  # (B, 1)
        scale = torch.exp(self.bmax - self.m)  # 0 for an all -inf block
        self.bsum = torch.where(scale > 0, bsum * scale, 0.0)  # exp(x - m) summed per block
        self.z = self.bsum.sum(-1, keepdim=True)  # (B, 1)


def inverse_cdf(st: _Stats, u: torch.Tensor) -> torch.Tensor:
    """Indices drawn from softmax(x), one per uniform pair in u (B, C, 2): a block by the block masses, then a
    token of that block by its own cumulative sum (fp64 prefix sums; nothing is sorted)."""
    xb = st.xb
    B, nb, K = xb.shape
    C = u.shape[1]
    cb = st.bsum.double().cumsum(-1)  # (B, nb)
    r1 = u[..., 0].double() * cb[:, -1:]  # (B, C), < total
    blk = torch.searchsorted(cb, r1, right=True).clamp_(max=nb - 1)
    xs = xb.gather(1, blk.unsqueeze(-1).expand(B, C, K))  # (B, C, K)
    ws = torch.exp(xs - st.m.unsqueeze(-1)).double().cumsum(-1)
    r2 = u[..., 1].double().unsqueeze(-1) * ws[..., -1:]  # (B, C, 1), < block total
    j = torch.searchsorted(ws, r2, right=True).clamp_(max=K - 1).squeeze(-1)
    return blk * K + j


def nucleus_member(st: _Stats, cand: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, C) bool: is token cand[b, c] kept by HF's TopPLogitsWarper on these scores?

    HF sorts ascending and removes the tokens whose cumulative probability is <= 1 - top_p, so token i is kept
    iff the mass of the tokens with score <= x_i is > 1 - top_p (tied scores are kept together). One pass:
    per block, C masked sums (one fused reduction), then a sum over the blocks."""
    xb = st.xb
    B, nb, K = xb.shape
    xc = xb.view(B, nb * K).gather(1, cand)  # (B, C)
    w = torch.exp(xb - st.m.unsqueeze(-1))
    le = torch.stack([torch.where(xb <= xc[:, c].view(B, 1, 1), w, 0.0).sum(-1)
                      for c in range(cand.shape[1])], -1)  # (B, nb, C)
    return le.sum(1) > (1.0 - top_p) * st.z


def _first_accepted(cand: torch.Tensor, ok: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    first = ok.float().argmax(-1, keepdim=True)  # first True (0 when none)
    pick = cand.gather(1, first).squeeze(1)
    return torch.where(ok.any(-1), pick, fallback)


def topk_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) (descending), through the blocks: the k largest scores lie in the k blocks with the
    largest maxima, so only k * _VBLOCK scores per row are ranked."""
    B, V = x.shape
    xb = _blocks(x)
    nb = xb.shape[1]
    if k * _VBLOCK >= V or k > nb:
        return torch.topk(x, k, dim=-1)
    _, blk = torch.topk(xb.amax(-1), k, dim=-1)  # (B, k)
    cand = xb.gather(1, blk.unsqueeze(-1).expand(B, k, _VBLOCK)).reshape(B, k * _VBLOCK)
    vals, loc = torch.topk(cand, k, dim=-1)
    idx = blk.gather(1, loc // _VBLOCK) * _VBLOCK + loc % _VBLOCK
    return vals, idx


def topk_filter(x: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's TopK then TopP warpers, on the k survivors only: (values, -inf where removed; token ids), sorted
    by value descending. (HF also keeps tokens tied with the k-th value; here exactly k are ranked.)"""
    vals, idx = topk_values(x, top_k)
    if top_p < 1.0:
        asc = vals.flip(-1)
        cum = asc.softmax(-1).cumsum(-1)
        remove = cum <= (1.0 - top_p)
        remove[..., -1] = False  # min_tokens_to_keep=1
        vals = vals.masked_fill(remove.flip(-1), float("-inf"))
    return vals, idx


def _categorical_small(vals: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row from softmax(vals) (B, K) by inverse CDF; u (B,)."""
    w = torch.exp(vals - vals.amax(-1, keepdim=True)).double().cumsum(-1)
    r = u.double().unsqueeze(-1) * w[:, -1:]
    return torch.searchsorted(w, r, right=True).clamp_(max=vals.shape[-1] - 1).squeeze(-1)


def sample_logits(logits: torch.Tensor, cfg: SamplingConfig, u: torch.Tensor | None = None) -> torch.Tensor:
    """Next tokens (B,) from logits (B, V) in the model's dtype, with HF's warper semantics
    (temperature -> top_k -> top_p; greedy is argmax).

    u: uniforms (B, C, 2) with C = cfg.candidates() (drawn here when None); a captured graph passes its own."""
    if cfg.greedy:
        return logits.argmax(-1)  # (the block version, greedy(), is slower on the H200)
    x = logits.float()
    if cfg.temperature != 1.0:
        x = x / cfg.temperature
    B, V = x.shape
    method = cfg.method(V)
    if u is None:
        u = torch.rand(B, cfg.candidates(), 2, device=x.device)
    if method == "topk":
        vals, idx = topk_filter(x, cfg.top_k, cfg.top_p)
        return idx.gather(1, _categorical_small(vals, u[:, 0, 0]).unsqueeze(1)).squeeze(1)
    if method == "sort":
        sx, si = torch.sort(x, descending=True)
        vals = sx
        asc = vals.flip(-1)
        remove = asc.softmax(-1).cumsum(-1) <= (1.0 - cfg.top_p)
        remove[..., -1] = False
        vals = vals.masked_fill(remove.flip(-1), float("-inf"))
        return si.gather(1, _categorical_small(vals, u[:, 0, 0]).unsqueeze(1)).squeeze(1)
    st = _Stats(x)
    cand = inverse_cdf(st, u)  # (B, C)
    if cfg.top_p >= 1.0:
        return cand[:, 0]
    return _first_accepted(cand, nucleus_member(st, cand, cfg.top_p), _argmax_blocked(st.xb, st.bmax))


