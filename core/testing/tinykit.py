"""A tiny, self-contained model + dataset kit for tests and the demo: nothing is downloaded.

``make_tiny(out_dir)`` writes::

    <out_dir>/model/            a real Hugging Face folder: random-init Qwen2 / Llama causal LM (float32,
                                safetensors, untied embeddings) + a locally trained BPE tokenizer with a chat
                                template; loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained
    <out_dir>/data/train.parquet
    <out_dir>/data/test.parquet verl's RL schema: prompt (chat messages), data_source "tiny_digits", ability,
                                reward_model {style, ground_truth}, extra_info {split, index}
    <out_dir>/data/sft.parquet  the sft phase's columns: prompt (chat messages), response
    <out_dir>/data/dpo.parquet  the dpo phase's (TRL's): prompt, chosen, rejected (a wrong answer)
    <out_dir>/kit.json          what was made: arch, sizes, seed, files with sha256 and size

The task: "Write the digit 7 three times." -> "777" (digits 0-9, once .. six times, four phrasings). Its
reward (``verlflow.core.ml.rewards`` "tiny_digits") gives partial credit for any digit, the share of digit characters,
the target digit, and a bonus for the exact answer. A random-init model's samples (16 tokens at temperature
1.0) score 0.09 +- 0.125 on average, a third of them above zero, so most GRPO groups of 4 differ at once;
in a plain GRPO loop (16 prompts x 4, lr 5e-3..1e-2) the mean reward climbs to ~0.3-0.4 in 10-12 steps.

Everything is a function of ``seed`` (and the library versions): the same seed gives byte-identical files.
"""

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

from verlflow.core.errors import InputError

ARCHES = ("qwen2", "llama")
DATA_SOURCE = "tiny_digits"
ABILITY = "digits"
REWARD_NAME = "tiny_digits"

BOS, EOS, PAD, UNK = "<|begin|>", "<|end|>", "<|pad|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS) + ROLE_TOKENS  # ids 0..6 in this order
VOCAB_SIZE = 384  # 7 special tokens + 256 bytes + 121 merges
# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
)

