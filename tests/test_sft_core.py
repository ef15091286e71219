"""SFT data and loss (verlflow.core.ml.sft): chat-template encoding into the rollout layout, assistant-only loss
masks, verl's token-mean loss across micro-batches and ranks, and a real learning signal on the tiny model."""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from verlflow.core.errors import InputError
from verlflow.core.ml import sft
from verlflow.core.ml.forward import Rows, forward
from verlflow.core.testing.tinykit import tiny_task

pytestmark = pytest.mark.unit

EOS = "<|end|>"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to gain from threads; on a shared 2-core box they only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok(tiny_kit):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kit["model_dir"])


@pytest.fixture(scope="module")
def model(tiny_kit):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"], dtype=torch.float32).eval()


def write(path, columns: dict) -> str:
    pq.write_table(pa.table(columns), str(path))
    return str(path)


def render(tok, messages, gen: bool = False) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def row(batch: dict, i: int) -> tuple[list[int], list[int], list[int]]:
    """(real prompt ids, real response ids, loss mask over the real response) of sample i."""
    p = batch["prompts"][i][batch["prompt_mask"][i].bool()].tolist()
    keep = batch["response_mask"][i].bool()
    return p, batch["responses"][i][keep].tolist(), batch["loss_mask"][i][keep].long().tolist()


def spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The contiguous runs of ids where mask is 1."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


def logp_of(model, batch: dict, idx=None) -> torch.Tensor:
    rows = Rows.of(batch)
    idx = list(range(len(batch["prompts"]))) if idx is None else idx
    return forward(model, rows, idx, torch.device("cpu"))[0]


# -- data -----------------------------------------------------------------------------------------------------------

