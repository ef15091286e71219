"""`algorithm.use_fused_kernels`: log-probs and entropies straight from the last hidden states, chunk by chunk.

The plain path materialises the response positions' logits in fp32 ([tokens, vocab]: 10 GB for 16k tokens over
Qwen's 152k vocabulary) and keeps the softmax intermediates for the backward. verl's `FusedLinearForPPO` computes
them a chunk of tokens at a time and recomputes the chunk's logits in the backward, so the update fits bigger
token budgets. The maths is verl's; this file only routes the policy's forward through it.

The head must run inside the model's own forward: FSDP unshards the root's parameters (the output layer, tied to
the embeddings in Qwen) only there. So `install` gives the policy a forward that takes the response positions and
labels, and leaves every other call (rollout's generate, the critic) on the model's original forward.
"""

from torch import nn


def install(model: nn.Module) -> nn.Module:
    """Let `model(..., ppo_labels=..., ppo_keep=...)` return (log_probs, entropy); idempotent, no-op for a model
    without an output layer (the critic's value head)."""
    if getattr(model, "_verlflow_fused", False) or model.get_output_embeddings() is None:
        return model
    plain = model.forward

    def forward(*args, ppo_labels=None, ppo_keep=None, ppo_temperature: float = 1.0, **kwargs):
        if ppo_labels is None:
            return plain(*args, **kwargs)
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        kwargs.pop("logits_to_keep", None)
        hidden = model.get_decoder()(*args, **kwargs).last_hidden_state
        # ppo_keep: a slice of positions (padded batch) or the [K] positions of the one packed row
        h = hidden[:, ppo_keep] if isinstance(ppo_keep, slice) else hidden[0, ppo_keep]
        weight = model.get_output_embeddings().weight
        logp, ent = FusedLinearForPPO()(h, weight, ppo_labels, ppo_temperature)
        return logp, ent.float()

    model.forward = forward
    model._verlflow_fused = True
    return model

