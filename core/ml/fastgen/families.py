"""The model families the static engine runs: one adapter (a ``Family``) per HF ``model_type``.

Torch-free (``support.py`` lists the registry's keys for the driver's preflight). An adapter is facts only: which
module names hold the norms and projections, which form of RMSNorm, q/k norms, activation, sliding windows,
soft-capping. ``layers._Weights`` reads a model through its family into per-layer tensors (a norm the family
lacks is None) and one static ``layers.Spec``; the per-layer functions never look at the family, only at those
tensors and python scalars, so torch.compile / CUDA graphs see the same kind of inputs for every family.

Each fact below was read off transformers' own modeling file of the family (``models/<type>/modeling_<type>.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

_LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
_SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")  # Gemma-2/3: norms before and after attention and the MLP
_POST_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo-2: after only


@dataclass(frozen=True)
class Family:
    """What one HF decoder family differs in from Llama (the defaults)."""

    norms: tuple = _LLAMA_NORMS
    """The decoder layer's norm modules, by slot: (before attention, on the attention output, before the MLP, on
    the MLP output); None where the family has none. x += post(attn(pre(x))); x += post(mlp(pre(x)))."""
    norm_form: str = "llama"
    """RMSNorm (all of the model's, q/k norms too): "llama" w * n(x).to(dt); "fp32" (w * n(x)).to(dt) (OLMo-2);
    "gemma" (n(x) * (1 + w.float())).to(dt). n(x) = x.float() * rsqrt(mean(x.float()^2) + eps)."""
    qk_norm: str = ""
    """"head": q_norm / k_norm over each head's head_dim before rotary (Qwen3, Gemma-3); "full": over the whole
    projected q (nh * hd) and k (nkv * hd) (OLMo-2); "": none."""
    qkv: tuple = ("q_proj", "k_proj", "v_proj")
    """Attention input projections; one name: already fused as [q; k; v] in HF (Phi-3's qkv_proj)."""
    gate_up: tuple = ("gate_proj", "up_proj")
    """MLP input projections; one name: already fused as [gate; up] (Phi-3's gate_up_proj)."""
    act_field: str = "hidden_act"
    """The config field naming the MLP activation (act(gate) * up)."""
    embed_scale: bool = False
    """Embeddings times embed_tokens.embed_scale (sqrt(hidden)) cast to the model dtype (Gemma)."""
    window: str = "none"
    """Sliding-window attention: "module" each layer's self_attn.sliding_window (set by config.layer_types);
    "config" config.sliding_window on every layer (Mistral, Phi-3); "none"."""
    attn_softcap: bool = False
    """config.attn_logit_softcapping: scores = cap * tanh(scores / cap) before the mask, in attention
    implementations that take a softcap (HF's sdpa path drops it; so does the engine then, see layers)."""
    final_softcap: bool = False
    """config.final_logit_softcapping on the logits, in the model dtype (Gemma)."""
    rope_by_layer_type: bool = False
    """One rotary table per config.layer_types entry (rotary_emb(x, pos, layer_type); Gemma-3's local and
    global bases)."""
    must_be_off: tuple = ()
    """Config fields the engine cannot serve when truthy (named in the error)."""


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(window="module"),
    "qwen3": Family(window="module", qk_norm="head"),
    "mistral": Family(window="config"),
    "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",), window="config"),
    "gemma2": Family(norms=_SANDWICH_NORMS, norm_form="gemma", act_field="hidden_activation", embed_scale=True,
                     window="module", attn_softcap=True, final_softcap=True,
                     must_be_off=("use_bidirectional_attention",)),
    # Gemma-3's attention module keeps attn_logit_softcapping but never passes it on: HF applies none.
    "gemma3_text": Family(norms=_SANDWICH_NORMS, norm_form="gemma", qk_norm="head", act_field="hidden_activation",
                          embed_scale=True, window="module", final_softcap=True, rope_by_layer_type=True,
                          must_be_off=("use_bidirectional_attention",)),
    "olmo2": Family(norms=_POST_NORMS, norm_form="fp32", qk_norm="full"),
}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
"""HF activation name -> the engine's (F.silu, F.gelu, F.gelu(approximate="tanh"), as transformers' ACT2FN)."""

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""rope_types whose frequencies change with the sequence length inside HF's forward: not served."""
