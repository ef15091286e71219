"""Direct Preference Optimization: the batch of preference pairs (core/ml/phasedata.py reads them), sequence
log-probs and the loss.

A preference batch of M pairs is laid out as a rollout batch of 2M rows (prompts left-padded, responses
right-padded: core/ml/rollout.py save_batch), so the RL update's forward (core/ml/forward.py) scores it
unchanged. Row order: rows 0..M-1 hold the chosen replies, rows M..2M-1 the rejected ones, pair i's two rows having
the same prompt. `sequence_logps` turns the per-token log-probs into one number per row and `dpo_loss` splits that
vector in halves.

Losses (TRL's names; logits = (pi_c - pi_r) - (ref_c - ref_r), per pair, averaged over the pairs):
  sigmoid  DPO (Rafailov et al. 2023), with cDPO's label smoothing: -(1-ls) logsigmoid(beta z) - ls logsigmoid(-beta z)
  ipo      IPO (Azar et al. 2023): (z - 1/(2 beta))^2, on length-averaged log-probs as TRL does
  hinge    SLiC (Zhao et al. 2023): relu(1 - beta z)
"""

import torch
import torch.nn.functional as F

from verlflow.core.errors import InputError
from verlflow.core.ml.generate import eos_ids, left_pad, prompt_ids
from verlflow.core.ml.phasedata import Pair, load_preferences  # noqa: F401 - the pairs are read torch-free there

LOSSES = ("sigmoid", "ipo", "hinge")
# Losses whose sequence log-prob is the mean over the response's tokens, not the sum: IPO's target margin
# 1/(2 beta) is on a per-token scale (TRL averages for ipo; a summed log-prob would make the target length-bound).
AVERAGED = ("ipo",)


# -- encoding -----------------------------------------------------------------------------------------------------


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    """A whole conversation's tokens as the chat template renders it (no generation prompt)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def reply_ids(tok, pair: Pair, prompt: list[int], text: str) -> list[int]:
    """The tokens the chat template appends to `prompt` (the pair's prompt tokens, generation prompt included) for
    the assistant reply `text`, up to and including its last end-of-turn token: what a rollout would have sampled
    (sampling stops at EOS, so anything a template writes after it, such as Qwen's newline, is never scored)."""
    full = _chat_ids(tok, pair.prompt + [{"role": "assistant", "content": text}])
    if full[:len(prompt)] != prompt:
        at = next((k for k, (a, b) in enumerate(zip(full, prompt)) if a != b), min(len(full), len(prompt)))
        raise InputError(
            f"{pair.where}: the chat template does not render the prompt the same way with the assistant reply "
            f"appended (tokens differ from position {at} of {len(prompt)}), so the reply's tokens cannot be told "
            "apart; use a template whose generation prompt is a prefix of the rendered conversation (e.g. one that "
            "does not rewrite earlier turns or add reasoning tags to the last reply)."
        )
    reply = full[len(prompt):]
    ends = [k for k, t in enumerate(reply) if t in eos_ids(tok)]
    if ends:
        reply = reply[:ends[-1] + 1]
    if not reply:
        raise InputError(f"{pair.where}: the chat template renders the reply as no tokens; check the tokenizer's "
                         "chat_template.")
    return reply


def encode_pairs(tok, pairs: list[Pair], max_length: int, field: str) -> dict[str, torch.Tensor]:
    """The 2M-row batch of M pairs (rows 0..M-1 chosen, M..2M-1 rejected, same prompts in the same order):
    prompts/prompt_mask left-padded, responses/response_mask right-padded, all with the tokenizer's pad id.
    A pair longer than `max_length` (prompt + its longer reply; the blueprint's `field`) is an error, never cut:
    a truncated reply loses its end-of-turn token and changes what is preferred."""
    if not pairs:
        raise InputError(f"{field}: no preference pairs to encode.")
    prompts, chosen, rejected = [], [], []
    for pair in pairs:
        p = prompt_ids(tok, pair.prompt)
        c, r = reply_ids(tok, pair, p, pair.chosen), reply_ids(tok, pair, p, pair.rejected)
        longer = max(len(c), len(r))
        if len(p) + longer > max_length:
            raise InputError(
                f"{field}={max_length}: the pair at {pair.where} is {len(p) + longer} tokens (prompt {len(p)} + "
                f"longer reply {longer}) after the chat template; raise {field} or drop the row."
            )
        prompts.append(p)
        chosen.append(c)
        rejected.append(r)
    ids, mask = left_pad(prompts + prompts, tok.pad_token_id)
    responses, response_mask = right_pad(chosen + rejected, tok.pad_token_id)
    return {"prompts": ids, "prompt_mask": mask, "responses": responses, "response_mask": response_mask}


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


# -- the loss -----------------------------------------------------------------------------------------------------


def _check_loss(loss_type: str) -> None:
    if loss_type not in LOSSES:
        raise ValueError(f"DPO loss_type must be one of {', '.join(LOSSES)}, got {loss_type!r}")


def sequence_logps(logp: torch.Tensor, response_mask: torch.Tensor, loss_type: str = "sigmoid") -> torch.Tensor:
    """[N] log-prob of each response from per-token log-probs [N, R] (padding masked out): the sum, as DPO's
    log pi(y|x) is; for the losses in AVERAGED (ipo) the mean over the response's tokens, as TRL does."""
    _check_loss(loss_type)
    m = response_mask.to(logp.dtype)
    total = (logp * m).sum(-1)
    if loss_type in AVERAGED:
        return total / m.sum(-1).clamp(min=1)
    return total


def dpo_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The mean loss over the M pairs of 2M sequence log-probs (first half chosen, second half rejected), and its
    metrics under TRL's names as detached 0-d tensors (read them once: an .item() each would stall the device).
    `label_smoothing` (cDPO's assumed label-flip rate) applies to sigmoid only; the reference gets no gradient."""
    _check_loss(loss_type)
    if beta <= 0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"DPO label_smoothing applies to the sigmoid loss only, not {loss_type!r}; set it to 0")
    if policy_logps.shape != ref_logps.shape or policy_logps.dim() != 1 or len(policy_logps) % 2:
        raise ValueError(f"dpo_loss takes two [2M] vectors (M chosen rows then M rejected rows), got "
                         f"{tuple(policy_logps.shape)} and {tuple(ref_logps.shape)}")
    pi_c, pi_r = policy_logps.chunk(2)
    ref_c, ref_r = ref_logps.detach().chunk(2)
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * logits)
    chosen = beta * (pi_c - ref_c).detach()
    rejected = beta * (pi_r - ref_r).detach()
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/margins": (chosen - rejected).mean(),
               "rewards/accuracies": (chosen > rejected).float().mean(),
               "logps/chosen": pi_c.detach().mean(), "logps/rejected": pi_r.detach().mean()}
    return losses.mean(), metrics
