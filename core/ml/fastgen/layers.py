"""The decode and prefill forward of a Llama/Qwen2 layer over fused weights, and those weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verlflow.core.ml.fastgen.kernels import combine_splits
from verlflow.core.ml.fastgen.support import SUPPORTED_MODEL_TYPES

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


