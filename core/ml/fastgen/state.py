"""The engine's device state: the static KV cache (and an fp8 cache's scales), the rotary tables and sliding windows it
is read with, and each row's decode state. Captured decode steps read these tensors by address: they are written in
place, never replaced."""

from __future__ import annotations

import math

import torch

from verlflow.core.ml.fastgen.layers import FP8


def _advance_rows(nxt, logp, live, out, out_logp, col, pos, slot, limit, eos, pad_id, tok, force, fidx, flen,
                  max_new: int):
    """Emit the sampled tokens of the unfinished rows (``live``) with their log-probs, in place. A finished row
    stands still (its column, position and slot stay; it is fed pad_id) until it is refilled or the batch ends; it
    finishes at an EOS or at its token budget ``limit``. A row continuing a turn in its cache is fed its known
    tokens first (``force[row, fidx:flen]``): it advances, keeps nothing sampled and cannot finish meanwhile (the
    tokens it is fed may be EOS ids). Compiled on CUDA: its ~15 small kernels become a few."""
    forcing = live & (fidx < flen)
    emit = live & ~forcing
    nxt = torch.where(emit, nxt, pad_id)
    c = col.clamp(max=max_new - 1).unsqueeze(1)  # a row at its budget rewrites its last column
    out.scatter_(1, c, torch.where(emit, nxt, out.gather(1, c).squeeze(1)).unsqueeze(1))
    out_logp.scatter_(1, c, torch.where(emit, logp, out_logp.gather(1, c).squeeze(1)).unsqueeze(1))
    step = live.long()
    col += emit.long()
    pos += step
    slot += step
    fed = force.gather(1, fidx.clamp(max=force.shape[1] - 1).unsqueeze(1)).squeeze(1)
    fidx += forcing.long()
    live &= ~(emit & ((nxt.unsqueeze(1) == eos.unsqueeze(0)).any(1) | (col >= limit)))
    tok.copy_(torch.where(forcing, fed, nxt))


class DecodeState:
    """The cache and decode state of ``rows`` rows, prompts up to ``max_prompt`` slots and ``max_new`` new tokens
    each, read through the weights ``w`` (their shapes, dtype, device, rotary tables and windows)."""

    MAX_EOS = 8  # EOS ids a generation may stop at (a fixed-size buffer: captured steps need not change)

    def __init__(self, w, rows: int, max_prompt: int, max_new: int, min_bucket: int, forced_tokens: int = 0):
        self.B = int(rows)
        self.max_prompt = int(max_prompt)
        self.max_new = int(max_new)
        self.T = self.max_prompt + self.max_new
        self.bucket = max(min_bucket, math.ceil(self.T / 8 / 64) * 64)  # <= 8 buckets, a compile each
        dev, dt = w.device, w.dtype
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
        self.kT, self.vT = [c[:, :, :self.T] for c in self.kc], [c[:, :, :self.T] for c in self.vc]
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
        self.eos = torch.full((self.MAX_EOS,), -1, dtype=torch.long, device=dev)  # -1: no token matches
        self.pad_id = torch.zeros((), dtype=torch.long, device=dev)
        # a continued turn's known tokens, fed before it samples (its trajectory's observation): force[row, :flen]
        self.force = torch.zeros(self.B, max(1, int(forced_tokens)), dtype=torch.long, device=dev)
        self.fidx = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.flen = torch.zeros(self.B, dtype=torch.long, device=dev)
        self._eos_key: tuple | None = None

    def kv_len(self, slot: int, attn: str) -> int:
        """The cache slots a decode step at ``slot`` attends over: its bucket's, or (Triton) the whole cache."""
        if attn == "triton":  # the kernel reads the valid slots itself: one step for every length
            return self.T
        return min(self.T, (slot // self.bucket + 1) * self.bucket)

    def set_stop(self, eos_ids, pad_id: int):
        """The EOS ids rows finish at and the id finished rows emit."""
        eos = sorted({int(e) for e in (eos_ids if isinstance(eos_ids, (list, tuple, set)) else [eos_ids])})
        if len(eos) > self.MAX_EOS:
            raise ValueError(f"fastgen: {len(eos)} EOS ids {eos}; the engine takes at most {self.MAX_EOS}")
        if self._eos_key != tuple(eos):  # in place: captured steps read self.eos by address
            self.eos.fill_(-1)
            self.eos[:len(eos)] = torch.tensor(eos, dtype=torch.long)
            self._eos_key = tuple(eos)
        self.pad_id.fill_(int(pad_id))

    def reset(self):
        self.slot.zero_()
        self.col.zero_()
        self.pos.zero_()
        self.tok.zero_()
        self.pad_off.zero_()
        self.limit.fill_(self.max_new)
        self.unfinished.fill_(True)
        self.fidx.zero_()
        self.flen.zero_()

    def clear_past(self, rows: torch.Tensor | None, P: int):
        """Zero the cache slots past the first ``P`` of rows ``rows`` (None: every row)."""
        for c in [c for c in self.kc + self.vc + self.ks + self.vs if c is not None]:
            if rows is None:
                c[:, :, P:].zero_()  # slots past the prompt: no stale non-finite values under a zero weight
            else:
                c[rows, :, P:] = 0

    def start(self, rows: torch.Tensor, first: torch.Tensor, logp: torch.Tensor, pad: torch.Tensor, P: int,
              limits: torch.Tensor):
        """Rows ``rows`` hold prompts of ``P`` slots (``pad`` of them padding) and emitted ``first`` (log-probs
        ``logp``): set their decode state so the next step continues them."""
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
        self.fidx[rows] = 0
        self.flen[rows] = 0

    def resume(self, rows: torch.Tensor, forced: torch.Tensor, lens: torch.Tensor, limits: torch.Tensor):
        """Rows ``rows`` go on in their cache: they are fed ``forced`` (n, F) (its first ``lens`` tokens each, the
        first of them next step, at the slot the row stopped at), then sample at most ``limits`` new tokens."""
        self.force[rows] = forced
        self.tok[rows] = forced[:, 0]
        self.fidx[rows] = 1
        self.flen[rows] = lens
        self.out[rows] = self.pad_id
        self.out_logp[rows] = 0.0
        self.col[rows] = 0
        self.limit[rows] = limits
        self.unfinished[rows] = True

    def advance(self, fn, nxt: torch.Tensor, logp: torch.Tensor):
        """One decode step's bookkeeping by ``fn`` (``_advance_rows``, compiled or not)."""
        fn(nxt, logp, self.unfinished, self.out, self.out_logp, self.col, self.pos, self.slot, self.limit, self.eos,
           self.pad_id, self.tok, self.force, self.fidx, self.flen, self.max_new)
