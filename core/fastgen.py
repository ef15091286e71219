"""A fast sampler for Hugging Face Llama / Qwen2-family causal LMs (the rollout engine "static").

What it does, against ``model.generate``:

* reads the HF model's own weights (q/k/v and gate/up fused into one matrix each, copied once; the rest by
  reference) and runs its own forward: no HF cache objects, no per-step mask building;
* a static KV cache of (batch, kv_heads, max_prompt + max_new_tokens, head_dim) per layer, filled by one
  left-padded prefill; every decode step writes one slot (the same slot for every row: rows are left-padded,
  so row b's valid slots are [pad_b, slot]) and masks by that per-row range;
* decode attention never expands the shared K/V heads (HF's StaticCache path copied them to all query heads
  over the whole cache, every layer, every step). Three implementations, picked per engine: "sdpa"
  (F.scaled_dot_product_attention with enable_gqa over a *bucket* of the cache: the first multiple of
  ``bucket`` slots holding the current slot, one captured step per bucket), "triton" (our split-KV kernel:
  the group's query heads against their KV head, valid slots only, one captured step for every length),
  "bmm" (q viewed as (B, kv_heads, group, D) times the cache's (B, kv_heads, T, D); the CPU path). With
  attn="auto" on CUDA the engine times sdpa and the Triton configurations once and keeps the fastest;
* on CUDA the whole decode step (embedding, all layers, head, sampling, EOS bookkeeping, state advance) is
  one CUDA graph replayed with no host input; the per-layer functions, the head and the prefill are
  ``torch.compile``d (no cudagraph trees: we capture ourselves) so elementwise work is fused;
* sampling matches HF's warpers (temperature -> top_k -> top_p) without sorting the vocabulary:
  - greedy: argmax;
  - top_k: the k largest through the block maxima (only k blocks of 128 are ranked), then HF's top-p on the
    k survivors (sorting k values, not the vocabulary);
  - full-vocabulary top_p: exact rejection sampling. Draw C candidates from softmax(x) by a two-level inverse
    CDF (block sums, then one block), keep the first one that lies in the nucleus: token i is in HF's nucleus
    iff the mass of tokens with logit <= x_i exceeds 1 - top_p (one pass for all C candidates; on CUDA the
    block sums and that pass are Triton kernels, ``sampler="triton"``). The
    first accepted candidate of iid draws from p is distributed as p restricted to the nucleus, exactly.
    C is chosen so that P(all C rejected) = (1 - top_p)^C <= 1e-9; in that case the argmax (always in the
    nucleus) is taken. Tied logits at the nucleus boundary are kept together (HF keeps an arbitrary subset);
  - finished rows emit ``pad_id`` (HF's rule) and are checked for EOS; every ``check_every`` steps the host
    looks whether all rows finished and stops early. Nothing recompiles when rows finish.

On CPU (the tests) the same code runs eagerly, step by step, with no graphs and no compile.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("verlflow.fastgen")

try:  # the CUDA kernels below; CPU runs (the tests) use the torch paths
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None
    HAVE_TRITON = False

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
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


# ------------------------------------------------------------------------------------- Triton kernels
#
# Used on CUDA only. Each is checked against its torch counterpart when an engine starts (``_self_check``);
# a mismatch turns it off for that engine, with a warning.

if HAVE_TRITON:

    @triton.jit
    def _decode_attn_kernel(Q, K, V, PAD, SLOT, MP, LP, OP, scale,
                            sqb, sqh, skb, skh, skt, NKV, NSPLIT,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr):
        """One (row, KV head, split of the cache): the group's G query heads against the shared K/V head,
        valid slots only ([pad_b, slot]); writes the split's running max, sum and unnormalised output."""
        pid = tl.program_id(0)
        sp = tl.program_id(1)
        b = pid // NKV
        h = pid % NKV
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + d[None, :], mask=(g < G)[:, None], other=0.0)
        pad = tl.load(PAD + b).to(tl.int32)
        cur = tl.load(SLOT).to(tl.int32)
        m_i = tl.zeros([GP], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        base = b * skb + h * skh
        for n0 in range(0, SPLIT_N, BLOCK_N):  # masked loads of invalid slots fetch nothing
            n = sp * SPLIT_N + n0 + tl.arange(0, BLOCK_N)
            ok = (n >= pad) & (n <= cur)
            k = tl.load(K + base + n[:, None] * skt + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(V + base + n[:, None] * skt + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = (pid * NSPLIT + sp) * G  # only the G real query rows go out
        tl.store(MP + row + g, m_i, mask=g < G)
        tl.store(LP + row + g, l_i, mask=g < G)
        tl.store(OP + (row + g)[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])

    @triton.jit
    def _block_stats_kernel(X, sxb, V, inv_t, BMAX, BSUM, NB, BPP: tl.constexpr, BLK: tl.constexpr):
        """Per vocabulary block of BLK scores (x * inv_t): the max and sum(exp(x - max))."""
        b = tl.program_id(0)
        blk = tl.program_id(1) * BPP + tl.arange(0, BPP)
        offs = blk[:, None] * BLK + tl.arange(0, BLK)[None, :]
        x = tl.load(X + b * sxb + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        bm = tl.max(x, 1)
        bs = tl.sum(tl.exp(x - bm[:, None]), 1)
        bs = tl.where(bm == float("-inf"), 0.0, bs)
        tl.store(BMAX + b * NB + blk, bm, mask=blk < NB)
        tl.store(BSUM + b * NB + blk, bs, mask=blk < NB)

    @triton.jit
    def _member_kernel(X, sxb, V, inv_t, M, XC, LE, NCH, C: tl.constexpr, CP: tl.constexpr,
                       CHUNK: tl.constexpr, SUB: tl.constexpr):
        """For each candidate c of the row: sum of exp(x * inv_t - m) over this chunk's tokens whose raw
        score is <= the candidate's raw score."""
        b = tl.program_id(0)
        ch = tl.program_id(1)
        ci = tl.arange(0, CP)
        xc = tl.load(XC + b * C + ci, mask=ci < C, other=float("-inf")).to(tl.float32)
        m = tl.load(M + b)
        acc = tl.zeros([SUB, CP], dtype=tl.float32)
        for s0 in range(0, CHUNK, SUB):
            offs = ch * CHUNK + s0 + tl.arange(0, SUB)
            xr = tl.load(X + b * sxb + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            w = tl.exp(xr * inv_t - m)
            acc += tl.where(xr[:, None] <= xc[None, :], w[:, None], 0.0)
        tl.store(LE + (b * NCH + ch) * CP + ci, tl.sum(acc, 0))  # one cross-thread reduction per program


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def decode_attention_triton(q, kc, vc, pad_off, slot, scale: float, nkv: int, split_n: int = 64,
                            block_n: int = 64, num_warps: int = 4):
    """Partial results of decode attention (see ``_decode_attn_kernel``): (m, l, o) per split, for
    ``combine_splits``. q (B, nh, D); kc/vc (B, nkv, T, D), last dim contiguous."""
    B, nh, D = q.shape
    T = kc.shape[2]
    G = nh // nkv
    GP = max(16, _pow2(G))
    ns = triton.cdiv(T, split_n)
    mp = torch.empty(B, nkv, ns, G, dtype=torch.float32, device=q.device)
    lp = torch.empty_like(mp)
    op = torch.empty(B, nkv, ns, G, D, dtype=torch.float32, device=q.device)
    _decode_attn_kernel[(B * nkv, ns)](
        q, kc, vc, pad_off, slot, mp, lp, op, scale, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2), nkv, ns, G=G, GP=GP, D=D, SPLIT_N=split_n, BLOCK_N=block_n, num_warps=num_warps)
    return mp, lp, op


def reference_decode_attention(q, kc, vc, pad_off, slot, scale: float) -> torch.Tensor:
    """What the kernel computes, in fp32 torch: (B, nh * D)."""
    B, nh, D = q.shape
    nkv, T = kc.shape[1], kc.shape[2]
    t = torch.arange(T, device=q.device)
    ok = (t[None] >= pad_off[:, None]) & (t[None] <= slot)
    s = torch.matmul(q.float().view(B, nkv, nh // nkv, D), kc.float().transpose(-1, -2)) * scale
    p = s.masked_fill(~ok[:, None, None], float("-inf")).softmax(-1)
    return torch.matmul(p, vc.float()).reshape(B, nh * D)


def combine_splits(mp, lp, op, G: int) -> torch.Tensor:
    """(B, nkv, S, G[, D]) partials -> attention output (B, nkv * G * D) in fp32."""
    B, nkv, _, _, D = op.shape
    w = torch.exp(mp - mp.amax(2, keepdim=True))  # empty splits: exp(-1e30 - max) = 0
    den = (w * lp).sum(2)
    num = (w.unsqueeze(-1) * op).sum(2)
    return (num / den.unsqueeze(-1)).reshape(B, nkv * G * D)


def block_stats_triton(logits: torch.Tensor, temperature: float, bpp: int = 16):
    B, V = logits.shape
    nb = triton.cdiv(V, _VBLOCK)
    bmax = torch.empty(B, nb, dtype=torch.float32, device=logits.device)
    bsum = torch.empty_like(bmax)
    _block_stats_kernel[(B, triton.cdiv(nb, bpp))](logits, logits.stride(0), V, 1.0 / temperature, bmax, bsum,
                                                   nb, BPP=bpp, BLK=_VBLOCK)
    return bmax, bsum


def member_mass_triton(logits, temperature: float, m, xc, chunk: int = 2048, sub: int = 1024, num_warps: int = 8):
    """(B, C): mass exp(x/T - m) of the tokens whose raw logit is <= each candidate's raw logit xc (B, C)."""
    B, V = logits.shape
    C = xc.shape[1]
    CP = _pow2(C)
    nch = triton.cdiv(V, chunk)
    le = torch.empty(B, nch, CP, dtype=torch.float32, device=logits.device)
    _member_kernel[(B, nch)](logits, logits.stride(0), V, 1.0 / temperature, m, xc.contiguous(), le, nch,
                             C=C, CP=CP, CHUNK=chunk, SUB=sub, num_warps=num_warps)
    return le.sum(1)[:, :C]


def _cands_from_stats(logits, bmax, bsum_local, u, temperature: float):
    """The small part of the Triton sampler: from block stats to C candidates (two-level inverse CDF), their
    raw logits, the row max m, the total mass z, and the argmax (fallback)."""
    B, V = logits.shape
    m = bmax.amax(-1, keepdim=True)
    scale = torch.exp(bmax - m)
    bsum = torch.where(scale > 0, bsum_local * scale, 0.0)
    z = bsum.sum(-1, keepdim=True)
    xb = _blocks(logits)
    nb, K = xb.shape[1], xb.shape[2]
    C = u.shape[1]
    cb = bsum.double().cumsum(-1)
    r1 = u[..., 0].double() * cb[:, -1:]
    blk = torch.searchsorted(cb, r1, right=True).clamp_(max=nb - 1)
    xs = xb.gather(1, blk.unsqueeze(-1).expand(B, C, K)).float() * (1.0 / temperature)
    ws = torch.exp(xs - m.unsqueeze(-1)).double().cumsum(-1)
    r2 = u[..., 1].double().unsqueeze(-1) * ws[..., -1:]
    j = torch.searchsorted(ws, r2, right=True).clamp_(max=K - 1).squeeze(-1)
    cand = blk * K + j
    xc = xb.reshape(B, nb * K).gather(1, cand)
    top = bmax.argmax(-1)
    inner = xb.gather(1, top.view(B, 1, 1).expand(B, 1, K)).squeeze(1).argmax(-1)
    return cand, xc, m.squeeze(-1).contiguous(), z, top * K + inner


def _pick(cand, le, z, fallback, top_p: float):
    return _first_accepted(cand, le > (1.0 - top_p) * z, fallback)


def sample_logits_triton(logits, cfg: SamplingConfig, u, cands_fn=_cands_from_stats, pick_fn=_pick):
    """``sample_logits`` for the "reject" method with the two full-vocabulary passes as Triton kernels."""
    bmax, bsl = block_stats_triton(logits, cfg.temperature)
    cand, xc, m, z, fallback = cands_fn(logits, bmax, bsl, u, cfg.temperature)
    if cfg.top_p >= 1.0:
        return cand[:, 0]
    le = member_mass_triton(logits, cfg.temperature, m, xc)
    return pick_fn(cand, le, z, fallback, cfg.top_p)


# ------------------------------------------------------------------------------------------------ model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's Llama/Qwen2 RMSNorm, operation for operation
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def _rot(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _mlp(h, wgu, bgu, wdown, bdown):
    g, u = F.linear(h, wgu, bgu).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, wdown, bdown)


def _pre_attn(x, ln1, wqkv, bqkv, kc, vc, slot, cos, sin, eps: float, nh: int, nkv: int, hd: int):
    """Norm, q/k/v, rotary, and this step's K/V into the cache at ``slot``; returns q (B, nh, hd)."""
    B = x.shape[0]
    h = _rms(x, ln1, eps)
    q, k, v = F.linear(h, wqkv, bqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = q.view(B, nh, hd)
    k = k.view(B, nkv, hd)
    v = v.view(B, nkv, hd)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * c + _rot(q) * s
    k = k * c + _rot(k) * s
    kc.index_copy_(2, slot, k.unsqueeze(2))
    vc.index_copy_(2, slot, v.unsqueeze(2))
    return q.contiguous()


def _post_attn(x, mp, lp, op, wo, bo, ln2, wgu, bgu, wdown, bdown, eps: float, G: int):
    """Merge the attention splits, output projection, MLP (both residuals)."""
    o = combine_splits(mp, lp, op, G).to(x.dtype)
    x = x + F.linear(o, wo, bo)
    return x + _mlp(_rms(x, ln2, eps), wgu, bgu, wdown, bdown)


def _prefill_layer(x, ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wdown, bdown, cos, sin, mask,
                   eps: float, nh: int, nkv: int, hd: int, scaling: float):
    """One decoder layer over left-padded prompts x (n, P, H); returns (x, k, v) with k/v (n, nkv, P, hd)."""
    n, P, _ = x.shape
    h = _rms(x, ln1, eps)
    q, k, v = F.linear(h, wqkv, bqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
    q = q.view(n, P, nh, hd).transpose(1, 2)
    k = k.view(n, P, nkv, hd).transpose(1, 2)
    v = v.view(n, P, nkv, hd).transpose(1, 2)
    q = q * cos + _rot(q) * sin
    k = k * cos + _rot(k) * sin
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    x = x + F.linear(o.transpose(1, 2).reshape(n, P, nh * hd), wo, bo)
    x = x + _mlp(_rms(x, ln2, eps), wgu, bgu, wdown, bdown)
    return x, k, v


def _logits(x, norm_w, lm_w, eps: float):
    return F.linear(_rms(x, norm_w, eps), lm_w)


def _decode_layer(x, ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wdown, bdown, kc, vc, slot, cos, sin, bias,
                  eps: float, nh: int, nkv: int, hd: int, scaling: float, kv_len: int, attn: str = "bmm"):
    """One decoder layer for one new token per row. x (B, H); kc/vc (B, nkv, T, hd) written at ``slot``
    (a (1,) long tensor); bias (B, kv_len) float: 0 where the slot is valid for the row, -inf elsewhere."""
    B = x.shape[0]
    q = _pre_attn(x, ln1, wqkv, bqkv, kc, vc, slot, cos, sin, eps, nh, nkv, hd)
    K = kc[:, :, :kv_len]
    V = vc[:, :, :kv_len]
    if attn == "sdpa":
        o = F.scaled_dot_product_attention(q.unsqueeze(2), K, V, attn_mask=bias[:, None, None, :].to(q.dtype),
                                           scale=scaling, enable_gqa=True)  # (B, nh, 1, hd)
    else:
        qg = q.view(B, nkv, nh // nkv, hd)  # query heads grouped under their shared KV head
        sc = torch.matmul(qg, K.transpose(-1, -2)) * scaling  # (B, nkv, g, T)
        p = (sc.float() + bias[:, None, None, :]).softmax(-1).to(q.dtype)
        o = torch.matmul(p, V)  # (B, nkv, g, hd)
    x = x + F.linear(o.reshape(B, nh * hd), wo, bo)
    h = _rms(x, ln2, eps)
    return x + _mlp(h, wgu, bgu, wdown, bdown)


def _bias_of(x: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor | None:
    return x.detach() if x is not None else (None if n == 0 else torch.zeros(n, dtype=like.dtype, device=like.device))


class _Weights:
    """The model's tensors in the layout the engine wants; fused matrices are copies (``refresh`` re-copies)."""

    def __init__(self, model):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"rollout.engine=static supports model types {SUPPORTED_MODEL_TYPES}, "
                             f"not {getattr(cfg, 'model_type', None)!r}; use rollout.engine=hf")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("rollout.engine=static: sliding-window attention is not supported; use engine=hf")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"rollout.engine=static: hidden_act {cfg.hidden_act!r} is not supported")
        self.model = model
        base = model.model
        self.base = base
        rope = getattr(base.rotary_emb, "rope_type", "default")
        if rope in ("dynamic", "longrope"):
            raise ValueError(f"rollout.engine=static: rope_type {rope!r} depends on the length; use engine=hf")
        a0 = base.layers[0].self_attn
        for extra in ("q_norm", "k_norm"):
            if hasattr(a0, extra):
                raise ValueError(f"rollout.engine=static: attention with {extra} is not supported")
        self.hd = a0.head_dim
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.scaling = float(getattr(a0, "scaling", self.hd ** -0.5))
        self.eps = float(base.layers[0].input_layernorm.variance_epsilon)
        self.norm_eps = float(base.norm.variance_epsilon)
        self.hidden = cfg.hidden_size
        self.n_layers = len(base.layers)
        self.embed = base.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.vocab = model.lm_head.weight.shape[0]
        self.layers: list[dict] = []
        self.refresh()

    @torch.no_grad()
    def refresh(self):
        """(Re)read the model's weights; fused matrices are copied in place so captured graphs stay valid."""
        base, model = self.base, self.model
        for name, t in (("embed", base.embed_tokens.weight), ("norm_w", base.norm.weight),
                         ("lm_w", model.lm_head.weight)):
            old = getattr(self, name, None)
            if old is not None and old.data_ptr() != t.data_ptr():
                old.copy_(t.detach())
            else:
                setattr(self, name, t.detach())
        new = []
        for layer in base.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            wqkv = torch.cat([p.weight.detach() for p in qkv])
            bqkv = None
            if any(p.bias is not None for p in qkv):
                bqkv = torch.cat([_bias_of(p.bias, p.weight.shape[0], p.weight) for p in qkv])
            wgu = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
            bgu = None
            if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
                bgu = torch.cat([_bias_of(p.bias, p.weight.shape[0], p.weight) for p in (mlp.gate_proj, mlp.up_proj)])
            new.append(dict(
                ln1=layer.input_layernorm.weight.detach(), wqkv=wqkv, bqkv=bqkv,
                wo=a.o_proj.weight.detach(), bo=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                ln2=layer.post_attention_layernorm.weight.detach(), wgu=wgu, bgu=bgu,
                wdown=mlp.down_proj.weight.detach(),
                bdown=None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach()))
        if self.layers:  # keep the addresses graphs captured
            for old, fresh in zip(self.layers, new):
                for key, t in fresh.items():
                    if t is not None and old[key] is not None and old[key].data_ptr() != t.data_ptr():
                        old[key].copy_(t)
                    else:
                        old[key] = t
        else:
            self.layers = new

    def nbytes_step(self) -> int:
        """Weight bytes one decode step reads (everything but the embedding table, which is gathered)."""
        n = self.lm_w.numel() + self.norm_w.numel()
        for L in self.layers:
            n += sum(t.numel() for t in L.values() if t is not None)
        return n * self.lm_w.element_size()


# ----------------------------------------------------------------------------------------------- engine


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


class FastGen:
    """A reusable generator for one model: static cache and captured decode steps for up to ``batch_size``
    rows, prompts up to ``max_prompt_len`` and ``max_new_tokens`` new tokens.

    ``use_graphs`` / ``compile`` default to True on CUDA and False elsewhere (env VERLFLOW_FASTGEN_GRAPHS=0 /
    VERLFLOW_FASTGEN_COMPILE=0 turn them off). Decode attention (``attn``), none of which expands the
    shared K/V heads: "triton" (our split-KV kernel: the group's query heads against their KV head, valid
    slots [pad_b, slot] only, so one captured step serves every length), "sdpa"
    (F.scaled_dot_product_attention with enable_gqa over a bucket of the cache), "bmm" (q viewed as
    (B, kv_heads, group, D), matmul against the cache's heads, over a bucket); "auto": triton on CUDA when
    Triton is installed, else sdpa on CUDA, bmm elsewhere. ``sampler``: "triton" (the two full-vocabulary
    passes of the top_p/temperature sampler as Triton kernels) or "torch"; "auto": triton on CUDA."""

    def __init__(self, model, batch_size: int, max_prompt_len: int, max_new_tokens: int, *,
                 use_graphs: bool | None = None, compile: bool | None = None, bucket: int = 64,
                 check_every: int = 16, attn: str = "auto", sampler: str = "auto", prefill_tokens: int = 32768):
        self.w = _Weights(model)
        self.device = self.w.device
        cuda = _on_cuda(self.device)
        env = os.environ
        self.use_graphs = (cuda and env.get("VERLFLOW_FASTGEN_GRAPHS", "1") != "0") if use_graphs is None else use_graphs
        self.compile = (cuda and env.get("VERLFLOW_FASTGEN_COMPILE", "1") != "0") if compile is None else compile
        if self.use_graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        attn_auto = attn == "auto"
        if attn == "auto":
            attn = ("triton" if HAVE_TRITON else "sdpa") if cuda else "bmm"
        if attn not in ("bmm", "sdpa", "triton"):
            raise ValueError(f"attn must be 'auto', 'bmm', 'sdpa' or 'triton', got {attn!r}")
        if sampler == "auto":
            sampler = "triton" if (cuda and HAVE_TRITON) else "torch"
        if sampler not in ("torch", "triton"):
            raise ValueError(f"sampler must be 'auto', 'torch' or 'triton', got {sampler!r}")
        if "triton" in (attn, sampler) and not (HAVE_TRITON and (cuda or os.environ.get("TRITON_INTERPRET") == "1")):
            raise ValueError("attn/sampler 'triton' need Triton and a CUDA device")
        self.attn = attn
        self.sampler = sampler
        self.B = int(batch_size)
        self.max_prompt = int(max_prompt_len)
        self.max_new = int(max_new_tokens)
        self.T = self.max_prompt + self.max_new
        # at most 8 buckets (torch.compile recompiles once per bucket)
        self.bucket = max(int(bucket), math.ceil(self.T / 8 / 64) * 64)
        self.check_every = max(1, int(check_every))
        self.prefill_tokens = int(prefill_tokens)
        w, dev, dt = self.w, self.device, self.w.dtype
        self.kc = [torch.zeros(self.B, w.nkv, self.T, w.hd, dtype=dt, device=dev) for _ in range(w.n_layers)]
        self.vc = [torch.zeros(self.B, w.nkv, self.T, w.hd, dtype=dt, device=dev) for _ in range(w.n_layers)]
        pos = torch.arange(self.T, device=dev)
        cos, sin = w.base.rotary_emb(torch.zeros(1, dtype=dt, device=dev), pos.unsqueeze(0))
        self.cos, self.sin = cos[0].to(dt).contiguous(), sin[0].to(dt).contiguous()  # (T, hd)
        self.slots = pos
        # decode state: everything a captured step reads or advances
        self.tok = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.pad_off = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.unfinished = torch.ones(self.B, dtype=torch.bool, device=dev)
        self.out = torch.zeros(self.B, self.max_new, dtype=torch.long, device=dev)
        self.eos = torch.zeros(1, dtype=torch.long, device=dev)
        self.pad_id = torch.zeros((), dtype=torch.long, device=dev)
        self._eos_key: tuple | None = None
        self._set_fns(self.compile)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.last_stats: dict = {}
        self.attn_cfg: dict = {}
        self.attn_timings: dict = {}
        if cuda and "triton" in (self.attn, self.sampler):
            self._self_check()
        if cuda and attn_auto and self.attn == "triton":
            self._pick_attention()

    def _set_fns(self, compiled: bool):
        fns = dict(layer=_decode_layer, pre=_pre_attn, post=_post_attn, logits=_logits, sample=sample_logits,
                   cands=_cands_from_stats, pick=_pick, prefill=_prefill_layer)
        if compiled:  # the prefill sees a new (rows, width) per micro-batch: one dynamic-shape compile
            fns = {k: torch.compile(f, dynamic=(k == "prefill"), fullgraph=k not in ("sample",))
                   for k, f in fns.items()}
        self._fn = fns

    _ATTN_CONFIGS = ({"split_n": 64, "block_n": 64, "num_warps": 4}, {"split_n": 128, "block_n": 64, "num_warps": 4},
                     {"split_n": 128, "block_n": 128, "num_warps": 4}, {"split_n": 128, "block_n": 128, "num_warps": 8},
                     {"split_n": 64, "block_n": 32, "num_warps": 2})

    def _pick_attention(self):
        """attn="auto" on CUDA: time one layer's decode attention at a mid-generation length for the Triton
        kernel's configurations and for sdpa over its cache bucket; keep the fastest."""
        try:
            w, B, dev = self.w, self.B, self.device
            cur = min(self.T - 2, self.max_prompt + self.max_new // 2)
            q = torch.randn(B, w.nh, w.hd, device=dev).to(w.dtype)
            kc, vc = self.kc[0], self.vc[0]
            pad = torch.zeros(B, dtype=torch.long, device=dev)
            slot = torch.tensor([cur], device=dev)
            kv = min(self.T, (cur // self.bucket + 1) * self.bucket)
            bias = torch.zeros(B, 1, 1, kv, dtype=w.dtype, device=dev)

            def timed(fn, reps=20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    fn()
                b.record()
                torch.cuda.synchronize(dev)
                return a.elapsed_time(b) / reps * 1e3  # us

            fns = {"sdpa": (0.0, lambda: F.scaled_dot_product_attention(
                q.unsqueeze(2), kc[:, :, :kv], vc[:, :, :kv], attn_mask=bias, scale=w.scaling, enable_gqa=True))}
            for i, cfg in enumerate(self._ATTN_CONFIGS):  # + the split merge, fused into the next projection in
                # the compiled step (~4 us on the H200): timing it eagerly here would count its launches
                fns[f"triton{i}"] = (4.0, lambda cfg=cfg: decode_attention_triton(q, kc, vc, pad, slot, w.scaling,
                                                                                  w.nkv, **cfg))
            for _, fn in fns.values():  # compile everything, then ~100 ms of work so the clocks are up
                fn()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.1:
                timed(fns["sdpa"][1])
            times: dict = {}
            for _ in range(3):  # interleaved rounds, best of each
                for k, (extra, fn) in fns.items():
                    times[k] = min(times.get(k, float("inf")), extra + timed(fn))
            best = min(times, key=times.get)
            self.attn_timings = {k: round(v, 1) for k, v in times.items()}
            if best == "sdpa":
                self.attn = "sdpa"
            else:
                self.attn_cfg = dict(self._ATTN_CONFIGS[int(best[6:])])
            log.info("fastgen: decode attention %s %s (us per layer: %s)", self.attn, self.attn_cfg, self.attn_timings)
        except Exception as e:  # noqa: BLE001
            log.warning("fastgen: attention timing failed (%s); keeping %s", e, self.attn)

    def _self_check(self):
        """The Triton kernels against the torch paths on small random inputs; a mismatch turns them off."""
        w, dev, dt = self.w, self.device, self.w.dtype
        g = torch.Generator(device=dev).manual_seed(0)
        if self.attn == "triton":
            try:
                B, T = 3, 200
                q = torch.randn(B, w.nh, w.hd, generator=g, device=dev).to(dt)
                kc = torch.randn(B, w.nkv, T, w.hd, generator=g, device=dev).to(dt)
                vc = torch.randn(B, w.nkv, T, w.hd, generator=g, device=dev).to(dt)
                pad = torch.tensor([0, 37, 150], device=dev)
                slot = torch.tensor([170], device=dev)
                got = combine_splits(*decode_attention_triton(q, kc, vc, pad, slot, w.scaling, w.nkv),
                                     w.nh // w.nkv)
                want = reference_decode_attention(q, kc, vc, pad, slot, w.scaling)
                err = (got - want).abs().max().item()
                if not err < 2e-2:
                    raise RuntimeError(f"max abs error {err:.3g}")
            except Exception as e:  # noqa: BLE001
                log.warning("fastgen: Triton decode attention failed its check (%s); using sdpa", e)
                self.attn = "sdpa"
        if self.sampler == "triton":
            try:
                V = w.vocab
                logits = (torch.randn(4, V, generator=g, device=dev) * 2).to(dt)
                bmax, bsl = block_stats_triton(logits, 0.7)
                st = _Stats(logits.float() / 0.7)
                cand = torch.randint(0, V, (4, 5), generator=g, device=dev)
                le = member_mass_triton(logits, 0.7, st.m.squeeze(-1).contiguous(), logits.gather(1, cand))
                xc = st.xb.view(4, -1).gather(1, cand)
                want = torch.stack([torch.where(st.xb <= xc[:, c].view(4, 1, 1), torch.exp(st.xb - st.m.unsqueeze(-1)),
                                                0.0).sum((1, 2)) for c in range(5)], -1)
                scale = torch.exp(bmax - st.m)
                ok = (torch.allclose(bmax, st.bmax, rtol=1e-5, atol=1e-5)
                      and torch.allclose(bsl * scale, st.bsum, rtol=1e-3, atol=1e-6)
                      and torch.allclose(le, want, rtol=1e-3, atol=1e-3))
                if not ok:
                    raise RuntimeError("block stats / nucleus mass differ from the torch path")
            except Exception as e:  # noqa: BLE001
                log.warning("fastgen: Triton sampler failed its check (%s); using the torch sampler", e)
                self.sampler = "torch"

    def refresh_weights(self):
        self.w.refresh()

    # ---- one decode step (what a graph captures)

    def _step(self, kv_len: int, cfg: SamplingConfig):
        w, fn = self.w, self._fn
        x = F.embedding(self.tok, w.embed)
        cos, sin = self.cos[self.pos], self.sin[self.pos]
        if self.attn == "triton":
            for i, L in enumerate(w.layers):
                q = fn["pre"](x, L["ln1"], L["wqkv"], L["bqkv"], self.kc[i], self.vc[i], self.slot, cos, sin,
                              w.eps, w.nh, w.nkv, w.hd)
                mp, lp, op = decode_attention_triton(q, self.kc[i], self.vc[i], self.pad_off, self.slot,
                                                     w.scaling, w.nkv, **self.attn_cfg)
                x = fn["post"](x, mp, lp, op, L["wo"], L["bo"], L["ln2"], L["wgu"], L["bgu"], L["wdown"],
                               L["bdown"], w.eps, w.nh // w.nkv)
        else:
            s = self.slots[:kv_len].unsqueeze(0)
            valid = (s >= self.pad_off.unsqueeze(1)) & (s <= self.slot)
            bias = torch.zeros(valid.shape, dtype=torch.float32, device=x.device).masked_fill_(~valid, float("-inf"))
            for i, L in enumerate(w.layers):
                x = fn["layer"](x, L["ln1"], L["wqkv"], L["bqkv"], L["wo"], L["bo"], L["ln2"], L["wgu"], L["bgu"],
                                L["wdown"], L["bdown"], self.kc[i], self.vc[i], self.slot, cos, sin, bias,
                                w.eps, w.nh, w.nkv, w.hd, w.scaling, kv_len, self.attn)
        logits = fn["logits"](x, w.norm_w, w.lm_w, w.norm_eps)
        self._advance(self._sample(logits, cfg))

    def _sample(self, logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
        u = None if cfg.greedy else torch.rand(logits.shape[0], cfg.candidates(), 2, device=logits.device)
        if self.sampler == "triton" and cfg.method(logits.shape[1]) == "reject":
            return sample_logits_triton(logits, cfg, u, self._fn["cands"], self._fn["pick"])
        return self._fn["sample"](logits, cfg, u)

    def _advance(self, nxt: torch.Tensor):
        nxt = torch.where(self.unfinished, nxt, self.pad_id)
        self.out.index_copy_(1, self.col, nxt.unsqueeze(1))
        self.unfinished &= ~(nxt.unsqueeze(1) == self.eos.unsqueeze(0)).any(1)
        self.tok.copy_(nxt)
        self.pos += 1
        self.slot += 1
        self.col += 1

    def _reset_state(self):
        self.slot.zero_()
        self.col.zero_()
        self.pos.zero_()
        self.tok.zero_()
        self.pad_off.zero_()
        self.unfinished.fill_(True)

    def _graph(self, kv_len: int, cfg: SamplingConfig) -> torch.cuda.CUDAGraph:
        key = (kv_len, cfg)
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
        log.info("fastgen: captured decode step for kv_len=%d %s in %.1fs", kv_len, cfg, time.perf_counter() - t0)
        return g

    def _kv_len(self, slot: int) -> int:
        if self.attn == "triton":  # the kernel reads the valid slots itself: one step for every length
            return self.T
        return min(self.T, (slot // self.bucket + 1) * self.bucket)

    def warmup(self, prompt_len: int, cfg: SamplingConfig):
        """Compile and capture every step a generate() with this prompt width will need. A compile failure
        falls back to eager kernels (still captured), with a warning."""
        if not self.use_graphs:
            return
        kvs = sorted({self._kv_len(s) for s in range(prompt_len, prompt_len + self.max_new - 1)})
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

    def _prefill(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Fill cache slots [0, P) for rows of ids (B, P), left-padded by ``pad`` (B,); return the last
        position's hidden state (B, H)."""
        w = self.w
        B, P = ids.shape
        rows = max(1, self.prefill_tokens // P)
        outs = []
        ar = torch.arange(P, device=ids.device)
        for r0 in range(0, B, rows):
            r1 = min(B, r0 + rows)
            pid = ids[r0:r1]
            po = pad[r0:r1]
            n = r1 - r0
            posn = (ar.unsqueeze(0) - po.unsqueeze(1)).clamp_(min=0)
            cos, sin = self.cos[posn].unsqueeze(1), self.sin[posn].unsqueeze(1)  # (n, 1, P, hd)
            keyok = ar.unsqueeze(0) >= po.unsqueeze(1)  # (n, P)
            mask = (ar.view(1, P, 1) >= ar.view(1, 1, P)) & keyok.unsqueeze(1)
            mask |= torch.eye(P, dtype=torch.bool, device=ids.device).unsqueeze(0)  # pad queries see themselves
            mask = mask.unsqueeze(1)  # (n, 1, P, P)
            x = F.embedding(pid, w.embed)
            for i, L in enumerate(w.layers):
                args = (L["ln1"], L["wqkv"], L["bqkv"], L["wo"], L["bo"], L["ln2"], L["wgu"], L["bgu"], L["wdown"],
                        L["bdown"], cos, sin, mask, w.eps, w.nh, w.nkv, w.hd, w.scaling)
                try:
                    x2, k, v = self._fn["prefill"](x, *args)
                except Exception as e:  # noqa: BLE001 - a compile failure: eager from now on
                    if self._fn["prefill"] is _prefill_layer:
                        raise
                    log.warning("fastgen: compiled prefill failed (%s: %s); eager prefill", type(e).__name__,
                                str(e).splitlines()[0] if str(e) else "")
                    self._fn["prefill"] = _prefill_layer
                    x2, k, v = _prefill_layer(x, *args)
                x = x2
                self.kc[i][r0:r1, :, :P] = k
                self.vc[i][r0:r1, :, :P] = v
            outs.append(x[:, -1])
        return torch.cat(outs)

    # ---- generate

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg: SamplingConfig,
                 eos_ids, pad_id: int) -> torch.Tensor:
        """Responses (b, max_new_tokens) for left-padded prompts (b, P); after a row's EOS it holds pad_id.
        Seed torch (torch.manual_seed) before the call for reproducible samples."""
        b, P = input_ids.shape
        if b > self.B:
            raise ValueError(f"fastgen: batch {b} > engine batch {self.B}")
        if P > self.max_prompt:
            raise ValueError(f"fastgen: prompt width {P} > engine max_prompt_len {self.max_prompt}")
        mask = attention_mask.to(self.device).bool()
        lens = mask.sum(1)
        if (lens == 0).any() or not torch.equal(mask, torch.arange(P, device=self.device).unsqueeze(0) >= (P - lens).unsqueeze(1)):
            raise ValueError("fastgen: prompts must be left-padded (mask = zeros then ones) and non-empty")
        eos = sorted({int(e) for e in (eos_ids if isinstance(eos_ids, (list, tuple, set)) else [eos_ids])})
        if self._eos_key != tuple(eos):
            self.eos = torch.tensor(eos, dtype=torch.long, device=self.device)
            self._eos_key = tuple(eos)
            self._graphs.clear()  # graphs read self.eos by address
        self.pad_id.fill_(int(pad_id))
        t0 = time.perf_counter()
        if self.use_graphs:  # warm-up steps draw random numbers: keep the caller's seed meaning the same
            rng = torch.cuda.get_rng_state(self.device)
            self.warmup(P, cfg)
            torch.cuda.set_rng_state(rng, self.device)
        sync = torch.cuda.synchronize if _on_cuda(self.device) else (lambda *a: None)
        sync()
        t1 = time.perf_counter()

        ids = torch.full((self.B, P), int(pad_id), dtype=torch.long, device=self.device)
        ids[:b] = input_ids.to(self.device)
        pad = torch.full((self.B,), P - 1, dtype=torch.long, device=self.device)  # dummy rows: 1 token
        pad[:b] = P - lens
        for c in (self.kc + self.vc):
            c[:, :, P:].zero_()  # slots past the prompt: no stale non-finite values under a zero weight
        h = self._prefill(ids, pad)
        first = self._sample(_logits(h, self.w.norm_w, self.w.lm_w, self.w.norm_eps), cfg)
        self.out.fill_(int(pad_id))
        self.pad_off.copy_(pad)
        self.pos.copy_(P - pad - 1)  # _advance moves these to the first generated token's position / slot
        self.slot.fill_(P - 1)
        self.col.zero_()
        self.unfinished.fill_(True)
        self.unfinished[b:] = False
        self._advance(first)
        sync()
        t2 = time.perf_counter()
        steps = 1
        for t in range(1, self.max_new):
            if (t == 1 or t % self.check_every == 0) and not bool(self.unfinished.any()):
                break
            kv = self._kv_len(P + t - 1)
            if self.use_graphs:
                self._graph(kv, cfg).replay()
            else:
                self._step(kv, cfg)
            steps += 1
        sync()
        t3 = time.perf_counter()
        self.last_stats = {"setup_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2, "steps": steps,
                           "decode_ms_per_step": 1e3 * (t3 - t2) / max(steps - 1, 1), "batch": b, "prompt": P}
        return self.out[:b].clone()


# ------------------------------------------------------------------------------------ the rollout entry


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model, batch_size: int, max_prompt_len: int, max_new_tokens: int) -> FastGen:
    """A cached engine for this model object big enough for the request (weights re-read on reuse)."""
    eng = _ENGINES.get(model)
    if eng is not None and eng.B >= batch_size and eng.max_prompt >= max_prompt_len and eng.max_new == max_new_tokens:
        eng.refresh_weights()
        return eng
    eng = FastGen(model, batch_size, max_prompt_len, max_new_tokens)
    _ENGINES[model] = eng
    return eng


@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], cfg, device, seed: int, progress=None) -> list[list[int]]:
    """Same contract as ``core.generate.sample`` (responses without padding, EOS kept), on the static engine.

    cfg: a RolloutSpec (temperature, top_p, top_k, max_new_tokens, micro_batch_size). top_k=0 means off."""
    from core.generate import in_micro_batches

    model.eval()
    eos = tok.eos_token_id
    eos_ids = sorted(set(eos if isinstance(eos, list) else [eos]))
    scfg = SamplingConfig(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k or 0))
    mb = min(cfg.micro_batch_size, max(1, len(prompts)))
    width = max((len(p) for p in prompts), default=1)
    eng = engine_for(model, mb, width, cfg.max_new_tokens)
    return in_micro_batches(lambda ids, mask: eng.generate(ids, mask, scfg, eos_ids, tok.pad_token_id), tok,
                            prompts, cfg.micro_batch_size, set(eos_ids), seed, progress)
