"""Padding-free update (algorithm.use_remove_padding): the packed row, the token-balanced micro-batch plan, and
the same log-probs, entropies, values and PPO steps as the padded path (fp32, CPU, the real HF model)."""

import copy

import pytest
import torch
from tinybp import tiny_blueprint

from verlflow.core.errors import BlueprintError
from verlflow.core.ml import fusedhead, model as M, packing, ppo
from verlflow.core.ml.forward import Rows, _fused, forward
from verlflow.core.ml.placement import Placement
from verlflow.core.stages.update import ppo_spec

pytestmark = pytest.mark.unit


def fwd(model, rows, idx, bp, **kw):
    """The update's forward of rows `idx` with bp's temperature and packing."""
    return forward(model, rows, idx, "cpu", temperature=bp.rollout.temperature,
                   packed=bp.algorithm.use_remove_padding, **kw)


def ragged_batch(vocab: int, n: int = 6, P: int = 7, R: int = 9, seed: int = 0) -> dict:
    """A rollout-shaped batch: left-padded prompts of 2..P tokens, right-padded responses of 0..R tokens."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, P + 1, (n,), generator=g)
    rlen = torch.randint(0, R + 1, (n,), generator=g)
    rlen[0], rlen[1] = R, 0  # a full and an empty response
    prompts = torch.randint(3, vocab, (n, P), generator=g)
    responses = torch.randint(3, vocab, (n, R), generator=g)
    pm = (torch.arange(P)[None] >= P - plen[:, None]).long()
    rm = (torch.arange(R)[None] < rlen[:, None]).long()
    prompts[pm == 0] = 0
    responses[rm == 0] = 0
    scores = torch.rand(n, generator=g)
    return {"prompts": prompts, "responses": responses, "prompt_mask": pm, "response_mask": rm, "scores": scores,
            "group": torch.arange(n) // 2}


def test_pack_layout():
    b = ragged_batch(50)
    pk = packing.pack(b, [2, 0, 1])
    lens = [int(b["prompt_mask"][i].sum() + b["response_mask"][i].sum()) for i in (2, 0, 1)]
    assert pk.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert pk.max_len == max(lens)
    assert pk.position_ids[0].tolist() == [p for n in lens for p in range(n)]
    for k, (row, col) in enumerate(zip(pk.rows.tolist(), pk.cols.tolist())):
        i = [2, 0, 1][row]
        assert pk.labels[k] == b["responses"][i, col]  # the token this logit predicts
        assert pk.input_ids[0, pk.logit_idx[k] + 1] == b["responses"][i, col]
    assert len(pk.labels) == int(b["response_mask"][[2, 0, 1]].sum())


def test_plan_balances_tokens_and_matches_micro_batch_counts():
    sizes = {i: s for i, s in enumerate([900, 120, 130, 880, 500, 510, 60, 1000])}
    ids = list(sizes)
    plans = [packing.plan(ids, sizes, 2, r, 1024) for r in range(2)]
    assert len(plans[0]) == len(plans[1])  # FSDP collectives pair up
    flat = [i for p in plans for mb in p for i in mb]
    assert sorted(flat) == ids
    assert all(sum(sizes[i] for i in mb) <= 1024 for p in plans for mb in p)
    per_rank = [sum(sizes[i] for mb in p for i in mb) for p in plans]
    assert abs(per_rank[0] - per_rank[1]) <= 200, per_rank
    assert all(len([i for mb in p for i in mb]) == 4 for p in plans)  # equal sample counts per rank
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=512 is below the longest sample"):
        packing.plan(ids, sizes, 2, 0, 512)


@pytest.fixture(scope="module")
def models(tiny_kit, tmp_path_factory):
    torch.manual_seed(0)
    store = tmp_path_factory.mktemp("store")
    out = {}
    for packed in (False, True):
        bp = tiny_blueprint(tiny_kit, store, algorithm__use_remove_padding=packed, rollout__temperature=0.7, algorithm__lr=1e-3,
                            resources__nproc_per_node=1)
        out[packed] = (bp, M.build_module(tiny_kit["model_dir"], bp.model, packed=packed).eval())
    return out


def test_packed_forward_equals_padded(models, tiny_kit):
    (bp, padded), (bpp, packed) = models[False], models[True]
    b = ragged_batch(padded.config.vocab_size)
    mask = b["response_mask"].bool()
    rows = Rows.of(b)
    idx = list(range(len(mask)))
    with torch.no_grad():
        want = fwd(padded, rows, idx, bp)
        got = fwd(packed, rows, idx, bpp)
    for w, g in zip(want, got):
        torch.testing.assert_close(g[mask], w[mask], atol=2e-5, rtol=1e-5)
        assert (g[~mask] == 0).all()
    crit_bp = tiny_blueprint(tiny_kit, bp.storage.uri, algorithm__use_remove_padding=True)
    critic = M.build_module(tiny_kit["model_dir"], crit_bp.model, critic=True, packed=True).eval()
    critic_padded = M.build_module(tiny_kit["model_dir"], bp.model, critic=True).eval()
    critic_padded.load_state_dict(critic.state_dict())
    with torch.no_grad():
        v_want = fwd(critic_padded, rows, idx, bp, critic=True)[0]
        v_got = fwd(critic, rows, idx, crit_bp, critic=True)[0]
    torch.testing.assert_close(v_got[mask], v_want[mask], atol=2e-5, rtol=1e-5)


def test_packed_ppo_steps_equal_padded(models):
    """Two mini-batches of real PPO steps (verl's losses, AdamW) from the same start: same metrics, same weights."""
    results = {}
    for packed, (bp, model) in models.items():
        m = copy.deepcopy(model)
        b = ragged_batch(m.config.vocab_size, n=16, seed=1)
        b["group"] = torch.arange(16) // bp.rollout.n
        opt = torch.optim.AdamW(m.parameters(), lr=bp.algorithm.lr)  # the update sets it each step
        at = Placement(0, 1, "cpu")
        old = ppo.score_all(m, b, ppo_spec(bp), at)
        ref = old + 0.01 * b["response_mask"]
        data, _ = ppo.prepare(bp.algorithm, b, old, ref, iteration=1)
        trained = ppo.Models(ppo.Trainee(m, opt), step=0)
        hist = ppo.train(ppo_spec(bp), trained, data, at)
        results[packed] = (hist, trained.step, m.state_dict())
    (h0, s0, w0), (h1, s1, w1) = results[False], results[True]
    assert s0 == s1 == 2
    for r0, r1 in zip(h0, h1):
        # ppo_kl and pg_clipfrac are means over micro-batches, whose composition differs when packed.
        for k in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
            assert r1[k] == pytest.approx(r0[k], rel=1e-4, abs=1e-6), k
    for k in w0:  # Adam moves each weight by ~lr=1e-3 a step; the two paths agree to 5 % of one step
        torch.testing.assert_close(w1[k], w0[k], atol=5e-5, rtol=0)
    assert any(not torch.equal(w0[k], models[False][1].state_dict()[k]) for k in w0)  # the steps moved weights


# ---- algorithm.use_fused_kernels: verl's chunked log-prob + entropy from the hidden states --------------------


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_head_equals_plain_logits(models, packed, tied):
    """Same log-probs, entropies and gradients as the fp32-logits path (tied: the head is the embedding table,
    as in Qwen2.5-0.5B/1.5B, so both uses of the weight get their gradient)."""
    bp, plain = models[packed]
    plain = copy.deepcopy(plain).train()
    if tied:
        plain.config.tie_word_embeddings = True
        plain.lm_head.weight = plain.model.embed_tokens.weight
    fused = fusedhead.install(copy.deepcopy(plain))
    assert _fused(fused) and not _fused(plain)
    b = ragged_batch(plain.config.vocab_size, n=8, seed=3)
    mask = b["response_mask"].bool()
    rows = Rows.of(b)
    idx = [5, 0, 2, 7, 1]
    out = {}
    for name, m in (("plain", plain), ("fused", fused)):
        logp, ent = fwd(m, rows, idx, bp)
        ((logp * 1.3 + ent * 0.7) * mask[idx]).sum().backward()  # both outputs feed the loss, as with entropy_coeff
        out[name] = (logp, ent, {n: p.grad.clone() for n, p in m.named_parameters()})
    (lw, ew, gw), (lg, eg, gg) = out["plain"], out["fused"]
    m = mask[idx]
    torch.testing.assert_close(lg[m], lw[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(eg[m], ew[m], atol=2e-5, rtol=1e-5)
    assert gg.keys() == gw.keys()
    for n in gw:
        torch.testing.assert_close(gg[n], gw[n], atol=1e-5, rtol=1e-4, msg=n)
    with torch.no_grad():  # every other caller (rollout's generate) still gets the model's own logits
        ids = b["prompts"][:2] if not packed else packing.pack(b, [0]).model_kwargs()
        kw = ids if packed else {"input_ids": ids}
        torch.testing.assert_close(fused(**kw).logits, plain(**kw).logits)


def test_fused_head_leaves_the_critic_alone(models, tiny_kit):
    bp, _ = models[True]
    critic = M.build_module(tiny_kit["model_dir"], bp.model, critic=True, packed=True)
    assert not _fused(fusedhead.install(critic))


def test_triton_backend_is_refused_where_it_cannot_run(tiny_kit, tmp_path):
    with pytest.raises(BlueprintError, match="fused_kernels_backend=triton is the backend of the fused head"):
        tiny_blueprint(tiny_kit, tmp_path, "algorithm.fused_kernels_backend=triton")
    with pytest.raises(BlueprintError, match="need CUDA; resources.device is cpu"):
        tiny_blueprint(tiny_kit, tmp_path, "algorithm.use_fused_kernels=true", "algorithm.fused_kernels_backend=triton")
    with pytest.raises(ValueError, match="fused_kernels_backend='nope'"):
        fusedhead.head("nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="verl's Triton head kernels need CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_head_equals_the_torch_head_on_cuda(temperature):
    """verl's linear_cross_entropy kernels against FusedLinearForPPO: the same log-probs, entropies and gradients
    (bf16 inputs, fp32 logits in both; tolerances of bf16 gradients)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    K, H, V = 3000, 256, 5003  # a ragged token count and a vocabulary that is no multiple of a tile
    h0 = torch.randn(K, H, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    labels = torch.randint(0, V, (K,), device="cuda", generator=g)
    dl, de = torch.randn(K, device="cuda", generator=g), torch.randn(K, device="cuda", generator=g)
    out = {}
    for backend in fusedhead.BACKENDS:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logp, ent = fusedhead.head(backend)(h, w, labels, temperature)
        (logp.float() * dl + ent.float() * de).sum().backward()
        out[backend] = logp.float(), ent.float(), h.grad.float(), w.grad.float()
        h.grad = None
        logp, ent = fusedhead.head(backend)(h, w, labels, temperature)
        logp.sum().backward()  # broadcast gradients, and none from the entropy: verl's kernels take them too
        assert torch.isfinite(h.grad).all()
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight"), out["torch"], out["triton"]):
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * max(scale, 1.0), (name, (a - b).abs().max().item(), scale)


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_layers_trace_once_for_every_micro_batch_length(models, packed):
    """fsdp.compile's layers (dynamo with the aot_eager backend: inductor's tracing and guards without its code
    generation) over micro-batches of three lengths: one graph for all of them, so a packed row of another length
    or a padded batch of another width is no recompile; and the values are the eager layers'."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from verlflow.core.ml.compiletime import Meter

    bp, eager = models[packed]
    model = copy.deepcopy(eager)  # the fixture's model stays eager for the other tests
    torch._dynamo.reset()
    layers = [m for m in model.modules() if isinstance(m, M.decoder_layer_class(model, None))]
    code = type(layers[0]).forward.__code__
    M.compile_layers(layers, backend="aot_eager")
    compiles = []
    try:
        for n in (3, 4, 5, 6):
            b = ragged_batch(model.config.vocab_size, n=n, P=n + 4, R=2 * n, seed=n)  # rows, widths, tokens vary
            rows, idx = Rows.of(b), list(range(n))
            meter = Meter()
            with torch.no_grad():
                got = fwd(model, rows, idx, bp)[0]
            compiles.append(meter.read()[0])
            with torch.no_grad():
                want = fwd(eager, rows, idx, bp)[0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert len(_debug_get_cache_entry_list(code)) == 1
        # nor anything after the layer's own graph (the CPU packed path's per-sample attention is not traced: a
        # graph per sample length was a recompile in every micro-batch): later lengths compile nothing
        assert compiles[0] > 0 and compiles[2:] == [0, 0], compiles
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("packed", [False, True])
def test_a_step_at_half_the_micro_batch_has_the_same_gradients(models, packed):
    """The runner's retry after an out-of-memory error (resources.oom_retry) runs the update with memplan.at_half's
    blueprint: more, smaller micro-batches (packed: half the token budget, down to one whole sample; padded: half
    the samples). Each micro-batch's loss is scaled by the whole mini-batch, so the step's gradients are the same."""
    from verlflow.core.checks import memplan

    bp, model = models[packed]
    if packed:
        bp = tiny_blueprint_with(bp, ppo_max_token_len_per_gpu=2 * memplan.seq_len(bp))
    half, recorded = memplan.at_half(bp, "update", None)
    field = "ppo_max_token_len_per_gpu" if packed else "ppo_micro_batch_size_per_gpu"
    assert recorded == {"oom_retries": 1, field: getattr(bp.algorithm, field) // 2}
    b = ragged_batch(model.config.vocab_size, n=16, P=40, R=9, seed=2)
    b["group"] = torch.arange(16) // bp.rollout.n
    at = Placement(0, 1, "cpu")
    grads, splits, rows = {}, {}, {}
    for name, blueprint in (("full", bp), ("half", half)):
        m = copy.deepcopy(model)
        old = ppo.score_all(m, b, ppo_spec(blueprint), at)
        data, _ = ppo.prepare(blueprint.algorithm, b, old, old + 0.01 * b["response_mask"], iteration=1)
        splits[name] = len(ppo.micro_batches(blueprint.algorithm, b, range(8), at))
        hist = ppo.train(ppo_spec(blueprint), ppo.Models(ppo.Trainee(m, _NoStep(m.parameters(), lr=1.0))), data, at)
        grads[name] = {k: p.grad for k, p in m.named_parameters()}  # the last mini-batch's, clipped
        rows[name] = hist[-1]
    assert splits["half"] > splits["full"]  # the retry's step is split finer
    for k in ("grad_norm", "pg_loss", "kl_loss", "entropy"):  # the norm before the clip: the same scale
        assert rows["half"][k] == pytest.approx(rows["full"][k], rel=1e-5, abs=1e-7), k
    for k, g in grads["full"].items():
        torch.testing.assert_close(grads["half"][k], g, atol=1e-6, rtol=1e-4)


class _NoStep(torch.optim.SGD):
    """Leaves the weights alone: the gradients of a step are what the test compares."""

    def step(self, closure=None):
        return None


def tiny_blueprint_with(bp, **algorithm):
    return bp.model_copy(update={"algorithm": bp.algorithm.model_copy(update=algorithm)})
