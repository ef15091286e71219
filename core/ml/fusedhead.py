"""`algorithm.use_fused_kernels`: log-probs and entropies straight from the last hidden states, chunk by chunk.

The plain path materialises the response positions' logits in fp32 ([tokens, vocab]: 10 GB for 16k tokens over
Qwen's 152k vocabulary) and keeps the softmax intermediates for the backward. verl's `FusedLinearForPPO` computes
them a chunk of tokens at a time and recomputes the chunk's logits in the backward, so the update fits bigger
token budgets. The maths is verl's; this file only routes the policy's forward through it.

Two backends (`algorithm.fused_kernels_backend`, verl's `fused_kernel_options.impl_backend`): "torch" runs
FusedLinearForPPO, whose chunks still write fp32 logits to memory and read them back five or six times (softmax,
log-softmax, entropy); "triton" runs verl's `linear_cross_entropy` kernels, which keep each tile's logits on the
chip and return the same two quantities (CUDA only).

The head must run inside the model's own forward: FSDP unshards the root's parameters (the output layer, tied to
the embeddings in Qwen) only there. So `install` gives the policy a forward that takes the response positions and
labels, and leaves every other call (rollout's generate, the critic) on the model's original forward.
"""

import torch
from torch import nn

BACKENDS = ("torch", "triton")


class _ContiguousGrads(torch.autograd.Function):
    """Identity whose backward hands on contiguous gradients: verl's Triton backward asserts them, and a loss
    can give broadcast ones (the gradient of a sum is an expanded scalar)."""

    @staticmethod
    def forward(ctx, logp, ent):
        return logp.view_as(logp), ent.view_as(ent)

    @staticmethod
    def backward(ctx, d_logp, d_ent):
        return d_logp.contiguous(), d_ent.contiguous()


def head(backend: str):
    """(hidden [K, H], weight [V, H], labels [K], temperature) -> (log-probs [K] fp32, entropies [K])."""
    if backend == "triton":
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        def triton_head(h, weight, labels, temperature):
            logp, ent = linear_cross_entropy(h.contiguous(), weight, labels.contiguous(), float(temperature), "none")
            return _ContiguousGrads.apply(logp, ent) if torch.is_grad_enabled() else (logp, ent)

        return triton_head
    if backend == "torch":
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        return FusedLinearForPPO()
    raise ValueError(f"algorithm.fused_kernels_backend={backend!r}: choose one of {BACKENDS}")


def install(model: nn.Module, backend: str = "torch") -> nn.Module:
    """Let `model(..., ppo_labels=..., ppo_keep=...)` return (log_probs, entropy); idempotent, no-op for a model
    without an output layer (the critic's value head)."""
    if getattr(model, "_verlflow_fused", False) or model.get_output_embeddings() is None:
        return model
    plain = model.forward
    fused = head(backend)

    def forward(*args, ppo_labels=None, ppo_keep=None, ppo_temperature: float = 1.0, **kwargs):
        if ppo_labels is None:
            return plain(*args, **kwargs)
        kwargs.pop("logits_to_keep", None)
        hidden = model.get_decoder()(*args, **kwargs).last_hidden_state
        # ppo_keep: a slice of positions (padded batch) or the [K] positions of the one packed row
        h = hidden[:, ppo_keep] if isinstance(ppo_keep, slice) else hidden[0, ppo_keep]
        if h.dim() == 3:  # padded rows: [B, R, H] -> [B * R, H] and back (the Triton kernels take 2-D)
            logp, ent = fused(h.flatten(0, 1), model.get_output_embeddings().weight, ppo_labels.flatten(),
                              ppo_temperature)
            return logp.view(ppo_labels.shape), ent.float().view(ppo_labels.shape)
        logp, ent = fused(h, model.get_output_embeddings().weight, ppo_labels, ppo_temperature)
        return logp, ent.float()

    model.forward = forward
    model._verlflow_fused = True
    return model