def test_single_turn_string_and_chat_prompts(tmp_path, tok):
    chat = [[{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": "Write 7 twice."}],
            [{"role": "user", "content": "Please write 3 once."}]]
    f1 = write(tmp_path / "s.parquet", {"prompt": ["Write the digit 7 three times.", "Type 0 twice, nothing else."],
                                        "response": ["777", "00"]})
    f2 = write(tmp_path / "c.parquet", {"prompt": chat, "response": ["77", "3"]})
    conv = sft.load_sft_rows([f1, f2])
    assert len(conv) == 4
    assert conv.messages[0] == [{"role": "user", "content": "Write the digit 7 three times."},
                                {"role": "assistant", "content": "777"}]
    b = sft.encode_sft(tok, conv, max_length=64)
    assert b["prompts"].dtype == b["responses"].dtype == torch.long
    P, R = b["prompts"].shape[1], b["responses"].shape[1]
    assert b["prompt_mask"].shape == (4, P) and b["loss_mask"].shape == b["response_mask"].shape == (4, R)
    assert torch.equal(b["loss_mask"].long(), b["response_mask"])
    assert (b["prompt_mask"][:, -1] == 1).all() and (b["response_mask"][:, 0] == 1).all()  # left / right padded
    assert (b["prompts"][b["prompt_mask"] == 0] == tok.pad_token_id).all()
    assert (b["responses"][b["response_mask"] == 0] == tok.pad_token_id).all()
    answers = ["777", "00", "77", "3"]
    for i, msgs in enumerate(conv.messages):
        p, r, _ = row(b, i)
        assert decode(tok, p + r) == render(tok, msgs)
        assert decode(tok, p) == render(tok, msgs[:-1], gen=True)  # what the rollout feeds at inference
        assert decode(tok, r) == answers[i] + EOS
        assert r[-1] == tok.eos_token_id


def test_few_shot_prompt_turns_stay_untrained(tmp_path, tok):
    prompt = [{"role": "user", "content": "Write 1 once."}, {"role": "assistant", "content": "1"},
              {"role": "user", "content": "Write 2 twice."}]
    b = sft.encode_sft(tok, sft.load_sft_rows([write(tmp_path / "f.parquet", {"prompt": [prompt],
                                                                             "response": ["22"]})]), 64)
    p, r, m = row(b, 0)
    assert decode(tok, p) == render(tok, prompt, gen=True) and decode(tok, r) == "22" + EOS and all(m)


def test_multi_turn_masks_exactly_the_assistant_turns(tmp_path, tok):
    msgs = [{"role": "system", "content": "Digits only."}, {"role": "user", "content": "Write 7 three times."},
            {"role": "assistant", "content": "777"}, {"role": "user", "content": "Now 5 twice."},
            {"role": "assistant", "content": "55"}]
    short = [{"role": "user", "content": "Write 4 once."}, {"role": "assistant", "content": "4"}]
    f = write(tmp_path / "m.parquet", {"messages": [msgs, short]})
    b = sft.encode_sft(tok, sft.load_sft_rows([f]), max_length=64)
    p, r, m = row(b, 0)
    assert decode(tok, p) == render(tok, msgs[:2], gen=True)
    assert decode(tok, p + r) == render(tok, msgs)
    assert [decode(tok, s) for s in spans(r, m)] == ["777" + EOS, "55" + EOS]
    untrained = [t for t, k in zip(r, m) if not k]
    assert decode(tok, untrained) == "<|user|>Now 5 twice." + EOS + "<|assistant|>"
    assert (b["loss_mask"][0] <= b["response_mask"][0]).all()  # padding never trained
    _, r1, m1 = row(b, 1)
    assert decode(tok, r1) == "4" + EOS and all(m1)
    assert b["loss_mask"][1].sum() == b["response_mask"][1].sum()
    # Plain lists work too (training from the first assistant turn), and give the same batch.
    b2 = sft.encode_sft(tok, [msgs, short], max_length=64)
    assert all(torch.equal(b[k], b2[k]) for k in b)


def test_bad_inputs_name_file_row_and_field(tmp_path, tok):
    f = write(tmp_path / "cols.parquet", {"question": ["q"], "answer": ["a"]})
    with pytest.raises(InputError, match=r"phases\[0\]\.data\.train_files\[0\]: .*cols\.parquet has no `messages` "
                                         r"column and no `prompt`\+`response` columns; columns are \['question', "):
        sft.load_sft_rows([f])
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "1"}]
    f = write(tmp_path / "noasst.parquet", {"messages": [ok, [{"role": "user", "content": "hi"}]]})
    with pytest.raises(InputError, match=r"train_files\[1\]: .*noasst\.parquet row 1: `messages` has no assistant"):
        sft.load_sft_rows([write(tmp_path / "ok.parquet", {"messages": [ok]}), f])
    f = write(tmp_path / "empty.parquet", {"prompt": ["a", "b"], "response": ["1", " "]})
    with pytest.raises(InputError, match=r"empty\.parquet row 1: `response` is empty"):
        sft.load_sft_rows([f], field="sft.files")
    with pytest.raises(InputError, match=r"sft\.files\[0\]: .*nope\.parquet does not exist"):
        sft.load_sft_rows([str(tmp_path / "nope.parquet")], field="sft.files")
    long = [{"role": "user", "content": "Write 7 three times."}, {"role": "assistant", "content": "777"}]
    n = len(tok.apply_chat_template(long, tokenize=False))  # chars >= tokens; used only as a bound
    f = write(tmp_path / "long.parquet", {"messages": [ok, long]})
    with pytest.raises(InputError, match=r"phases\[0\]\.data\.max_length=8: long\.parquet row 1 .* is \d+ tokens .*"
                                         r"raise phases\[0\]\.data\.max_length or drop the row"):
        sft.encode_sft(tok, sft.load_sft_rows([f]), max_length=8)
    assert len(sft.encode_sft(tok, sft.load_sft_rows([f]), max_length=n)["prompts"]) == 2


def test_template_that_rewrites_turns_is_refused(tiny_kit, tok):
    from transformers import AutoTokenizer

    odd = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    # The final assistant turn renders under another role tag than the generation prompt announces.
    odd.chat_template = ("{{ bos_token }}{% for m in messages %}{% if loop.last and m.role == 'assistant' %}"
                         "<|system|>{% else %}<|{{ m.role }}|>{% endif %}{{ m.content }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    msgs = [{"role": "user", "content": "Write 4 once."}, {"role": "assistant", "content": "4"}]
    with pytest.raises(InputError, match=r"row 0: the chat template renders the prompt .* differently"):
        sft.encode_sft(odd, [msgs], max_length=64)
    assert sft.encode_sft(tok, [msgs], max_length=64)["loss_mask"].sum() == 2  # "4", <|end|>


# -- loss -----------------------------------------------------------------------------------------------------------

def mixed_batch(tok) -> dict:
    rng = random.Random(1)
    convs = []
    for i in range(5):
        (q1, a1), (q2, a2) = tiny_task(rng), tiny_task(rng)
        msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}]
        if i % 2:
            msgs += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        convs.append(msgs)
    return sft.encode_sft(tok, convs, max_length=128)


