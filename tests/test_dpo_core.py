"""DPO (core/ml/dpo.py): preference parquet in TRL's forms -> the 2M-row rollout-layout batch the RL forward
scores, sequence log-probs, the three losses against the papers' formulas, and a tiny policy that learns a
preference."""

import copy
import math
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verlflow.core.errors import InputError
from verlflow.core.ml import dpo
from verlflow.core.ml.forward import Rows, forward, sequences
from verlflow.core.ml.model import load_tokenizer
from verlflow.core.testing.tinykit import CHAT_TEMPLATE

pytestmark = pytest.mark.unit

FIELD = "phases[0].data.train_files"
LEN_FIELD = "phases[0].data.max_length"
# (prompt, chosen, rejected): replies of different lengths, so both paddings are exercised
ROWS = [("Write the digit 3 twice.", "33", "34"),
        ("Type 5 once, nothing else.", "5", "The answer is 5!"),
        ("Please write 7 three times.", "777", "77")]


@pytest.fixture(scope="module")
def tok(tiny_kit):
    return load_tokenizer(tiny_kit["model_dir"])


def write(path, **cols) -> str:
    pq.write_table(pa.table(cols), str(path))
    return str(path)


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def explicit_file(path, rows=ROWS) -> str:
    """TRL's conversational form with an explicit prompt."""
    return write(path, prompt=[user(p) for p, _, _ in rows], chosen=[assistant(c) for _, c, _ in rows],
                 rejected=[assistant(r) for _, _, r in rows])


def real(ids, mask) -> list[int]:
    return ids[mask.bool()].tolist()


# -- encoding ---------------------------------------------------------------------------------------------------


def test_batch_layout_chosen_then_rejected(tok, tmp_path):
    pairs = dpo.load_preferences([explicit_file(tmp_path / "p.parquet")], FIELD)
    b = dpo.encode_pairs(tok, pairs, 128, LEN_FIELD)
    M = len(ROWS)
    assert set(b) == {"prompts", "prompt_mask", "responses", "response_mask"}
    assert all(v.shape[0] == 2 * M and v.dtype == torch.long for v in b.values())
    pad, eos = tok.pad_token_id, tok.eos_token_id
    for i, (p, c, r) in enumerate(ROWS):
        for row, reply in ((i, c), (M + i, r)):
            pm, rm = b["prompt_mask"][row], b["response_mask"][row]
            # left-padded prompt, right-padded response, pad id wherever the mask is 0
            assert torch.equal(pm, pm.sort().values) and torch.equal(rm, rm.sort(descending=True).values)
            assert (b["prompts"][row][pm == 0] == pad).all() and (b["responses"][row][rm == 0] == pad).all()
            prompt, resp = real(b["prompts"][row], pm), real(b["responses"][row], rm)
            assert tok.decode(prompt) == tok.apply_chat_template(user(p), add_generation_prompt=True, tokenize=False)
            assert tok.decode(prompt + resp) == tok.apply_chat_template(user(p) + assistant(reply), tokenize=False)
            assert resp[-1] == eos and eos not in resp[:-1]
        assert torch.equal(b["prompts"][i], b["prompts"][M + i])  # the pair's two rows share the prompt
    # widths are the longest prompt / reply: no wasted padding column
    assert b["prompt_mask"][:, 0].any() and b["response_mask"][:, -1].any()
    # the layout the RL forward reads: sequences lines the response tokens up after the prompt
    seq = sequences(b)
    assert torch.equal(seq["input_ids"][:, b["prompts"].shape[1]:], b["responses"])


