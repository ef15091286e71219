"""Supervised fine-tuning (SFT): its rows (read by core/ml/phasedata.py) in the rollout batch layout the RL update
reads, and its loss.

An SFT row becomes a rollout-shaped sample: `prompts` / `prompt_mask` (left-padded) hold the conversation up to
where training starts, rendered with the generation prompt exactly as the rollout feeds it; `responses` /
`response_mask` (right-padded) hold the rest of the chat template's rendering. The update's forward
(core/ml/forward.py: `Rows.of`, `packing.pack`) then gives per-token log-probs [N, R] unchanged, and one more key,
`loss_mask` [N, R], says which response tokens are trained on: every assistant turn's tokens after its generation
prompt (its content and the end-of-turn tokens the template emits after it, so the model learns to stop), nothing
of the user/system turns in between, nothing of the padding. For a single-turn row loss_mask == response_mask.

The loss is verl's "token-mean" (`core_algos.agg_loss`, the aggregation of verl's own `sft_loss`): the summed NLL
of the trained tokens over the mini-batch's trained-token count, so micro-batches and ranks add up to the
mini-batch's token mean.
"""

import torch

from verlflow.core.errors import InputError
from verlflow.core.ml.generate import left_pad, prompt_ids
from verlflow.core.ml.phasedata import Conversations, load_sft_rows  # noqa: F401 - the rows are read torch-free there


def _rendered(tok, messages: list[dict], where: str, *, generation_prompt: bool) -> list[int]:
    """The chat template's tokens of `messages` (with the generation prompt: the rollout's prompt_ids)."""
    try:
        if generation_prompt:
            return prompt_ids(tok, messages)
        ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    except Exception as e:
        raise InputError(f"{where}: the tokenizer's chat template failed on this conversation ({e}).") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _not_prefix(where: str, what: str) -> InputError:
    return InputError(
        f"{where}: the chat template renders {what} differently inside the full conversation than on its own "
        "(e.g. a template that rewrites earlier turns, such as dropping past reasoning), so the training tokens "
        "would not match what the model sees at inference. Use a template whose renderings of a conversation's "
        "prefixes are prefixes of its full rendering, or split the conversation into single-turn rows."
    )


def conversation_ids(tok, messages: list[dict], start: int, where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response loss mask) of one conversation. Assistant spans are found from the
    template's own renderings of the prefixes (messages[:k] with the generation prompt, messages[:k+1] without),
    not by searching strings, so any template that renders prefixes as prefixes works."""
    full = _rendered(tok, messages, where, generation_prompt=False)
    prompt = _rendered(tok, messages[:start], where, generation_prompt=True)
    if not prompt:
        raise InputError(f"{where}: the chat template renders an empty prompt; SFT needs at least one token "
                         "before the first trained token.")
    if full[:len(prompt)] != prompt:
        raise _not_prefix(where, f"the prompt (messages before turn {start}, with the generation prompt)")
    mask = [0] * len(full)
    for k in range(start, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        head = _rendered(tok, messages[:k], where, generation_prompt=True)
        turn = full if k == len(messages) - 1 else _rendered(tok, messages[:k + 1], where, generation_prompt=False)
        if turn[:len(head)] != head or full[:len(turn)] != turn:
            raise _not_prefix(where, f"assistant turn {k}")
        if len(turn) == len(head):
            raise InputError(f"{where}: assistant turn {k} renders to no tokens; give its text or drop the row.")
        mask[len(head):len(turn)] = [1] * (len(turn) - len(head))
    return prompt, full[len(prompt):], mask[len(prompt):]


def encode_sft(tok, conversations: Conversations | list[list[dict]], max_length: int,
               field: str = "phases[0].data.max_length") -> dict[str, torch.Tensor]:
    """The rollout-layout batch of `conversations`: {prompts, prompt_mask (left-padded), responses, response_mask
    (right-padded), loss_mask (float)}. A row longer than `max_length` (the blueprint's `field`) in total is an
    error, never truncated: a cut answer would teach the model to stop mid-sentence, or not to stop at all."""
    if not isinstance(conversations, Conversations):
        conversations = Conversations.of(conversations)
    if not len(conversations):
        raise InputError(f"{field}: no SFT rows to encode.")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # padding is masked out anyway
    prompts, responses, masks = [], [], []
    for msgs, start, where in zip(conversations.messages, conversations.start, conversations.origins):
        if start < 1 or start >= len(msgs) or msgs[start].get("role") != "assistant":
            raise InputError(f"{where}: needs a system or user turn, then an assistant turn to train on "
                             f"(roles {[m.get('role') for m in msgs]}).")
        p, r, m = conversation_ids(tok, msgs, start, where)
        if len(p) + len(r) > max_length:
            raise InputError(f"{field}={max_length}: {where} is {len(p) + len(r)} tokens after the chat template "
                             f"({len(p)} prompt + {len(r)} response); raise {field} or drop the row.")
        prompts.append(p)
        responses.append(r)
        masks.append(m)
    prompt_t, prompt_mask = left_pad(prompts, pad)
    width = max(len(r) for r in responses)
    resp_t = torch.full((len(responses), width), pad, dtype=torch.long)
    resp_mask = torch.zeros((len(responses), width), dtype=torch.long)
    loss_mask = torch.zeros((len(responses), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(responses, masks)):
        resp_t[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        resp_mask[i, :len(r)] = 1
        loss_mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"prompts": prompt_t, "prompt_mask": prompt_mask, "responses": resp_t, "response_mask": resp_mask,
            "loss_mask": loss_mask}


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor, *, tokens_in_batch: float | None = None,
             dp_size: int = 1) -> torch.Tensor:
    """Token-mean negative log-likelihood of the trained tokens: verl's `agg_loss(-logp, mask, "token-mean",
    dp_size, batch_num_tokens)`, the aggregation of verl's own sft_loss.

    `tokens_in_batch`: the trained tokens (loss_mask sum) of the whole mini-batch, over all its micro-batches and
    all ranks. Given, each micro-batch returns sum(-logp * mask) / tokens_in_batch * dp_size, so
      - on one rank, summing the micro-batches' losses (accumulating their gradients) gives the mini-batch token
        mean;
      - across ranks, pass dp_size=world when gradients are AVERAGED (FSDP/DDP's default reduction, and what
        verlflow's PPO update does: it passes dp_size=world to agg_loss): the average of the ranks' sums is then
        the global token mean. With gradients all-reduced by SUM, keep dp_size=1.
    Without it (one micro-batch, one rank): the local token mean (0 when nothing is trained)."""
    from verl.trainer.ppo.core_algos import agg_loss

    mask = loss_mask.to(logp.dtype)
    if tokens_in_batch is None and dp_size == 1 and not mask.any():
        return (logp * mask).sum()  # verl's mean would be 0/0; keeps the graph so backward() still runs
    return agg_loss(-logp, mask, "token-mean", dp_size=dp_size, batch_num_tokens=tokens_in_batch)


@torch.no_grad()
def sft_metrics(logp: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """{sft_loss: token-mean NLL, sft_ppl: its exp, sft_tokens: trained tokens}, as floats."""
    mask = loss_mask.to(torch.float64)
    tokens = float(mask.sum())
    nll = float(-(logp.to(torch.float64) * mask).sum() / tokens) if tokens else 0.0
    return {"sft_loss": nll, "sft_ppl": float(torch.tensor(nll, dtype=torch.float64).exp()), "sft_tokens": tokens}
