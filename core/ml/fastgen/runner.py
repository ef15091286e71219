"""The model's forward over the engine's state: one decode step (what a CUDA graph captures), the chunked prefill, and
starting rows (prefill, first token, decode state). ``tuned`` says which attention, sampler and compile it runs now."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen import graphs
from verlflow.core.ml.fastgen.kernels import (_cands_from_stats, _first_decided, _pick, decode_attention_triton,
                                              sample_logits_triton)
from verlflow.core.ml.fastgen.layers import (_decode_layer, _head, _logits, _norm, _post_attn, _pre_attn,
                                             _prefill_layer)
from verlflow.core.ml.fastgen.sampling import SamplingConfig, sample_logits
from verlflow.core.ml.fastgen.state import _advance_rows
from verlflow.core.ml.generate import chosen_logprobs, sampling_temperature

log = logging.getLogger("verlflow.fastgen")


def _sampled_logp(logits: torch.Tensor, nxt: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log_softmax(logits / temperature) of the sampled tokens (one fused pass when compiled)."""
    return chosen_logprobs(logits.float() / temperature, nxt)


def _step_functions() -> dict:
    return dict(layer=_decode_layer, pre=_pre_attn, post=_post_attn, logits=_logits, head=_head, norm=_norm,
                sample=sample_logits,
                cands=_cands_from_stats, pick=_pick, decided=_first_decided, prefill=_prefill_layer,
                logp=_sampled_logp, advance=_advance_rows)