def test_every_trl_form_gives_the_same_batch(tok, tmp_path):
    sys = [{"role": "system", "content": "Answer with digits."}]
    rows = ROWS
    files = {
        "explicit chat": write(tmp_path / "a.parquet", prompt=[sys + user(p) for p, _, _ in rows],
                               chosen=[assistant(c) for _, c, _ in rows], rejected=[assistant(r) for _, _, r in rows]),
        "implicit prompt": write(tmp_path / "b.parquet", chosen=[sys + user(p) + assistant(c) for p, c, _ in rows],
                                 rejected=[sys + user(p) + assistant(r) for p, _, r in rows]),
        # ultrafeedback_binarized: a string prompt column next to full conversations (TRL extracts the prefix)
        "str prompt + conversations": write(tmp_path / "c.parquet", prompt=[p for p, _, _ in rows],
                                            chosen=[sys + user(p) + assistant(c) for p, c, _ in rows],
                                            rejected=[sys + user(p) + assistant(r) for p, _, r in rows]),
        "chat prompt + str replies": write(tmp_path / "d.parquet", prompt=[sys + user(p) for p, _, _ in rows],
                                           chosen=[c for _, c, _ in rows], rejected=[r for _, _, r in rows]),
    }
    batches = {k: dpo.encode_pairs(tok, dpo.load_preferences([f], FIELD), 128, LEN_FIELD) for k, f in files.items()}
    ref = batches.pop("explicit chat")
    for name, b in batches.items():
        assert all(torch.equal(ref[k], b[k]) for k in ref), name
    # a bare string prompt is one user turn
    plain = write(tmp_path / "e.parquet", prompt=[p for p, _, _ in rows], chosen=[c for _, c, _ in rows],
                  rejected=[r for _, _, r in rows])
    b = dpo.encode_pairs(tok, dpo.load_preferences([plain], FIELD), 128, LEN_FIELD)
    expect = dpo.encode_pairs(tok, dpo.load_preferences([explicit_file(tmp_path / "f.parquet")], FIELD), 128, LEN_FIELD)
    assert all(torch.equal(expect[k], b[k]) for k in b)
    pairs = dpo.load_preferences([files["implicit prompt"]], FIELD)
    assert [(x.prompt, x.chosen, x.rejected) for x in pairs] == [(sys + user(p), c, r) for p, c, r in rows]


def test_response_ends_at_the_end_of_turn_token(tok, tmp_path):
    """A template that writes after the end-of-turn token (Qwen's newline): those tokens are not scored, as a
    rollout stops at EOS; a template whose generation prompt is not a prefix of the conversation is refused."""
    pairs = dpo.load_preferences([explicit_file(tmp_path / "p.parquet")], FIELD)
    newline = copy.deepcopy(tok)
    newline.chat_template = CHAT_TEMPLATE.replace("+ eos_token -}}", "+ eos_token + '\\n' -}}")
    b = dpo.encode_pairs(newline, pairs, 128, LEN_FIELD)
    for row in range(2 * len(ROWS)):
        resp = real(b["responses"][row], b["response_mask"][row])
        assert resp[-1] == tok.eos_token_id
        assert not tok.decode(resp).endswith("\n")
    odd = copy.deepcopy(tok)
    odd.chat_template = CHAT_TEMPLATE.replace("'<|assistant|>' -}}{%- endif", "'<|assistant|>Answer: ' -}}{%- endif")
    with pytest.raises(InputError, match=r"p\.parquet row 0: the chat template does not render the prompt"):
        dpo.encode_pairs(odd, pairs, 128, LEN_FIELD)


# -- sequence log-probs and the loss ---------------------------------------------------------------------------


