"""The tiny kit: a real HF model folder + tokenizer + verl-schema parquet, made locally and deterministically."""

import hashlib
import json
import os
import re
import statistics
import pytest

pytestmark = pytest.mark.unit

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from verlflow.core.errors import InputError  # noqa: E402
from verlflow.core.ml.rewards import get_reward  # noqa: E402
from verlflow.core.testing.tinykit import BOS, EOS, PAD, ROLE_TOKENS, build_tokenizer, make_tiny  # noqa: E402

COUNTS = {"once": 1, "twice": 2, "three times": 3, "four times": 4, "five times": 5, "six times": 6}


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, arch) for arch in ("qwen2", "llama")}


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_and_tokenizer_load_back(kits, arch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kit = kits[arch]
    tok = AutoTokenizer.from_pretrained(kit["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(kit["model_dir"])
    cfg = AutoConfig.from_pretrained(kit["model_dir"])

    assert cfg.model_type == arch
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert model.dtype == torch.float32
    assert cfg.tie_word_embeddings is False
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert os.path.isfile(os.path.join(kit["model_dir"], "model.safetensors"))

    # special tokens: ids agree between tokenizer, model config and generation config; pad != eos
    assert len(tok) == cfg.vocab_size == kit["vocab_size"]
    assert 300 <= len(tok) <= 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    ids = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == ids
    gc = model.generation_config
    assert (gc.eos_token_id, gc.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert tok.pad_token_id != tok.eos_token_id
    for role in ROLE_TOKENS:
        assert len(tok(role, add_special_tokens=False)["input_ids"]) == 1

    # The loaded tokenizer (Qwen2Tokenizer for qwen2 in transformers 5, which rebuilds its own pipeline)
    # encodes exactly like the one trained in memory, and round-trips any text (byte-level).
    ref = build_tokenizer()
    for text in ["Write the digit 7 three times.", "777", "Héllo, wörld! 12 + 30 = 42?\n\tok 日本 😀"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("777", add_special_tokens=False)["input_ids"]) == ["7", "7", "7"]

    out = model(**tok(["Write the digit 3 once."], return_tensors="pt"))
    assert out.logits.shape[-1] == cfg.vocab_size and torch.isfinite(out.logits).all()


def test_chat_template(kits):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(kits["qwen2"]["model_dir"])
    msgs = [{"role": "user", "content": "Write the digit 7 three times."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|begin|><|user|>Write the digit 7 three times.<|end|><|assistant|>"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # no double BOS either way
    assert tok(text)["input_ids"] == ids

    convo = [{"role": "system", "content": "Digits only."}, *msgs, {"role": "assistant", "content": "777"}]
    full = tok.apply_chat_template(convo, tokenize=False)
    assert full.endswith("<|assistant|>777<|end|>") and full.startswith("<|begin|><|system|>Digits only.<|end|>")
    with pytest.raises(Exception, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)

    # left padding for batched generation
    batch = tok([text, "<|user|>hi<|end|><|assistant|>"], add_special_tokens=False, padding=True)
    assert batch["input_ids"][1][0] == tok.pad_token_id and batch["attention_mask"][1][0] == 0


def test_parquet_schema_and_content(kits):
    kit = kits["qwen2"]
    expected = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("data_source", pa.string()),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    for split, n in (("train", 256), ("test", 64)):
        table = pq.read_table(kit[f"{split}_file"])
        assert table.schema.remove_metadata().equals(expected), table.schema
        assert table.num_rows == n == kit[f"n_{split}"]
        rows = table.to_pylist()
        assert [r["extra_info"] for r in rows] == [{"split": split, "index": i} for i in range(n)]
        for r in rows:
            assert r["data_source"] == "tiny_digits" and r["ability"] == "digits"
            assert r["reward_model"]["style"] == "rule"
            (msg,) = r["prompt"]
            assert msg["role"] == "user"
            m = re.search(r"(\d) (once|twice|\w+ times)", msg["content"])
            assert m, msg["content"]
            assert r["reward_model"]["ground_truth"] == m.group(1) * COUNTS[m.group(2)]
        assert len({r["reward_model"]["ground_truth"] for r in rows}) > 20  # digits and counts vary


def test_kit_json(kits):
    kit = kits["llama"]
    on_disk = json.loads(open(kit["kit_file"]).read())
    assert on_disk["arch"] == "llama" and on_disk["seed"] == 0 and on_disk["vocab_size"] == kit["vocab_size"]
    assert on_disk["reward_function"] == "tiny_digits"
    root = os.path.dirname(kit["kit_file"])
    assert {"model/model.safetensors", "model/config.json", "model/tokenizer.json", "data/train.parquet",
            "data/test.parquet"} <= set(on_disk["files"])
    for rel, meta in on_disk["files"].items():
        path = os.path.join(root, rel)
        assert _sha(path) == meta["sha256"] and os.path.getsize(path) == meta["size"]


def test_deterministic_for_a_seed(tmp_path, kits):
    a = make_tiny(tmp_path / "a", "qwen2", seed=0)
    b = kits["qwen2"]
    assert a["files"] == b["files"]  # byte-identical: data, weights, tokenizer, config
    c = make_tiny(tmp_path / "c", "qwen2", seed=1)
    changed = {k for k in a["files"] if a["files"][k] != c["files"][k]}
    assert changed == {"data/train.parquet", "data/test.parquet", "data/sft.parquet", "data/dpo.parquet",
                       "model/model.safetensors"}
    # remaking into the same folder replaces it (same files, nothing stale)
    again = make_tiny(tmp_path / "a", "qwen2", seed=0)
    assert again["files"] == a["files"]
    model_files = sorted(k.split("/")[1] for k in a["files"] if k.startswith("model/"))
    assert sorted(os.listdir(tmp_path / "a" / "model")) == model_files


def test_make_tiny_refuses_bad_input(tmp_path):
    with pytest.raises(InputError, match="arch"):
        make_tiny(tmp_path / "x", "gpt2")
    with pytest.raises(InputError, match="num_heads"):
        make_tiny(tmp_path / "x", hidden_size=64, num_heads=5)
    foreign = tmp_path / "foreign" / "model"
    foreign.mkdir(parents=True)
    (foreign / "precious.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="kit.json"):
        make_tiny(tmp_path / "foreign")
    assert (foreign / "precious.bin").exists()


def test_random_model_reward_is_low_but_varied(kits):
    """GRPO needs reward variance within a group from the very first iteration."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kit = kits["qwen2"]
    tok = AutoTokenizer.from_pretrained(kit["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(kit["model_dir"]).eval()
    rows = pq.read_table(kit["train_file"]).to_pylist()[:16]
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    n = 4
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=enc.input_ids.repeat_interleave(n, 0),
            attention_mask=enc.attention_mask.repeat_interleave(n, 0),
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
        )
    responses = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    reward = get_reward("tiny_digits")
    scores = [reward("tiny_digits", s, rows[i // n]["reward_model"]["ground_truth"]) for i, s in enumerate(responses)]
    mean, std = statistics.mean(scores), statistics.pstdev(scores)
    groups_with_spread = sum(len(set(scores[g * n:(g + 1) * n])) > 1 for g in range(len(rows)))
    assert 0.02 < mean < 0.3, (mean, std)
    assert std > 0.05, (mean, std)
    assert groups_with_spread >= len(rows) // 3, scores