class Runner:
    """The forward of weights ``w`` over ``state``, with the engine's ``options``."""

    def __init__(self, w, state, tuned, options):
        self.w, self.state, self.tuned, self.options = w, state, tuned, options
        self.set_fns(tuned.compile)

    def set_fns(self, compiled: bool):
        fns = _step_functions()
        self.eager = dict(fns)  # a refill's first tokens: a new row count each time, not worth a compile each
        # the prefill sees a new (rows, width) per micro-batch: prefill() marks those two dims dynamic
        # (dynamic=True would make every size and float symbolic: a slower compile, even from the cache)
        self.fn = graphs.compiled(fns, self.options, self.w.fp8) if compiled else fns

    # ---- one decode step (what a graph captures)

    def next_norms(self) -> tuple[list, bool]:
        """The norm each layer's graph applies to its output: the next layer's input norm, and after the last layer
        the final norm where it is the same kind (then the head reads it directly). Read each step: refresh() may
        replace the weights' tensors."""
        w = self.w
        layers = w.layers
        final = all(L["ln1"] is not None for L in layers) and w.norm_eps == w.spec.eps
        return [L["ln1"] for L in layers[1:]] + [w.norm_w if final else None], final

    def step(self, kv_len: int, cfg: SamplingConfig):
        w, fn, S, st, tuned = self.w, self.fn, self.w.spec, self.state, self.tuned
        x = self.embed(st.tok)
        h = fn["norm"](x, w.layers[0]["ln1"], S)
        nexts, final = self.next_norms()
        rope = [(c[st.pos], s[st.pos]) for c, s in st.rope]
        if tuned.attn == "triton":
            for i, L in enumerate(w.layers):
                cos, sin = rope[w.rope_of[i]]
                q = fn["pre"](h, L, st.kc[i], st.vc[i], st.slot, cos, sin, S, st.ks[i], st.vs[i])
                mp, lp, op = decode_attention_triton(q, st.kT[i], st.vT[i], st.pad_off, st.slot,
                                                     S.scaling, S.nkv, window=st.windows[i], softcap=S.softcap,
                                                     ks=st.ks[i], vs=st.vs[i], **tuned.attn_cfg)
                x, h = fn["post"](x, mp, lp, op, L, nexts[i], S)
        else:
            s, cur = st.slots[:kv_len].unsqueeze(0), st.slot.unsqueeze(1)
            valid = (s >= st.pad_off.unsqueeze(1)) & (s <= cur)
            bias = {}  # per sliding window (0: none): HF's window keeps key n for query q iff q - n < window
            for win in sorted(set(st.windows)):
                ok = valid & (s > cur - win) if win else valid
                bias[win] = torch.zeros(ok.shape, dtype=torch.float32, device=x.device).masked_fill_(
                    ~ok, float("-inf"))
                if tuned.compile and self.options.bucket_compile == "dynamic":  # one compile for every cache bucket
                    torch._dynamo.maybe_mark_dynamic(bias[win], 1)
                elif tuned.compile:  # a graph per bucket (dynamo would otherwise turn the size dynamic itself)
                    torch._dynamo.mark_static(bias[win], 1)
            for i, L in enumerate(w.layers):
                cos, sin = rope[w.rope_of[i]]
                x, h = fn["layer"](x, h, L, nexts[i], st.kc[i], st.vc[i], st.slot, cos, sin,
                                   bias[st.windows[i]], S, tuned.attn, st.ks[i], st.vs[i])
        if final:
            logits = fn["head"](h, w.lm_w, w.final_cap)
        else:
            logits = fn["logits"](x, w.norm_w, w.lm_w, w.norm_eps, S.norm32, w.final_cap)
        st.advance(fn["advance"], *self.sample(logits, cfg))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.w.embed)
        if self.w.embed_scale is not None:  # Gemma: times sqrt(hidden) in the model dtype
            x = x * self.w.embed_scale
        return x

    def sample(self, logits: torch.Tensor, cfg: SamplingConfig, fn: dict | None = None):
        """The next tokens and their fp32 log-probs under the sampling logits (logits / T; greedy: T = 1): the
        rollout's old log-probs. The Triton sampler has them from its own block pass; otherwise one more pass over
        the vocabulary."""
        fn = fn or self.fn
        u = None if cfg.greedy else torch.rand(logits.shape[0], cfg.candidates(), 2, device=logits.device)
        if self.tuned.sampler == "triton" and cfg.method(logits.shape[1]) == "reject":
            return sample_logits_triton(logits, cfg, u, fn["cands"], fn["pick"], fn["decided"],
                                        two_pass=self.options.nucleus == "two_pass")
        nxt = fn["sample"](logits, cfg, u)
        return nxt, fn["logp"](logits, nxt, sampling_temperature(cfg.temperature))

    # ---- prefill

    def prefill(self, ids: torch.Tensor, pad: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Fill cache slots [0, P) of the cache rows ``rows`` (default: the first n) with prompts ids (n, P),
        left-padded by ``pad`` (n,); return the last position's hidden state (n, H)."""
        w, st, compiled = self.w, self.state, self.tuned.compile
        B, P = ids.shape
        per = max(1, self.options.prefill_tokens // P)
        outs = []
        ar = torch.arange(P, device=ids.device)
        for r0 in range(0, B, per):
            r1 = min(B, r0 + per)
            pid = ids[r0:r1]
            po = pad[r0:r1]
            n = r1 - r0
            if compiled and n == 1:  # dynamo specialises a size of 1 (a graph of its own, compiled mid-call):
                pid, po = pid.expand(2, -1), po.expand(2)  # the row twice takes the graph every other count takes
            posn = (ar.unsqueeze(0) - po.unsqueeze(1)).clamp_(min=0)
            rope = [(c[posn].unsqueeze(1), s[posn].unsqueeze(1)) for c, s in st.rope]  # (n, 1, P, rot)
            keyok = ar.unsqueeze(0) >= po.unsqueeze(1)  # (n, P)
            mask = (ar.view(1, P, 1) >= ar.view(1, 1, P)) & keyok.unsqueeze(1)
            mask |= torch.eye(P, dtype=torch.bool, device=ids.device).unsqueeze(0)  # pad queries see themselves
            mask = mask.unsqueeze(1)  # (n, 1, P, P)
            masks = {win: mask & ((ar.view(1, 1, P, 1) - ar.view(1, 1, 1, P)) < win) if win else mask
                     for win in set(st.windows)}  # sliding-window layers: the banded causal mask
            x = self.embed(pid)
            if compiled:  # rows and width vary; the rest is the model's (one compile, not one per shape)
                for t, dims in ((x, (0, 1)), *((t, (0, 2)) for cs in rope for t in cs),
                                *((m, (0, 2, 3)) for m in masks.values())):
                    torch._dynamo.maybe_mark_dynamic(t, dims)
            for i, L in enumerate(w.layers):
                cos, sin = rope[w.rope_of[i]]
                args = (L, cos, sin, masks[st.windows[i]], w.spec)
                try:
                    x2, k, v, sk, sv = self.fn["prefill"](x, *args)
                except Exception as e:  # noqa: BLE001 - a compile failure: eager from now on
                    if self.fn["prefill"] is _prefill_layer:
                        raise
                    log.warning("fastgen: compiled prefill failed (%s: %s); eager prefill", type(e).__name__,
                                str(e).splitlines()[0] if str(e) else "")
                    self.fn["prefill"] = _prefill_layer
                    x2, k, v, sk, sv = _prefill_layer(x, *args)
                x = x2
                dst = slice(r0, r1) if rows is None else rows[r0:r1]
                st.kc[i][dst, :, :P] = k[:n]
                st.vc[i][dst, :, :P] = v[:n]
                if sk is not None:
                    st.ks[i][dst, :, :P] = sk[:n]
                    st.vs[i][dst, :, :P] = sv[:n]
            outs.append(x[:n, -1])
        return torch.cat(outs)

    def compile_refills(self) -> float:
        """Compile the refills' prefill (any rows, any width: a single row runs as two, see prefill) now, in the
        set-up, rather than in continuous batching's first refills. Returns the seconds it took."""
        t1 = time.perf_counter()
        dev = self.w.device
        for n, p in ((2, 3), (3, 5)):
            rows = torch.arange(min(n, self.state.B), device=dev)  # an engine of 1 or 2 rows has no third
            self.prefill(torch.zeros(len(rows), p, dtype=torch.long, device=dev), torch.zeros_like(rows), rows)
        graphs.sync(dev)
        return round(time.perf_counter() - t1, 3)

    def start_rows(self, rows: torch.Tensor, ids: torch.Tensor, pad: torch.Tensor, limits: torch.Tensor,
                   cfg: SamplingConfig):
        """Put left-padded prompts ids (n, P) (``pad`` (n,) pad slots each) into cache rows ``rows`` (n,): prefill
        them, sample each one's first token, and set the rows' decode state so the next step continues them."""
        P = ids.shape[1]
        every = len(rows) == self.state.B  # all rows (a micro-batch): plain slices, not an index_put over the cache
        self.state.clear_past(None if every else rows, P)
        h = self.prefill(ids, pad, None if every else rows)
        w = self.w
        logits = _logits(h, w.norm_w, w.lm_w, w.norm_eps, w.spec.norm32, w.final_cap)
        first, logp = self.sample(logits, cfg, self.fn if every else self.eager)
        self.state.start(rows, first, logp, pad, P, limits)
