"""The forward pass of a policy (or critic) over rows of a batch: per-token log-probs and entropies (or values) of
the response tokens, from padded rows or one padding-free packed row, through the fused head or full logits.

The update (ppo.py) and the supervised phases (supervised.py) score and train with it.
"""

from dataclasses import dataclass

import torch

from verlflow.core import faults
from verlflow.core.ml import packing


def sequences(batch: dict) -> dict:
    """input_ids, attention_mask, position_ids for prompt + response."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


@dataclass(frozen=True)
class Rows:
    """A batch as the model reads it: padded `inputs` (sequences()), or packed from `batch`; P = prompt width,
    R = response width."""
    batch: dict
    inputs: dict
    P: int
    R: int

    @classmethod
    def of(cls, batch: dict) -> "Rows":
        return cls(batch, sequences(batch), batch["prompts"].shape[1], batch["responses"].shape[1])


def forward(model, rows: Rows, idx, device, *, temperature: float = 1.0, packed: bool = False, critic: bool = False,
            pi2: bool = False):
    """Rows `idx`: (log-probs, entropies) [len(idx), R] of the logits / temperature (1: the model's own), or
    (values, None) of a critic; with `pi2` each token's sum of squared probabilities instead of its entropy.
    `packed`: one padding-free row (core/ml/packing.py), zeros on response padding."""
    from verlflow.core.checks import memplan

    tokens = int(rows.inputs["attention_mask"][idx].sum())
    memplan.note(micro_batch_tokens=tokens, samples=len(idx))  # an out-of-memory error names it (memplan.Watch)
    faults.oom_point(tokens)  # VERLFLOW_FAULT=oom_rank<N>_above<T>
    if packed:
        return _forward_packed(model, rows, idx, device, temperature, critic, pi2)
    return _forward(model, rows, idx, device, temperature, critic, pi2)


def _sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """Per token, sum over the vocabulary of p^2 (verl's optimal-token-baseline estimators read it)."""
    return torch.softmax(logits, dim=-1).square().sum(-1)


def _forward(model, rows: Rows, idx, device, temperature: float, critic: bool = False, pi2: bool = False):
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    P, R = rows.P, rows.R
    inputs = {k: v[idx].to(device) for k, v in rows.inputs.items()}
    if critic:
        return model(**inputs).logits[:, P - 1:P - 1 + R].float().squeeze(-1), None
    if _fused(model):
        return model(**inputs, use_cache=False, ppo_keep=slice(P - 1, P - 1 + R),
                     ppo_labels=inputs["input_ids"][:, P:P + R], ppo_temperature=temperature or 1.0)
    # Only the R positions that predict response tokens: the last R + 1 logits, minus the final one.
    logits = model(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    labels = inputs["input_ids"][:, P:P + R]
    return logprobs_from_logits(logits, labels), _sum_pi_squared(logits) if pi2 else entropy_from_logits(logits)


def _forward_packed(model, rows: Rows, idx, device, temperature: float, critic: bool = False, pi2: bool = False):
    """_forward over one padding-free row; returns the same [len(idx), R] layout (zeros on response padding)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    R = rows.R
    pk = packing.pack(rows.batch, idx).to(device)
    if critic:
        values = model(**pk.model_kwargs()).logits[0, pk.logit_idx, 0].float()
        return pk.unpack(values, len(idx), R), None
    if _fused(model):
        logp, ent = model(**pk.model_kwargs(), use_cache=False, ppo_keep=pk.logit_idx, ppo_labels=pk.labels,
                          ppo_temperature=temperature or 1.0)
        return pk.unpack(logp, len(idx), R), pk.unpack(ent, len(idx), R)
    logits = model(**pk.model_kwargs(), use_cache=False, logits_to_keep=pk.logit_idx).logits[0].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    # [1, K, V]: verl's fp32 log-prob loops over the leading dimension, which must not be the K tokens.
    logp = logprobs_from_logits(logits[None], pk.labels[None])[0]
    second = _sum_pi_squared(logits) if pi2 else entropy_from_logits(logits)
    return pk.unpack(logp, len(idx), R), pk.unpack(second, len(idx), R)


def _fused(model) -> bool:
    """The policy carries core/fusedhead's forward (algorithm.use_fused_kernels)."""
    return getattr(model, "_verlflow_fused", False)  # FSDP1's wrapper forwards unknown attributes to the module
