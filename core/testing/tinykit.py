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

``make_tiny(out_dir, task="calculator")`` writes the agent mode's kit (blueprints/tiny-agent.yaml) instead: a
128-token vocabulary (printable ASCII, a ``<|tool|>`` role, ``<tool_call>``/``</tool_call>`` as single tokens),
a chat template that renders ``tools`` and tool messages, two-digit word problems ("A box holds 23 eggs. How many
eggs are in 41 boxes?" -> 943, extra_info.expression "23*41") in train/test, and worked trajectories (call,
result, answer) in data/sft.parquet. A random-init model never samples a whole right call (0 of 200 trajectories;
14% of its turns open a ``<tool_call>``); after 2 sft epochs ~10% of trajectories call right, and GRPO raises that.

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


# -- the calculator kit (task="calculator"): the agent mode's tiny task ------------------------------------------
TASKS = ("digits", "calculator")
CALC_DATA_SOURCE = "tiny_calculator"
TOOL_ROLE = "<|tool|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"  # single ids, kept in decoded text (as in Qwen2.5)
CALC_VOCAB_SIZE = 128  # 8 special tokens + 2 tool-call tags + 96 characters + 22 merges
CALC_TOOLS_LINE = "Tools: calculator(expression)"  # how CALC_CHAT_TEMPLATE renders the calculator environment's tools

# The tools rendered as one system line of signatures (`calculator(expression)`): a prompt of tens of tokens, not
# the hundreds a JSON schema takes. Tool results are `<|tool|>...<|end|>` turns; an assistant message's OpenAI
# `tool_calls` render as Hermes calls, as in Qwen2.5's template.
CALC_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- if tools -%}"
    "{{- '<|system|>' + (system + ' ' if system else '') + 'Tools:' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = fn['parameters']['properties'] if fn['parameters'] is defined and "
    "fn['parameters']['properties'] is defined else {} -%}"
    "{{- ' ' + fn['name'] + '(' + (params | list | join(', ')) + ')' -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('tiny chat template: role must be system, user, assistant or tool, got ' "
    "+ message['role']) -}}"
    "{%- endif -%}"
    "{%- if not (loop.first and system is not none and tools) -%}"
    "{{- '<|' + message['role'] + '|>' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] or [] if message['role'] == 'assistant' -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

# (question, operator): the numbers are two-digit, so the sure way to the answer is the calculator tool.
CALC_PROBLEMS = (
    ("Ann has {a} pens and gets {b} more. How many pens does she have?", "+"),
    ("A shop sold {a} cups on Monday and {b} on Tuesday. How many cups in all?", "+"),
    ("Tom had {a} coins and spent {b}. How many coins are left?", "-"),
    ("A tank holds {a} liters; {b} leak out. How many liters remain?", "-"),
    ("A box holds {a} eggs. How many eggs are in {b} boxes?", "*"),
    ("Each bus seats {a} people. How many seats do {b} buses have?", "*"),
)


def calculator_task(rng: random.Random) -> tuple[str, str, str]:
    """One (question, expression, answer) of the calculator task; the answer is the expression's value."""
    question, op = CALC_PROBLEMS[rng.randrange(len(CALC_PROBLEMS))]
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and a < b:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return question.format(a=a, b=b), f"{a}{op}{b}", str(value)


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
    task: str = "digits",
) -> dict:
    """Write a tiny model folder, RL parquet data and kit.json under ``out_dir``; return kit.json's content
    (plus absolute paths: ``model_dir``, ``train_file``, ``test_file``, ``kit_file``). `task`: digits (the tiny
    digits task, sft and dpo data too), or calculator (rollout.mode agent: a tokenizer and chat template with
    tools and the tool role, calculator word problems)."""
    if arch not in ARCHES:
        raise InputError(f"make_tiny: arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    if task not in TASKS:
        raise InputError(f"make_tiny: task must be one of {', '.join(TASKS)}, got {task!r}")
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

    tokenizer = build_tokenizer() if task == "digits" else build_calculator_tokenizer()
    _write_model(model_dir, tokenizer, arch, hidden_size, num_layers, num_heads, num_kv_heads, seed,
                 tie_word_embeddings)
    tokenizer.save_pretrained(str(model_dir))
    write_data = _write_digits_data if task == "digits" else _write_calculator_data
    data = write_data(data_dir, seed, n_train, n_test)

    files = {}
    written = [q for q in model_dir.rglob("*") if q.is_file()] + list(data.values())
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
        **_TASK_RECORDS[task],
        "model": "model",
        **{name: path.relative_to(out).as_posix() for name, path in data.items()},
        "files": files,
    }
    kit_file = out / "kit.json"
    kit_file.write_text(json.dumps(kit, indent=2, sort_keys=True) + "\n")
    return {
        **kit,
        "model_dir": str(model_dir),
        **{f"{name}_file": str(path) for name, path in data.items()},
        "kit_file": str(kit_file),
    }


# What kit.json says of each task.
_TASK_RECORDS = {
    "digits": {"task": DATA_SOURCE, "data_source": DATA_SOURCE, "reward_function": REWARD_NAME,
               "special_tokens": {"bos": BOS, "eos": EOS, "pad": PAD, "unk": UNK, "roles": list(ROLE_TOKENS)}},
    "calculator": {"task": CALC_DATA_SOURCE, "data_source": CALC_DATA_SOURCE, "environment": "calculator",
                   "special_tokens": {"bos": BOS, "eos": EOS, "pad": PAD, "unk": UNK,
                                      "roles": [*ROLE_TOKENS, TOOL_ROLE], "tool_call": [TOOL_CALL, TOOL_CALL_END]}},
}


