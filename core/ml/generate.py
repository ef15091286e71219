"""Sampling responses on one rank's unsharded inference copy: no collectives while generating."""

import logging
import time

import torch

from verlflow.core.blueprint.sections import RolloutSpec
from verlflow.core.errors import InputError

log = logging.getLogger("verlflow.generate")


def prompt_ids(tok, messages: list[dict], tools: list[dict] | None = None, *,
               generation_prompt: bool = True) -> list[int]:
    """A prompt's tokens as the rollout feeds them: chat template (with the tool schemas `tools`), generation
    prompt."""
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_prompts(tok, messages: list[list[dict]], max_len: int, rows: list[int]) -> list[list[int]]:
    out = []
    for msgs, row in zip(messages, rows):
        ids = prompt_ids(tok, msgs)
        if len(ids) > max_len:
            raise InputError(
                f"data.max_prompt_length={max_len}: prompt of dataset row {row} is {len(ids)} tokens after the "
                "chat template; raise data.max_prompt_length or drop overlong prompts."
            )
        out.append(ids)
    return out


def left_pad(seqs: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = width or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


def response_lengths(responses: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """Tokens up to and including the first EOS (or all of them when none)."""
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= responses == e
    has = is_eos.any(dim=1)
    first = torch.where(has, is_eos.float().argmax(dim=1) + 1, torch.full_like(has, responses.shape[1], dtype=torch.long))
    return first


# Sampling knobs a model's own generation_config.json may set (Qwen2.5-Instruct: repetition_penalty, top_k, top_p,
# temperature) and HF generate would apply under the blueprint's: switched off, so the rollout section alone says
# what is sampled, as in the static engine, and the log-probs the update computes are those of the sampler.
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                    "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
                    "min_length": 0, "min_new_tokens": None, "bad_words_ids": None, "suppress_tokens": None,
                    "begin_suppress_tokens": None, "sequence_bias": None, "exponential_decay_length_penalty": None}


def sampling_temperature(temperature: float) -> float:
    """The temperature the sampling logits are divided by; greedy (0) scores at 1, as the update's forward does."""
    return temperature if temperature > 0 else 1.0


def chosen_logprobs(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax(scores)[chosen] per row: scores (B, V) already divided by the temperature."""
    x = scores.float()
    return x.gather(1, chosen.view(-1, 1)).squeeze(1) - torch.logsumexp(x, dim=-1)


class _TemperatureRecorder:
    """HF's temperature warper, as a logits processor that also keeps each step's scaled scores until the next
    step's input shows the token chosen from them. It is the only warper of an untruncated sampler (top_p=1,
    top_k=0), so where HF puts it in its list does not matter (transformers 5 runs custom processors before its
    own warpers)."""

    def __init__(self, temperature: float):
        self.temperature = sampling_temperature(temperature)
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.prev = scores / self.temperature
        return self.prev

    def take(self, chosen: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(chosen_logprobs(self.prev, chosen.to(self.prev.device)))  # on the device: no sync
            self.prev = None

    def result(self, last: torch.Tensor) -> torch.Tensor:
        """(B, steps) log-probs, once generate returned with `last`, its final tokens."""
        self.take(last)
        return torch.stack(self.steps, dim=1)


@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], cfg: RolloutSpec, device: torch.device, seed: int,
           progress=None, timings: dict | None = None, logprobs: list | None = None) -> list[list[int]]:
    """Responses (without padding, EOS kept) for each prompt, in micro-batches of cfg.micro_batch_size.
    `timings["setup_s"]` is where an engine adds its set-up time; HF generate has none to add. `logprobs`: a list
    that gets each response's fp32 per-token log-probs under the sampling logits (log_softmax(logits / T) of the
    chosen token) when sampling is untruncated (top_p=1, top_k=0); else it stays empty."""
    model.eval()
    record = logprobs is not None and records_logprobs(cfg)
    return in_micro_batches(hf_generator(model, tok, cfg, device, record), tok, prompts, cfg, seed, progress,
                            logprobs if record else None)


def records_logprobs(cfg: RolloutSpec) -> bool:
    """HF generate's log-probs are those of the sampling logits only when sampling is untruncated."""
    return cfg.top_p >= 1.0 and not cfg.top_k


def hf_generator(model, tok, cfg: RolloutSpec, device: torch.device, record: bool):
    """`generate(ids, mask, max_new_tokens=cfg.max_new_tokens) -> (new tokens, their log-probs or None)` of
    model.generate over left-padded `ids`, sampling as `cfg` says; log-probs when `record`."""
    from transformers import LogitsProcessorList

    gen_kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=sorted(eos_ids(tok)), use_cache=True,
                  **NEUTRAL_SAMPLING)
    if cfg.temperature > 0:  # a recorded sampler's temperature is the recorder's (HF then adds no warper of its own)
        gen_kw.update(do_sample=True, temperature=1.0 if record else cfg.temperature, top_p=cfg.top_p,
                      top_k=cfg.top_k or None)
    else:
        gen_kw.update(do_sample=False)

    def generate(ids, mask, max_new_tokens: int = cfg.max_new_tokens):
        rec = _TemperatureRecorder(cfg.temperature) if record else None
        extra = {"logits_processor": LogitsProcessorList([rec])} if rec is not None else {}
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             **gen_kw, **extra)[:, ids.shape[1]:]
        return gen, (rec.result(gen[:, -1]) if rec is not None else None)

    return generate


def eos_ids(tok) -> set[int]:
    """The token ids that end a response (a tokenizer may name one or several)."""
    eos = tok.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def in_micro_batches(generate, tok, prompts: list[list[int]], cfg: RolloutSpec, seed: int,
                     progress=None, logprobs: list | None = None) -> list[list[int]]:
    """Left-pad each micro-batch of cfg.micro_batch_size, call `generate(ids, mask) -> (responses, log-probs or
    None)`, cut each row after its EOS; each row's log-probs, cut alike, go to `logprobs` when it is a list."""
    out: list[list[int]] = []
    t0, n_tok = time.perf_counter(), 0
    ends = eos_ids(tok)
    for start in range(0, len(prompts), cfg.micro_batch_size):
        ids, mask = left_pad(prompts[start:start + cfg.micro_batch_size], tok.pad_token_id)
        torch.manual_seed(seed + start)  # a micro-batch's samples do not depend on the ones before it
        resp, logp = generate(ids, mask)
        resp = resp.cpu()
        logp = logp.float().cpu() if logp is not None else None
        for i, (row, n) in enumerate(zip(resp, response_lengths(resp, ends).tolist())):
            out.append(row[:n].tolist())
            if logprobs is not None and logp is not None:
                logprobs.append(logp[i, :n].tolist())
            n_tok += n
        if progress:
            dt = time.perf_counter() - t0
            progress(f"generated {len(out)}/{len(prompts)} sequences, {n_tok} tokens, {n_tok / max(dt, 1e-9):.0f} tok/s")
    return out