def test_loss_is_cross_entropy_of_the_masked_tokens(tok, model):
    b = mixed_batch(tok)
    assert (b["loss_mask"] < b["response_mask"]).any()  # the multi-turn rows leave a user turn untrained
    with torch.no_grad():
        logp = logp_of(model, b)
        # By hand: each sample unpadded, HF logits, the cross-entropy of each response token given what precedes it.
        nll, count = 0.0, 0
        for i in range(len(b["prompts"])):
            p, r, m = row(b, i)
            ids = torch.tensor([p + r])
            logits = model(input_ids=ids).logits[0, :-1].float()
            ce = F.cross_entropy(logits, ids[0, 1:], reduction="none")[len(p) - 1:]
            assert torch.allclose(-ce, logp[i, :len(r)], atol=1e-5)  # per token: a shifted layout fails here
            nll += float((ce * torch.tensor(m, dtype=torch.float32)).sum())
            count += sum(m)
    loss = sft.sft_loss(logp, b["loss_mask"])
    assert loss.item() == pytest.approx(nll / count, rel=1e-5)
    metrics = sft.sft_metrics(logp, b["loss_mask"])
    assert metrics["sft_tokens"] == count and metrics["sft_loss"] == pytest.approx(nll / count, rel=1e-5)
    assert metrics["sft_ppl"] == pytest.approx(torch.tensor(nll / count).exp().item(), rel=1e-5)


def test_micro_batches_and_ranks_add_up_to_the_batch_token_mean(tok, model):
    b = mixed_batch(tok)
    T = float(b["loss_mask"].sum())

    def grads(parts, dp_size=1):
        """Summed micro-batch losses and their accumulated gradients, one (loss, grads) per rank."""
        out = []
        for rank_parts in parts:
            model.zero_grad(set_to_none=True)
            total = 0.0
            for idx in rank_parts:
                loss = sft.sft_loss(logp_of(model, b, idx), b["loss_mask"][idx],
                                    tokens_in_batch=None if len(parts) == 1 and len(rank_parts) == 1 else T,
                                    dp_size=dp_size)
                loss.backward()
                total += loss.item()
            out.append((total, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
        return out

    ((whole, g_whole),) = grads([[[0, 1, 2, 3, 4]]])
    ((split, g_split),) = grads([[[0, 3], [1, 2, 4]]])  # 2 micro-batches, one rank
    assert split == pytest.approx(whole, rel=1e-5)
    assert all(torch.allclose(a, c, rtol=1e-4, atol=1e-7) for a, c in zip(g_whole, g_split))
    # 2 ranks whose gradients are averaged (FSDP's reduction): dp_size=world.
    ranks = grads([[[0], [3]], [[1, 2, 4]]], dp_size=2)
    assert (ranks[0][0] + ranks[1][0]) / 2 == pytest.approx(whole, rel=1e-5)
    avg = [(a + c) / 2 for a, c in zip(ranks[0][1], ranks[1][1])]
    assert all(torch.allclose(a, c, rtol=1e-4, atol=1e-7) for a, c in zip(g_whole, avg))
    # Same as verl's aggregation called the way its trainers do.
    from verl.trainer.ppo.core_algos import agg_loss

    with torch.no_grad():
        logp = logp_of(model, b, [1, 2, 4])
    ours = sft.sft_loss(logp, b["loss_mask"][[1, 2, 4]], tokens_in_batch=T, dp_size=2)
    assert ours.item() == pytest.approx(agg_loss(-logp, b["loss_mask"][[1, 2, 4]], "token-mean", dp_size=2,
                                                 batch_num_tokens=T).item(), rel=1e-6)
    assert sft.sft_loss(logp, torch.zeros_like(logp)).item() == 0.0


def test_a_few_steps_lower_the_sft_loss(tiny_kit, tok):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"], dtype=torch.float32)
    rng = random.Random(3)
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in (tiny_task(rng) for _ in range(8))]
    b = sft.encode_sft(tok, convs, max_length=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    with torch.no_grad():
        before = sft.sft_metrics(logp_of(model, b), b["loss_mask"])["sft_loss"]
    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        sft.sft_loss(logp_of(model, b), b["loss_mask"]).backward()
        opt.step()
    with torch.no_grad():
        after = sft.sft_metrics(logp_of(model, b), b["loss_mask"])["sft_loss"]
    assert after < 0.7 * before, (before, after)