# No newlines: "<|begin|><|user|>Write the digit 7 three times.<|end|><|assistant|>" ... "777<|end|>"
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('tiny chat template: role must be system, user or assistant, got ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

COUNT_WORDS = {1: "once", 2: "twice", 3: "three times", 4: "four times", 5: "five times", 6: "six times"}
TEMPLATES = (
    "Write the digit {d} {k}.",
    "Repeat the number {d} {k}.",
    "Type {d} {k}, nothing else.",
    "Please write {d} {k}.",
)

# General text so letters, words and punctuation get merges too (random samples are then a mix of digit
# and non-digit tokens: a low but non-zero mean reward with spread across a group).
_FILLER = (
    "The quick brown fox jumps over the lazy dog. A tiny model learns to answer with digits only! "
    "What is the answer? It is short: just the digit, repeated; no words, no spaces. "
    "Numbers such as 12, 345 and 6789 (or 0) appear in text, e.g. 'x = y + 1' and \"a/b\". "
    "Hello, world - how are you? Fine, thanks: 100% sure & ready #1 @home [ok] {yes} <no> ~ | ` ^ * _ $ "
)


def tiny_task(rng: random.Random) -> tuple[str, str]:
    """One (prompt, ground truth) pair of the tiny digits task."""
    d = rng.randrange(10)
    k = rng.randint(1, 6)
    template = TEMPLATES[rng.randrange(len(TEMPLATES))]
    return template.format(d=d, k=COUNT_WORDS[k]), str(d) * k


def make_tiny(
    out_dir,
    arch: str = "qwen2",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    n_train: int = 256,
    n_test: int = 64,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> dict:
    """Write a tiny model folder, RL parquet data and kit.json under ``out_dir``; return kit.json's content
    (plus absolute paths: ``model_dir``, ``train_file``, ``test_file``, ``kit_file``)."""
    if arch not in ARCHES:
        raise InputError(f"make_tiny: arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise InputError(
            f"make_tiny: hidden_size ({hidden_size}) must divide by num_heads ({num_heads}), "
            f"and num_heads by num_kv_heads ({num_kv_heads})"
        )
    if n_train < 1 or n_test < 1:
        raise InputError(f"make_tiny: n_train and n_test must be >= 1, got {n_train} and {n_test}")

    out = Path(out_dir).resolve()
    model_dir, data_dir = out / "model", out / "data"
    if model_dir.is_dir() and any(model_dir.iterdir()):
        if not (out / "kit.json").is_file():
            raise InputError(
                f"make_tiny: {model_dir} exists and is not empty, and {out} holds no kit.json: "
                "not overwriting a folder make_tiny did not write. Pick another out_dir."
            )
        shutil.rmtree(model_dir)  # an earlier kit: no stale weight files may survive
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    _write_model(model_dir, tokenizer, arch, hidden_size, num_layers, num_heads, num_kv_heads, seed,
                 tie_word_embeddings)
    tokenizer.save_pretrained(str(model_dir))

    rng = random.Random(f"tiny-data-{seed}")
    train_file, test_file = data_dir / "train.parquet", data_dir / "test.parquet"
    _write_parquet(train_file, [tiny_task(rng) for _ in range(n_train)], "train")
    _write_parquet(test_file, [tiny_task(rng) for _ in range(n_test)], "test")
    # The supervised phases' data (blueprint phases: sft, dpo) for the same task.
    sft_file, dpo_file = data_dir / "sft.parquet", data_dir / "dpo.parquet"
    _write_sft(sft_file, [tiny_task(rng) for _ in range(n_train)])
    _write_dpo(dpo_file, [tiny_task(rng) for _ in range(n_train)], rng)

    files = {}
    written = [q for q in model_dir.rglob("*") if q.is_file()] + [train_file, test_file, sft_file, dpo_file]
    for p in sorted(written):
        files[p.relative_to(out).as_posix()] = {"sha256": _sha256(p), "size": p.stat().st_size}
    kit: dict[str, Any] = {
        "kind": "verlflow-tiny-kit",
        "arch": arch,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": len(tokenizer),
        "seed": seed,
        "n_train": n_train,
        "n_test": n_test,
        "task": DATA_SOURCE,
        "data_source": DATA_SOURCE,
        "reward_function": REWARD_NAME,
        "special_tokens": {"bos": BOS, "eos": EOS, "pad": PAD, "unk": UNK, "roles": list(ROLE_TOKENS)},
        "model": "model",
        "train": "data/train.parquet",
        "test": "data/test.parquet",
        "sft": "data/sft.parquet",
        "dpo": "data/dpo.parquet",
        "files": files,
    }
    kit_file = out / "kit.json"
    kit_file.write_text(json.dumps(kit, indent=2, sort_keys=True) + "\n")
    return {
        **kit,
        "model_dir": str(model_dir),
        "train_file": str(train_file),
        "test_file": str(test_file),
        "sft_file": str(sft_file),
        "dpo_file": str(dpo_file),
        "kit_file": str(kit_file),
    }


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained here on the task's text (deterministic), as a PreTrainedTokenizerFast.

    Its pipeline is exactly Qwen2's (NFC, Qwen2's split regex - every digit its own pre-token - then
    byte-level BPE, byte-level decoder): in transformers 5, ``AutoTokenizer`` loads any folder whose
    config says ``model_type: qwen2`` as ``Qwen2Tokenizer``, which rebuilds that pipeline around the saved
    vocab and merges, ignoring the pipeline in tokenizer.json. Matching it makes both arches load the same
    tokenizer. All 256 bytes are in the vocabulary, so any text encodes (no unknown tokens).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.BPE(
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,  # never produced; named so Qwen2Tokenizer does not add its default "<|endoftext|>"
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=512,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _tokenizer_corpus() -> list[str]:
    lines = []
    for d in range(10):
        for k, word in COUNT_WORDS.items():
            for t in TEMPLATES:
                lines.append(t.format(d=d, k=word))
            lines.extend([str(d) * k] * 3)
    lines.extend([_FILLER] * 8)
    return lines


def _write_model(model_dir: Path, tokenizer, arch, hidden_size, num_layers, num_heads, num_kv_heads, seed, tied):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if arch == "qwen2":
        config, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    else:
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = config.bos_token_id, config.eos_token_id, config.pad_token_id
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" bars: noise in tests and `make demo`
    try:
        model.save_pretrained(str(model_dir), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _write_parquet(path: Path, pairs: list[tuple[str, str]], split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": p}] for p, _ in pairs],
            "data_source": [DATA_SOURCE] * len(pairs),
            "ability": [ABILITY] * len(pairs),
            "reward_model": [{"style": "rule", "ground_truth": gt} for _, gt in pairs],
            "extra_info": [{"split": split, "index": i} for i in range(len(pairs))],
        },
        schema=parquet_schema(),
    )
    pq.write_table(table, str(path))


def _write_sft(path: Path, pairs: list[tuple[str, str]]) -> None:
    """verl's SFT columns: a chat prompt and the response that answers it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": p}] for p, _ in pairs],
                             "response": [gt for _, gt in pairs]}), str(path))


def _write_dpo(path: Path, pairs: list[tuple[str, str]], rng: random.Random) -> None:
    """Preference pairs (TRL's columns): the right answer over one a digit or a repetition off."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def wrong(gt: str) -> str:
        d, k = int(gt[0]), len(gt)
        return str((d + 1) % 10) * k if rng.random() < 0.5 or k == 1 else gt[:-1]

    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": p}] for p, _ in pairs],
                             "chosen": [gt for _, gt in pairs], "rejected": [wrong(gt) for _, gt in pairs]}),
                   str(path))


def parquet_schema():
    """verl's RL parquet schema, as the kit writes it."""
    import pyarrow as pa

    return pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("data_source", pa.string()),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
