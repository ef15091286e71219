"""A reward model (reward.model): an HF *ForSequenceClassification folder with one label, scoring each sample's
prompt (through its own tokenizer's chat template) + response in micro-batches.

Runs in every rank of the rollout, on that rank's own samples: no collective. The model is loaded once per process
(a warm pool's rollouts reuse it) in reward.model.dtype, on the rank's device.
"""

import functools
import torch

from verlflow.core.errors import InputError
from verlflow.core.ml.model import DTYPES


@functools.lru_cache(maxsize=2)
def _load(path: str, dtype: str, device: str):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    if model.config.num_labels != 1:
        raise InputError(f"reward.model.path={path}: the model has {model.config.num_labels} labels; a reward model "
                         "has one (num_labels: 1 in its config.json)")
    model.config.pad_token_id = tok.pad_token_id  # HF finds each row's last real token by it
    return tok, model


def _text(tok, messages: list[dict], response: str) -> str:
    if tok.chat_template:
        return tok.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    return "\n".join(m["content"] for m in messages) + "\n" + response


@torch.no_grad()
def score(spec, messages: list[list[dict]], responses: list[str], device) -> list[float]:
    """The reward model's score of each (prompt messages, response), in order."""
    tok, model = _load(str(spec.path), spec.dtype, str(device))
    out: list[float] = []
    for i in range(0, len(responses), spec.micro_batch_size):
        texts = [_text(tok, m, r) for m, r in zip(messages[i:i + spec.micro_batch_size],
                                                  responses[i:i + spec.micro_batch_size])]
        enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=spec.max_length,
                  add_special_tokens=False).to(device)
        out += model(**enc).logits[:, 0].float().cpu().tolist()
    return out