def test_sequence_logps_sum_or_ipo_mean_ignoring_padding():
    logp = torch.tensor([[-1.0, -2.0, -3.0, -50.0], [-0.5, -99.0, -99.0, -99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert torch.allclose(dpo.sequence_logps(logp, mask), torch.tensor([-6.0, -0.5]))
    assert torch.allclose(dpo.sequence_logps(logp, mask, "sigmoid"), dpo.sequence_logps(logp, mask, "hinge"))
    assert torch.allclose(dpo.sequence_logps(logp, mask, "ipo"), torch.tensor([-2.0, -0.5]))
    with pytest.raises(ValueError, match="sigmoid, ipo, hinge"):
        dpo.sequence_logps(logp, mask, "kto")


def test_loss_at_the_reference_policy():
    ref = torch.randn(8) * 5 - 20
    for beta in (0.1, 0.5):
        loss, m = dpo.dpo_loss(ref.clone(), ref, beta)
        assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
        assert m["rewards/margins"].item() == 0 and m["rewards/chosen"].item() == 0
        assert m["rewards/accuracies"].item() == 0  # no pair is preferred yet (strictly)
        assert dpo.dpo_loss(ref.clone(), ref, beta, "ipo")[0].item() == pytest.approx(1 / (2 * beta) ** 2, rel=1e-5)
        assert dpo.dpo_loss(ref.clone(), ref, beta, "hinge")[0].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sigmoid, ipo, hinge"):
        dpo.dpo_loss(ref, ref, 0.1, "simpo")
    assert dpo.LOSSES == ("sigmoid", "ipo", "hinge")


def test_losses_match_the_papers():
    g = torch.Generator().manual_seed(1)
    M, beta, eps = 6, 0.3, 0.1
    pol = (torch.randn(2 * M, generator=g) * 3 - 10).double()
    ref = (torch.randn(2 * M, generator=g) * 3 - 10).double()
    pc, pr, rc, rr = pol[:M].tolist(), pol[M:].tolist(), ref[:M].tolist(), ref[M:].tolist()
    # h = beta * log-ratio margin of chosen over rejected (DPO eq. 7; IPO eq. 17 with h = log-ratio margin)
    h = [(a - c) - (b - d) for a, b, c, d in zip(pc, pr, rc, rr)]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expect = {
        "sigmoid": sum(-math.log(sig(beta * x)) for x in h) / M,
        "ipo": sum((x - 1 / (2 * beta)) ** 2 for x in h) / M,
        "hinge": sum(max(0.0, 1 - beta * x) for x in h) / M,
    }
    for kind, value in expect.items():
        assert dpo.dpo_loss(pol, ref, beta, kind)[0].item() == pytest.approx(value, rel=1e-9), kind
    cdpo = sum(-(1 - eps) * math.log(sig(beta * x)) - eps * math.log(1 - sig(beta * x)) for x in h) / M
    loss, m = dpo.dpo_loss(pol, ref, beta, "sigmoid", label_smoothing=eps)
    assert loss.item() == pytest.approx(cdpo, rel=1e-9)
    rc_ = [beta * (a - c) for a, c in zip(pc, rc)]
    rr_ = [beta * (b - d) for b, d in zip(pr, rr)]
    assert m["rewards/chosen"].item() == pytest.approx(sum(rc_) / M)
    assert m["rewards/rejected"].item() == pytest.approx(sum(rr_) / M)
    assert m["rewards/margins"].item() == pytest.approx(sum(a - b for a, b in zip(rc_, rr_)) / M)
    assert m["rewards/accuracies"].item() == pytest.approx(sum(a > b for a, b in zip(rc_, rr_)) / M)
    assert 0 < m["rewards/accuracies"].item() < 1  # the draw has pairs of both kinds
    assert m["logps/chosen"].item() == pytest.approx(sum(pc) / M)
    assert m["logps/rejected"].item() == pytest.approx(sum(pr) / M)
    with pytest.raises(ValueError, match="sigmoid loss only"):
        dpo.dpo_loss(pol, ref, beta, "ipo", label_smoothing=eps)


@pytest.mark.parametrize("kind", dpo.LOSSES)
def test_gradient_raises_chosen_and_lowers_rejected(kind):
    M = 4
    ref = torch.randn(2 * M) - 10
    for start in (ref.clone(), ref + 0.05 * torch.randn(2 * M)):  # at and near the reference
        pol = start.clone().requires_grad_(True)
        ref_ = ref.clone().requires_grad_(True)
        loss, _ = dpo.dpo_loss(pol, ref_, 0.1, kind)
        loss.backward()
        assert (pol.grad[:M] < 0).all(), (kind, pol.grad)  # descent raises the chosen log-probs
        assert (pol.grad[M:] > 0).all(), (kind, pol.grad)  # and lowers the rejected ones
        assert ref_.grad is None  # the reference is a constant


# -- learning with the real forward -----------------------------------------------------------------------------


def test_tiny_policy_learns_a_preference(tiny_kit, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    digits = range(8)
    path = write(tmp_path / "pref.parquet", prompt=[f"Write the digit {d} twice." for d in digits],
                 chosen=[str(d) * 2 for d in digits], rejected=[f"{d}{(d + 1) % 10}" for d in digits])
    batch = dpo.encode_pairs(tok, dpo.load_preferences([path], FIELD), 64, LEN_FIELD)
    policy = AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"])
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    rows, idx = Rows.of(batch), list(range(len(batch["responses"])))
    replies = [tok.decode(real(r, m), skip_special_tokens=True)
               for r, m in zip(batch["responses"], batch["response_mask"])]
    assert replies[:len(digits)] == [str(d) * 2 for d in digits]  # the rows whose log-probs should rise

    def logps(model):
        return dpo.sequence_logps(forward(model, rows, idx, torch.device("cpu"))[0], batch["response_mask"])

    with torch.no_grad():
        ref_logps = logps(reference)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-3)
    policy.train()
    t0, history = time.perf_counter(), []
    for _ in range(15):
        loss, m = dpo.dpo_loss(logps(policy), ref_logps, beta=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append({k: float(v) for k, v in m.items()} | {"loss": loss.item()})
    with torch.no_grad():
        loss, m = dpo.dpo_loss(logps(policy), ref_logps, beta=0.1)
    first, last = history[0], {k: float(v) for k, v in m.items()}
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5) and first["rewards/margins"] == 0
    assert last["rewards/accuracies"] >= 0.75, history
    assert last["rewards/margins"] > 0.5, history  # beta * (log-ratio margin): e^5 in odds at beta 0.1
    assert last["rewards/chosen"] > 0 > last["rewards/rejected"], last
    assert float(loss) < 0.5 * math.log(2)
    assert time.perf_counter() - t0 < 60


# -- bad input --------------------------------------------------------------------------------------------------


def test_bad_preference_files_name_file_row_and_fix(tok, tmp_path):
    good = explicit_file(tmp_path / "good.parquet")
    with pytest.raises(InputError, match=rf"{re.escape(FIELD)}\[1\]: .*nope\.parquet does not exist"):
        dpo.load_preferences([good, str(tmp_path / "nope.parquet")], FIELD)
    lacking = write(tmp_path / "lacking.parquet", prompt=["a"], chosen=["b"])
    with pytest.raises(InputError, match=r"lacking\.parquet lacks column\(s\) \['rejected'\].*Rename"):
        dpo.load_preferences([lacking], FIELD)
    same = write(tmp_path / "same.parquet", prompt=["p1", "p2"], chosen=["x", "y"], rejected=["z", "y"])
    with pytest.raises(InputError, match=rf"{re.escape(FIELD)}: .*same\.parquet row 1: .*teaches nothing.*drop"):
        dpo.load_preferences([good, same], FIELD)
    same_chat = write(tmp_path / "same_chat.parquet", chosen=[user("p") + assistant("y")],
                      rejected=[user("p") + assistant("y")])
    with pytest.raises(InputError, match=r"same_chat\.parquet row 0: .*teaches nothing"):
        dpo.load_preferences([same_chat], FIELD)
    empty = write(tmp_path / "empty.parquet", prompt=["p1", "p2"], chosen=["x", "y"], rejected=["z", "  "])
    with pytest.raises(InputError, match=r"empty\.parquet row 1: the rejected reply is empty"):
        dpo.load_preferences([empty], FIELD)
    no_prompt = write(tmp_path / "noprompt.parquet", chosen=["x"], rejected=["y"])
    with pytest.raises(InputError, match=r"noprompt\.parquet row 0: the prompt is missing.*add a 'prompt' column"):
        dpo.load_preferences([no_prompt], FIELD)
    multi = write(tmp_path / "multi.parquet", prompt=[user("p")], chosen=[assistant("a") + user("more")],
                  rejected=[assistant("b")])
    with pytest.raises(InputError, match=r"multi\.parquet row 0: the chosen reply must be one assistant message"):
        dpo.load_preferences([multi], FIELD)
    unshared = write(tmp_path / "unshared.parquet", chosen=[user("p") + assistant("a")],
                     rejected=[user("q") + assistant("b")])
    with pytest.raises(InputError, match=r"unshared\.parquet row 0: .*share no leading message"):
        dpo.load_preferences([unshared], FIELD)


def test_overlong_pair_is_refused_not_truncated(tok, tmp_path):
    rows = ROWS + [("Write the digit 1 once.", "1", "1 " * 60)]
    pairs = dpo.load_preferences([explicit_file(tmp_path / "long.parquet", rows)], FIELD)
    assert dpo.encode_pairs(tok, pairs[:3], 40, LEN_FIELD)["responses"].shape[0] == 6
    with pytest.raises(InputError, match=rf"{re.escape(LEN_FIELD)}=40: the pair at .*long\.parquet row 3 is \d+ "
                                         rf"tokens.*raise {re.escape(LEN_FIELD)} or drop the row"):
        dpo.encode_pairs(tok, pairs, 40, LEN_FIELD)

