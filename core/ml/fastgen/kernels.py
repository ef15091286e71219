"""Triton kernels of the decode step: split-KV GQA attention and the top-p sampler's passes (CUDA only)."""

from __future__ import annotations

import torch

from verlflow.core.ml.fastgen.sampling import _VBLOCK, SamplingConfig, _blocks, _first_accepted

try:  # the CUDA kernels below; CPU runs (the tests) use the torch paths
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None
    HAVE_TRITON = False

# ------------------------------------------------------------------------------------- Triton kernels
#
# Used on CUDA only. Each is checked against its torch counterpart when an engine starts (``_self_check``);
# a mismatch turns it off for that engine, with a warning.

if HAVE_TRITON:

    @triton.jit
    def _attn_block(q, K, V, KS, VS, base, sbase, n, ok, skt, d, D, scale, m_i, l_i, acc, SOFTCAP: tl.constexpr,
                    IEEE: tl.constexpr, KV8: tl.constexpr):
        """Online softmax over one block of slots n (masked by ok): the running max, sum and output, updated. d runs
        over the head dim padded to a power of two (Phi-3's 96: 128); the lanes past D load zeros. KV8: the cache
        is e4m3 with a scale per slot (KS/VS at sbase + n): K's scales multiply the scores after the dot, V's the
        probabilities before it (the softmax's sum stays unscaled)."""
        k = tl.load(K + base + n[:, None] * skt + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
        v = tl.load(V + base + n[:, None] * skt + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
        if KV8:  # e4m3 is exact in bf16 and fp32: the dots run in the query's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if KV8:
            s = s * tl.load(KS + sbase + n, mask=ok, other=0.0)[None, :]
        s = s * scale
        if SOFTCAP > 0:  # tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, no libdevice needed
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * (s / SOFTCAP)) + 1.0))
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV8:
            p = p * tl.load(VS + sbase + n, mask=ok, other=0.0)[None, :]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_attn_kernel(Q, K, V, KS, VS, PAD, SLOT, MP, LP, OP, scale,
                            sqb, sqh, skb, skh, skt, ssb, ssh, NKV, NSPLIT,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                            SOFTCAP: tl.constexpr, IEEE: tl.constexpr, BOUNDED: tl.constexpr, KV8: tl.constexpr,
                            RANGED: tl.constexpr):
        """One (row, KV head, split of the cache): the group's G query heads against the shared K/V head,
        valid slots only ([pad_b, slot_b], and the last WINDOW of them when WINDOW > 0: sliding-window layers);
        scores soft-capped (SOFTCAP * tanh(s / SOFTCAP)) when SOFTCAP > 0; writes the split's running max, sum and
        unnormalised output. WINDOW and SOFTCAP are compile-time: 0 compiles the plain kernel. IEEE (fp32 models):
        the dots in full fp32, not TF32 (whose 10-bit mantissa tipped greedy near-ties away from HF's). BOUNDED:
        a block of slots with none valid is skipped (a split past the row's slot, or before its pad, runs none);
        otherwise every block runs, its invalid slots masked (loaded as nothing, still computed). RANGED: the row's
        valid slots are cut into NSPLIT equal runs, one per program, each a loop whose bounds come from the row's
        pad and slot (SPLIT_N unused): no block outside them, no branch in the loop, so Triton pipelines its loads.
        KV8: an fp8 cache with a scale per (row, KV head, slot) in KS/VS (strides ssb, ssh; slots contiguous)."""
        pid = tl.program_id(0)
        sp = tl.program_id(1)
        b = pid // NKV
        h = pid % NKV
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :],
                    other=0.0)
        pad = tl.load(PAD + b).to(tl.int32)
        cur = tl.load(SLOT + b).to(tl.int32)  # each row its own slot (continuous batching refills rows)
        if WINDOW > 0:  # HF's sliding window: key slot n is seen by the query at slot cur iff cur - n < WINDOW
            pad = tl.maximum(pad, cur - WINDOW + 1)
        m_i = tl.zeros([GP], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, DP], dtype=tl.float32)
        base = b * skb + h * skh
        sbase = b * ssb + h * ssh
        if RANGED:
            span = tl.cdiv(tl.cdiv(cur + 1 - pad, NSPLIT), BLOCK_N) * BLOCK_N
            lo = pad + sp * span
            hi = tl.minimum(lo + span, cur + 1)
            for start in tl.range(lo, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = _attn_block(q, K, V, KS, VS, base, sbase, n, n < hi, skt, d, D, scale, m_i, l_i, acc,
                                            SOFTCAP, IEEE, KV8)
        else:
            for n0 in range(0, SPLIT_N, BLOCK_N):  # masked loads of invalid slots fetch nothing
                start = sp * SPLIT_N + n0
                n = start + tl.arange(0, BLOCK_N)
                ok = (n >= pad) & (n <= cur)
                if BOUNDED:  # (a branch in the loop: Triton does not pipeline its loads; RANGED does)
                    if (start <= cur) & (start + BLOCK_N > pad):
                        m_i, l_i, acc = _attn_block(q, K, V, KS, VS, base, sbase, n, ok, skt, d, D, scale,
                                                    m_i, l_i, acc, SOFTCAP, IEEE, KV8)
                else:
                    m_i, l_i, acc = _attn_block(q, K, V, KS, VS, base, sbase, n, ok, skt, d, D, scale, m_i, l_i, acc,
                                                SOFTCAP, IEEE, KV8)
        row = (pid * NSPLIT + sp) * G  # only the G real query rows go out
        tl.store(MP + row + g, m_i, mask=g < G)
        tl.store(LP + row + g, l_i, mask=g < G)
        tl.store(OP + (row + g)[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & (d < D)[None, :])

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
    def _member_kernel(X, sxb, V, inv_t, M, XC, LE, NCH, DONE, C: tl.constexpr, CP: tl.constexpr,
                       CHUNK: tl.constexpr, SUB: tl.constexpr, GATED: tl.constexpr):
        """For each candidate c of the row: sum of exp(x * inv_t - m) over this chunk's tokens whose raw
        score is <= the candidate's raw score. GATED: a row whose DONE flag is set reads nothing and writes 0."""
        b = tl.program_id(0)
        ch = tl.program_id(1)
        ci = tl.arange(0, CP)
        xc = tl.load(XC + b * C + ci, mask=ci < C, other=float("-inf")).to(tl.float32)
        m = tl.load(M + b)
        acc = tl.zeros([SUB, CP], dtype=tl.float32)
        run = True
        if GATED:
            run = tl.load(DONE + b) == 0
        if run:
            for s0 in range(0, CHUNK, SUB):
                offs = ch * CHUNK + s0 + tl.arange(0, SUB)
                xr = tl.load(X + b * sxb + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                w = tl.exp(xr * inv_t - m)
                acc += tl.where(xr[:, None] <= xc[None, :], w[:, None], 0.0)
            tl.store(LE + (b * NCH + ch) * CP + ci, tl.sum(acc, 0))  # one cross-thread reduction per program
        else:  # a settled row: no loads, no reduction (most programs of the second pass)
            tl.store(LE + (b * NCH + ch) * CP + ci, tl.zeros([CP], dtype=tl.float32))

    @triton.jit
    def _first_mass_kernel(X, sxb, V, inv_t, M, XC, sxc, LE, NCH, BLK: tl.constexpr):
        """The member sum for the row's first candidate alone, over BLK tokens: one compare a token (the
        C-candidate kernel does C) and the block-stats kernel's shape, whose loads keep the memory busy."""
        b = tl.program_id(0)
        ch = tl.program_id(1)
        offs = ch * BLK + tl.arange(0, BLK)
        x = tl.load(X + b * sxb + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        xc = tl.load(XC + b * sxc).to(tl.float32)
        m = tl.load(M + b)
        w = tl.where(x <= xc, tl.exp(x * inv_t - m), 0.0)
        tl.store(LE + b * NCH + ch, tl.sum(w, 0))


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def decode_attention_triton(q, kc, vc, pad_off, slot, scale: float, nkv: int, split_n: int = 64,
                            block_n: int = 64, num_warps: int = 4, window: int = 0, softcap: float = 0.0,
                            bounded: bool = False, ks=None, vs=None, splits: int = 0, num_stages: int = 3):
    """Partial results of decode attention (see ``_decode_attn_kernel``): (m, l, o) per split, for
    ``combine_splits``. q (B, nh, D); kc/vc (B, nkv, T, D), last dim contiguous; pad_off, slot (B,) long: row b
    attends to slots [pad_off[b], slot[b]]. window: a sliding-window
    layer's window (0: off); softcap: attention logit soft-capping (0: off); bounded: loop over valid slots only;
    splits > 0: each row's valid slots in that many runs (the kernel's RANGED; split_n unused); ks/vs (B, nkv, >= T)
    fp32: an fp8 cache's scales per slot (None: the cache is in the query's dtype)."""
    B, nh, D = q.shape
    T = kc.shape[2]
    G = nh // nkv
    GP = max(16, _pow2(G))
    ns = splits if splits else triton.cdiv(T, split_n)
    mp = torch.empty(B, nkv, ns, G, dtype=torch.float32, device=q.device)
    lp = torch.empty_like(mp)
    op = torch.empty(B, nkv, ns, G, D, dtype=torch.float32, device=q.device)
    kv8 = ks is not None
    if not kv8:  # (pointers the kernel never reads)
        ks = vs = mp
    _decode_attn_kernel[(B * nkv, ns)](
        q, kc, vc, ks, vs, pad_off, slot, mp, lp, op, scale, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2), ks.stride(0) if kv8 else 0, ks.stride(1) if kv8 else 0, nkv, ns, G=G, GP=GP, D=D,
        DP=max(16, _pow2(D)), SPLIT_N=split_n, BLOCK_N=block_n, WINDOW=int(window), SOFTCAP=float(softcap),
        IEEE=q.dtype == torch.float32, BOUNDED=bool(bounded), KV8=kv8, RANGED=bool(splits), num_warps=num_warps,
        num_stages=num_stages)
    return mp, lp, op


def reference_decode_attention(q, kc, vc, pad_off, slot, scale: float, window: int = 0,
                               softcap: float = 0.0, ks=None, vs=None) -> torch.Tensor:
    """What the kernel computes, in fp32 torch: (B, nh * D) (an fp8 cache read back with its scales ks/vs)."""
    B, nh, D = q.shape
    if ks is not None:
        T = kc.shape[2]
        kc, vc = kc.float() * ks[..., :T, None], vc.float() * vs[..., :T, None]
    nkv, T = kc.shape[1], kc.shape[2]
    t = torch.arange(T, device=q.device)
    slot = slot.view(-1, 1)  # (B, 1), or (1, 1): one slot for every row
    ok = (t[None] >= pad_off[:, None]) & (t[None] <= slot)
    if window:
        ok &= t[None] > slot - window
    s = torch.matmul(q.float().view(B, nkv, nh // nkv, D), kc.float().transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
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


def member_mass_triton(logits, temperature: float, m, xc, chunk: int | None = None, sub: int = 1024,
                       num_warps: int = 8, done=None):
    """(B, C): mass exp(x/T - m) of the tokens whose raw logit is <= each candidate's raw logit xc (B, C).
    ``done`` (B,) bool: rows already decided, for which nothing is read and 0 is returned. Chunks of 2,048 tokens a
    program; gated, 8,192 (a quarter of the programs: most only store zeros, the few busy ones loop longer)."""
    chunk = chunk or (2048 if done is None else 8192)
    B, V = logits.shape
    C = xc.shape[1]
    CP = _pow2(C)
    nch = triton.cdiv(V, chunk)
    le = torch.empty(B, nch, CP, dtype=torch.float32, device=logits.device)
    gate = xc if done is None else done.contiguous().view(torch.uint8)
    _member_kernel[(B, nch)](logits, logits.stride(0), V, 1.0 / temperature, m, xc.contiguous(), le, nch, gate,
                             C=C, CP=CP, CHUNK=chunk, SUB=sub, GATED=done is not None, num_warps=num_warps)
    return le.sum(1)[:, :C]


def first_mass_triton(logits, temperature: float, m, xc, blk: int = 2048, num_warps: int = 4):
    """(B, nch) partial sums of the first candidate's member mass (``member_mass_triton``'s column 0, summed
    over the chunks by the caller)."""
    B, V = logits.shape
    nch = triton.cdiv(V, blk)
    parts = torch.empty(B, nch, dtype=torch.float32, device=logits.device)
    _first_mass_kernel[(B, nch)](logits, logits.stride(0), V, 1.0 / temperature, m, xc, xc.stride(0), parts, nch,
                                 BLK=blk, num_warps=num_warps)
    return parts


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


def _logp_from_stats(logits, tok, m, z, temperature: float):
    """log_softmax(logits / T)[tok] in fp32 from what the sampler's block pass already has: the row max m of
    logits / T and the mass z = sum exp(logits / T - m); saves the step a full-vocabulary logsumexp pass."""
    return logits.gather(1, tok.view(-1, 1)).squeeze(1).float() * (1.0 / temperature) - m - torch.log(z.squeeze(-1))


def _first_decided(parts, z, top_p: float):
    """The first candidate's member mass (B,) from its partial sums, and whether it settles the row: accepted."""
    le0 = parts.sum(1)
    return le0, le0 > (1.0 - top_p) * z.squeeze(-1)


def _pick(cand, le, z, fallback, top_p: float, logits, m, temperature: float, le0=None):
    """The first accepted candidate (the argmax when none is) and its log-prob. ``le0``: the first candidate's
    mass from the first pass (its column of ``le`` is then not read: 0 on the rows the first pass settled)."""
    if le0 is not None:
        le = torch.cat([le0.unsqueeze(1), le[:, 1:]], 1)
    tok = _first_accepted(cand, le > (1.0 - top_p) * z, fallback)
    return tok, _logp_from_stats(logits, tok, m, z, temperature)


def sample_logits_triton(logits, cfg: SamplingConfig, u, cands_fn=_cands_from_stats, pick_fn=_pick,
                         decided_fn=_first_decided, two_pass: bool = True):
    """``sample_logits`` for the "reject" method with the full-vocabulary passes as Triton kernels; returns the
    tokens and their log-probs under logits / T (fp32).

    ``two_pass``: the nucleus test first for each row's first candidate alone (accepted with probability ~top_p),
    then for all candidates on the rows it did not settle only; otherwise one pass for every candidate of every
    row. Both pick the same token: the first accepted candidate."""
    bmax, bsl = block_stats_triton(logits, cfg.temperature)
    cand, xc, m, z, fallback = cands_fn(logits, bmax, bsl, u, cfg.temperature)
    if cfg.top_p >= 1.0:
        tok = cand[:, 0]
        return tok, _logp_from_stats(logits, tok, m, z, cfg.temperature)
    if not two_pass or xc.shape[1] == 1:
        le = member_mass_triton(logits, cfg.temperature, m, xc)
        return pick_fn(cand, le, z, fallback, cfg.top_p, logits, m, cfg.temperature)
    le0, done = decided_fn(first_mass_triton(logits, cfg.temperature, m, xc), z, cfg.top_p)
    le = member_mass_triton(logits, cfg.temperature, m, xc, done=done)
    return pick_fn(cand, le, z, fallback, cfg.top_p, logits, m, cfg.temperature, le0)