def _write_digits_data(data_dir: Path, seed: int, n_train: int, n_test: int) -> dict[str, Path]:
    """The digits task's RL splits, and the supervised phases' data (blueprint phases: sft, dpo) for it."""
    rng = random.Random(f"tiny-data-{seed}")
    data = {name: data_dir / f"{name}.parquet" for name in ("train", "test", "sft", "dpo")}
    _write_parquet(data["train"], [tiny_task(rng) for _ in range(n_train)], "train")
    _write_parquet(data["test"], [tiny_task(rng) for _ in range(n_test)], "test")
    _write_sft(data["sft"], [tiny_task(rng) for _ in range(n_train)])
    _write_dpo(data["dpo"], [tiny_task(rng) for _ in range(n_train)], rng)
    return data


def _write_calculator_data(data_dir: Path, seed: int, n_train: int, n_test: int) -> dict[str, Path]:
    """The calculator task's RL splits (verl's schema, the expression in extra_info: what a right call holds), and
    worked trajectories for an sft phase: a random-init model never samples a whole right call (0 of 200
    trajectories), so GRPO starts from a policy that has seen a few."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(f"tiny-calculator-{seed}")
    data = {name: data_dir / f"{name}.parquet" for name in ("train", "test", "sft")}
    for (name, path), n in zip(list(data.items())[:2], (n_train, n_test)):
        problems = [calculator_task(rng) for _ in range(n)]
        pq.write_table(pa.table({
            "prompt": [[{"role": "user", "content": q}] for q, _, _ in problems],
            "data_source": [CALC_DATA_SOURCE] * n,
            "ability": ["arithmetic"] * n,
            "reward_model": [{"style": "rule", "ground_truth": answer} for _, _, answer in problems],
            "extra_info": [{"split": name, "index": i, "expression": e} for i, (_, e, _) in enumerate(problems)],
        }), str(path))
    pq.write_table(pa.table({"messages": [_worked(*calculator_task(rng)) for _ in range(n_train)]}), str(data["sft"]))
    return data


def _worked(question: str, expression: str, answer: str) -> list[dict]:
    """A right trajectory as sft `messages`. The system turn is the line the template renders for the calculator
    environment's tools: the sft phase's prompt is then the agent rollout's, token for token."""
    return [{"role": "system", "content": CALC_TOOLS_LINE}, {"role": "user", "content": question},
            {"role": "assistant", "content": f"{TOOL_CALL}{expression}{TOOL_CALL_END}"},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained here on the task's text (deterministic), as a PreTrainedTokenizerFast.

    Its pipeline is exactly Qwen2's (NFC, Qwen2's split regex - every digit its own pre-token - then
    byte-level BPE, byte-level decoder): in transformers 5, ``AutoTokenizer`` loads any folder whose
    config says ``model_type: qwen2`` as ``Qwen2Tokenizer``, which rebuilds that pipeline around the saved
    vocab and merges, ignoring the pipeline in tokenizer.json. Matching it makes both arches load the same
    tokenizer. All 256 bytes are in the vocabulary, so any text encodes (no unknown tokens).
    """
    from tokenizers import pre_tokenizers

    tok = _train_bpe(_tokenizer_corpus(), list(SPECIAL_TOKENS), vocab_size, pre_tokenizers.ByteLevel.alphabet())
    return _fast(tok, list(ROLE_TOKENS), CHAT_TEMPLATE)


def build_calculator_tokenizer(vocab_size: int = CALC_VOCAB_SIZE):
    """The calculator kit's tokenizer: build_tokenizer's pipeline with a tool role, the tool-call tags as single
    tokens, and an alphabet of printable ASCII and newline only (a small vocabulary: a random-init model then
    samples a tag or a digit often enough for GRPO to find a right call). Another character is dropped."""
    from tokenizers import AddedToken, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = sorted({byte_level.pre_tokenize_str(chr(c))[0][0] for c in [10, *range(32, 127)]})
    tok = _train_bpe(_calculator_corpus(), [*SPECIAL_TOKENS, TOOL_ROLE], vocab_size - 2, alphabet)
    # Not special (as in Qwen2.5): decoding with skip_special_tokens keeps them for the tool-call parser.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL, TOOL_CALL_END)])
    return _fast(tok, [*ROLE_TOKENS, TOOL_ROLE], CALC_CHAT_TEMPLATE)


def _train_bpe(corpus: list[str], specials: list[str], vocab_size: int, alphabet: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _fast(tok, roles: list[str], chat_template: str):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,  # never produced; named so Qwen2Tokenizer does not add its default "<|endoftext|>"
        extra_special_tokens=roles,
        model_max_length=512,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def _calculator_corpus() -> list[str]:
    """The questions, calls and answers of the task, and the template's own text."""
    rng = random.Random("tiny-calculator-corpus")
    lines = [CALC_TOOLS_LINE] * 4
    for _ in range(200):
        question, expression, answer = calculator_task(rng)
        lines += [question, expression, answer]
    return lines


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
