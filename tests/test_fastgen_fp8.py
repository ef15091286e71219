"""rollout.weights=fp8: the static engine's projections in e4m3 (a scale per output channel, activations scaled per
token), and algorithm.rollout_correction, which weighs the update's loss by the truncated ratio of the policy's
log-probs to the fp8 rollout's. On CPU, fp32, through torch._scaled_mm's CPU kernel:

* the engine is the fp8 model exactly: greedy tokens equal HF generate of the same model with each projection
  replaced by its fp8 definition (written here in plain fp32 maths, not with the engine's helpers), and the
  log-probs it records are that model's forward over prompt + response: the behaviour policy the correction needs;
* a warm engine re-quantizes in place when the policy changes;
* the correction's weights are verl's, reach the loss, and the pipeline reports the gap it corrects."""

import contextlib
import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from kv8_reference import e4m3  # noqa: E402
from test_fastgen import EOS, PAD, cut, eos_biased, hf_generate, left_padded, prompts_of  # noqa: E402
from test_fastgen_families import build  # noqa: E402
from verlflow.core.ml.fastgen import EngineOptions, FastGen, Fp8Choices, SamplingConfig  # noqa: E402

E4M3_MAX = 448.0


class Fp8Reference(torch.nn.Module):
    """nn.Linear as the fp8 model defines it: W rounded to e4m3 with one scale per output row, each input row
    rounded to e4m3 with its own scale, the product in fp32. ``key``: the engine's projection it is part of (layer,
    "qkv" / "o" / "gu" / "down"); with the engine's input codes set (``ties_as``), rounding ties within fp32 noise
    go the engine's way (``kv8_reference.e4m3``), and ``seen`` keeps this call's codes."""

    def __init__(self, lin: torch.nn.Linear, key: tuple[int, str] | None = None):
        super().__init__()
        w = lin.weight.detach().float()
        s = w.abs().amax(1, keepdim=True) / E4M3_MAX
        self.register_buffer("w", (w / s).to(torch.float8_e4m3fn).float() * s)
        self.bias = None if lin.bias is None else lin.bias.detach()
        self.key, self.engine, self.done, self.seen = key, None, 0, None

    def forward(self, x):
        x32 = x.float()
        sx = x32.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # a zero row (padding's) stays zero
        engine = None
        if self.engine is not None:  # (rows, positions, K): a prefill, then a position a call
            self.done += x.shape[-2]
            engine = self.engine[:x.shape[0], self.done - x.shape[-2]:self.done]
        self.seen = e4m3(x32 / sx, engine)
        y = ((self.seen * sx) @ self.w.t()).to(x.dtype)
        return y if self.bias is None else y + self.bias


ENGINE_PROJECTION = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o",
                     "gate_proj": "gu", "up_proj": "gu", "gate_up_proj": "gu", "down_proj": "down"}


def fp8_reference(model):
    """A copy of the model whose decoder projections are their fp8 definitions (embedding and LM head as they are)."""
    ref = copy.deepcopy(model)
    for i, layer in enumerate(ref.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, proj in ENGINE_PROJECTION.items():
                if isinstance(getattr(parent, name, None), torch.nn.Linear):
                    setattr(parent, name, Fp8Reference(getattr(parent, name), (i, proj)))
    return ref


@contextlib.contextmanager
def fp8_inputs(eng):
    """The e4m3 codes of every fp8 projection's input while inside (a generate(): its prefill, then a decode step a
    position), filled in on leaving: {(layer, projection): (rows, slots, K)}, NaN past the last step (no tie)."""
    from verlflow.core.ml.fastgen import layers

    key = {L["w" + p].data_ptr(): (i, p) for i, L in enumerate(eng.w.layers) for p in ("qkv", "o", "gu", "down")}
    prompt, steps = {k: [] for k in key.values()}, {k: [] for k in key.values()}
    real = layers._fp8_linear

    def spy(x, w8, *a, **kw):
        x8, _ = layers.quantize_tokens(x.reshape(-1, x.shape[-1]))
        (prompt if x.dim() == 3 else steps)[key[w8.data_ptr()]].append(x8.float().view(x.shape))
        return real(x, w8, *a, **kw)

    codes = {}
    layers._fp8_linear = spy
    try:
        yield codes
    finally:
        layers._fp8_linear = real
    for k in key.values():
        got = torch.cat([torch.cat(prompt[k]), *(s.unsqueeze(1) for s in steps[k])], 1)
        codes[k] = torch.nn.functional.pad(got, (0, 0, 0, eng.T + 1 - got.shape[1]), value=float("nan"))


@contextlib.contextmanager
def ties_as(ref, codes):
    """``ref`` (``fp8_reference``) breaking its rounding ties within fp32 noise as the engine did (``fp8_inputs``),
    its rows and positions those of the engine's run."""
    mods = [m for m in ref.modules() if isinstance(m, Fp8Reference)]
    for m in mods:
        m.engine, m.done = codes[m.key], 0
    try:
        yield mods
    finally:
        for m in mods:
            m.engine = None


def teacher_forced_logp(model, ids, mask, out, temperature):
    full = torch.cat([ids, out], 1)
    fmask = torch.cat([mask, torch.ones_like(out)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=fmask, position_ids=(fmask.cumsum(1) - 1).clamp(min=0)).logits
    P = ids.shape[1]
    return torch.log_softmax(logits[:, P - 1:-1].float() / temperature, -1).gather(2, out.unsqueeze(2)).squeeze(2)


def live_tokens(out):
    live = torch.ones_like(out, dtype=torch.bool)  # up to and with each row's first EOS
    live[:, 1:] = (out[:, :-1] != EOS).cumprod(1).bool()
    return live


def read_positions(mask, out):
    """(rows, positions): the prompt's positions and each live token's input, what the live tokens' log-probs read."""
    return torch.cat([mask.bool(), live_tokens(out)[:, 1:]], 1)


def assert_recorded_logprobs_are(eng, want, live):
    """The engine's recorded log-probs of its live tokens are ``want``, the reference model's, to fp32 noise (at most
    1/35 of this bound, measured). ``want`` must break its rounding ties as the engine did (``kv8_reference.e4m3``):
    one element of one vector rounded the other way moves the row's later log-probs by ~1e-2, and which way a value
    within fp32 noise of a midpoint goes depends on the CPU."""
    torch.testing.assert_close(eng.last_logprobs[live], want[live], rtol=1e-4, atol=2e-5)


pytestmark = [pytest.mark.stages, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("case,gemm", [("qwen3", "unit"), ("phi3", "unit"), ("gemma2", "unit"), ("olmo2", "unit"),
                                       ("mistral-window", "unit"), ("qwen3", "rowwise"), ("gemma2", "rowwise")])
def test_fp8_engine_is_the_fp8_model_token_for_token(case, gemm):
    """Either GEMM (the row-scaled one, or the unit-scaled one with the scales applied after it) is the fp8 model:
    every projection's input is the reference's rounding, code for code, and every recorded log-prob the reference's
    (HF's op order differs: ties within fp32 noise go the engine's way, ``kv8_reference.e4m3``; without that, 5-8 % of
    qwen3's tokens were ~1e-2 off on one CPU)."""
    model = build(case)
    ref = fp8_reference(model)
    n = 16
    ids, mask = left_padded([5, 11, 3, 16, 8, 1], seed=0)
    eng = FastGen(model, 6, 16, n, EngineOptions(bucket=8, weights="fp8", fp8=Fp8Choices(gemm=gemm)))
    assert eng.w.fp8 and all(L["w" + p].dtype == torch.float8_e4m3fn for L in eng.w.layers
                             for p in ("qkv", "o", "gu", "down"))
    with fp8_inputs(eng) as codes:
        ours = eng.generate(ids, mask, SamplingConfig(temperature=0.0), [EOS], PAD)
    with ties_as(ref, codes):
        assert torch.equal(ours, hf_generate(ref, ids, mask, n)), case
    # ... and not by chance: the fp8 model is another model than the fp32 one
    plain = hf_generate(model, ids, mask, n)
    torch.manual_seed(3)
    with fp8_inputs(eng) as codes:
        out = eng.generate(ids, mask, SamplingConfig(0.8), [EOS], PAD)
    live = live_tokens(out)
    with ties_as(ref, codes) as mods:
        want = teacher_forced_logp(ref, ids, mask, out, 0.8)
    read = read_positions(mask, out)
    for m in mods:
        got, kept = (c[:, :read.shape[1]][read] for c in (codes[m.key], m.seen))
        assert torch.equal(got, kept), (m.key, (got != kept).sum())
    assert_recorded_logprobs_are(eng, want, live)
    fp32 = teacher_forced_logp(model, ids, mask, out, 0.8)
    gap = (fp32 - want)[live].abs().max().item()
    assert gap > 1e-3 or not torch.equal(ours, plain), gap


@pytest.fixture(scope="module")
def kit_models(tiny_kit, tiny_llama_kit):
    """The tiny kit's Qwen2 (q/k/v biases) and Llama, loaded from their HF folders."""
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(kit["model_dir"]).eval()
            for arch, kit in (("qwen2", tiny_kit), ("llama", tiny_llama_kit))}


@pytest.mark.parametrize("arch,attn", [("qwen2", "bmm"), ("llama", "sdpa")])
def test_fp8_continuous_batching_is_the_fp8_model_prompt_by_prompt(kit_models, arch, attn):
    """The pipeline's default path (continuous batching: rows refilled mid-generation, each refill prefilled in fp8
    alone) on the tiny kit's own models (Qwen2 with q/k/v biases, Llama): every response is HF generate's of the
    fp8 model for that prompt alone."""
    model = eos_biased(kit_models[arch])
    ref = fp8_reference(model)
    lens = [5, 11, 3, 16, 8, 1, 13, 2, 9]
    limits = [20, 3, 20, 7, 20, 20, 1, 20, 11]
    prompts = prompts_of(lens, seed=4)
    eng = FastGen(model, 3, 16, 20, EngineOptions(bucket=8, attn=attn, check_every=2, weights="fp8"))
    ours, _ = eng.generate_many(prompts, SamplingConfig(temperature=0.0), [EOS], PAD, limits=limits, refill_min=1)
    want = [cut(hf_generate(ref, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), n)[0].tolist())
            for p, n in zip(prompts, limits)]
    assert ours == want and eng.last_stats["refills"] >= 4


def test_fp8_matmul_keeps_the_bias_and_the_leading_dims():
    from verlflow.core.ml.fastgen.layers import _fp8_linear, quantize_rows

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * torch.logspace(-2, 1, 48).unsqueeze(1))  # rows' scales
    x = torch.randn(3, 5, 64, generator=g)
    x[1, 2] *= 1e3  # one token far larger than the rest: per-token scales keep the others exact
    w8, s = quantize_rows(lin.weight.detach())
    assert w8.dtype == torch.float8_e4m3fn and s.shape == (1, 48)
    got = _fp8_linear(x, w8, s, lin.bias.detach())
    assert got.shape == (3, 5, 48)
    torch.testing.assert_close(got, Fp8Reference(lin)(x), rtol=1e-5, atol=1e-5)
    rel = (got - lin(x)).norm() / lin(x).norm()
    assert 1e-4 < rel < 0.1, rel  # quantized, and close
    torch.testing.assert_close(_fp8_linear(x, w8, s, lin.bias.detach(), unit=True), Fp8Reference(lin)(x), rtol=1e-5,
                               atol=1e-5)  # the unit-scaled GEMM, its scales applied after


def test_a_long_rows_scale_is_its_largest_element_wherever_it_lies():
    """down's input (8,960 wide at 1.5B): each token's scale is its row's largest element, wherever it lies (a
    two-level reduction for speed was tried and measured slower on the H200; this holds any such rewrite to it)."""
    from verlflow.core.ml.fastgen.layers import _fp8_linear, quantize_rows

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(8960, 32, bias=False)
    x = torch.randn(4, 8960, generator=g)
    for row, col in enumerate((0, 127, 128, 8959)):  # first, last of a block, first of the next, the last element
        x[row, col] = 50.0 * (-1) ** row
    w8, s = quantize_rows(lin.weight.detach())
    torch.testing.assert_close(_fp8_linear(x, w8, s, None), Fp8Reference(lin)(x), rtol=1e-5, atol=1e-5)


def test_warm_fp8_engine_requantizes_in_place_when_the_policy_changes():
    model = copy.deepcopy(build("qwen3"))
    ids, mask = left_padded([5, 11, 3, 9], seed=2)
    eng = FastGen(model, 4, 11, 12, EngineOptions(weights="fp8"))
    before = eng.generate(ids, mask, SamplingConfig(temperature=0.0), [EOS], PAD)
    ptrs = [(L["wqkv"].data_ptr(), L["sgu"].data_ptr()) for L in eng.w.layers]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # an update moved the policy
        for p in model.model.layers.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    eng.refresh_weights()
    assert [(L["wqkv"].data_ptr(), L["sgu"].data_ptr()) for L in eng.w.layers] == ptrs  # captured graphs stay valid
    with fp8_inputs(eng) as codes:
        after = eng.generate(ids, mask, SamplingConfig(temperature=0.0), [EOS], PAD)
    ref = fp8_reference(model)
    with ties_as(ref, codes):
        assert torch.equal(after, hf_generate(ref, ids, mask, 12))
    assert not torch.equal(after, before)


def test_fp8_refused_where_it_cannot_run(monkeypatch):
    import weakref

    from verlflow.core.ml.fastgen import engine
    from verlflow.core.ml.fastgen.engine import engine_for

    model = build("qwen3")
    with pytest.raises(ValueError, match="rollout.weights must be"):
        FastGen(model, 2, 8, 4, EngineOptions(weights="int4"))
    a = engine_for(model, 2, 8, 4)
    assert not a.w.fp8 and engine_for(model, 2, 8, 4) is a
    old = weakref.ref(a)
    del a
    seen = []

    class Probe(FastGen):  # what exists when the replacement is built
        def __init__(self, *args, **kw):
            seen.append(old() is None)
            super().__init__(*args, **kw)

    monkeypatch.setattr(engine, "FastGen", Probe)
    # the cached engine of other weights is not reused ...
    b = engine_for(model, 2, 8, 4, EngineOptions(weights="fp8"))
    assert b.w.fp8 and engine_for(model, 2, 8, 4, EngineOptions(weights="fp8")) is b
    assert seen == [True]  # ... and is gone before its replacement takes memory (two KV caches may not fit)


@pytest.mark.parametrize("gemm", ["unit", "rowwise"])
def test_the_start_up_check_refuses_a_gpu_whose_fp8_matmul_is_wrong_or_missing(monkeypatch, gemm):
    """The CUDA engine's fp8 check, run here on CPU against a torch._scaled_mm broken on purpose: one whose sums are
    off by the last bit of e4m3's mantissa (2^-4, what a wrong scale or a lossy accumulation does), one that drops the
    weights' scales (the row-scaled GEMM's wrong layout), one that the GPU does not have
    (CUBLAS_STATUS_NOT_SUPPORTED, as on some Blackwell parts). Each refuses, naming rollout.weights=model; the real op
    passes."""
    eng = FastGen(build("qwen3"), 2, 8, 4, EngineOptions(weights="fp8", fp8=Fp8Choices(gemm=gemm)))
    eng._self_check()
    real = torch._scaled_mm

    def off(*a, **kw):
        return real(*a, **kw) * (1 + 2 ** -4)

    def unscaled(a, b, scale_a, scale_b, **kw):
        return real(a, b, scale_a=scale_a, scale_b=torch.ones_like(scale_b), **kw)

    def missing(*a, **kw):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic")

    cases = [(off, "differs from its reference"), (missing, "CUBLAS_STATUS_NOT_SUPPORTED")]
    if gemm == "rowwise":
        cases.append((unscaled, "differs from its reference"))
    for broken, message in cases:
        monkeypatch.setattr(torch, "_scaled_mm", broken)
        with pytest.raises(RuntimeError, match=f"rollout.weights=fp8.*{message}.*use rollout.weights=model"):
            eng._self_check()


def test_fast_accumulation_is_an_fp8_switch(monkeypatch):
    """VERLFLOW_FASTGEN_FP8_FAST_ACCUM=1 (the benchmark's A/B) reaches the fp8 matmuls' spec, and only theirs."""
    model = build("qwen3")
    monkeypatch.setenv("VERLFLOW_FASTGEN_FP8_FAST_ACCUM", "1")
    assert FastGen(model, 2, 8, 4, EngineOptions(weights="fp8")).w.spec.fp8_fast
    assert not FastGen(model, 2, 8, 4).w.spec.fp8_fast  # nothing to accumulate in fp8
    assert not FastGen(model, 2, 8, 4, EngineOptions(weights="fp8", fp8=Fp8Choices(fast_accum=False))).w.spec.fp8_fast
    monkeypatch.delenv("VERLFLOW_FASTGEN_FP8_FAST_ACCUM")
    assert not FastGen(model, 2, 8, 4, EngineOptions(weights="fp8")).w.spec.fp8_fast
    # the default: scales after a unit-scaled GEMM
    assert FastGen(model, 2, 8, 4, EngineOptions(weights="fp8")).w.spec.fp8_unit
    assert not FastGen(model, 2, 8, 4, EngineOptions(weights="fp8", fp8=Fp8Choices(gemm="rowwise"))).w.spec.fp8_unit
    assert not FastGen(model, 2, 8, 4).w.spec.fp8_unit  # no fp8 projections to scale
    with pytest.raises(ValueError, match="fp8 gemm must be"):
        FastGen(model, 2, 8, 4, EngineOptions(weights="fp8", fp8=Fp8Choices(gemm="cutlass")))


# ------------------------------------------------------------------------------------ the rollout correction


def _batch(seed=0, N=8, R=6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(N, R, generator=g) > 0.2).float()
    mask[:, 0] = 1
    old = -torch.rand(N, R, generator=g) * 3
    roll = (old + torch.randn(N, R, generator=g) * 0.5) * mask
    return {"response_mask": mask, "prompts": torch.zeros(N, 2, dtype=torch.long),
            "responses": torch.zeros(N, R, dtype=torch.long), "prompt_mask": torch.ones(N, 2, dtype=torch.long),
            "scores": torch.randn(N, generator=g), "group": torch.arange(N) // 2, "rollout_logp": roll}, old


def _bp(**algorithm):
    from verlflow.core.blueprint import Blueprint

    return Blueprint.model_validate({"algorithm": algorithm, "resources": {"nproc_per_node": 1}})


def _loss(bp, batch, old, logp):
    """The update's policy loss of the whole batch (one micro-batch, one rank) under ``bp``, and its PPOBatch."""
    from verlflow.core.ml import ppo
    from verlflow.core.ml.placement import Placement
    from verlflow.core.stages.update import ppo_spec

    data, _ = ppo.prepare(bp.algorithm, batch, old, old, iteration=1)
    info = {"dp_size": 1, "batch_num_tokens": int(batch["response_mask"].sum()), "global_batch_size": len(old)}
    upd = ppo._Update(ppo_spec(bp), data, Placement(0, 1, "cpu"))
    upd.cfg.global_batch_info.update(info)
    loss, _ = upd._policy_loss(logp, torch.zeros_like(old), list(range(len(old))), info)
    return loss, data, info


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_weighs_the_loss_by_verls_truncated_weights(level):
    from verl.trainer.ppo import core_algos

    from verlflow.core.ml import ppo

    fields = {"use_kl_loss": False, "rollout_is": level, "rollout_is_threshold": 1.5}
    bp, off = _bp(**fields, rollout_correction=True), _bp(**fields)
    batch, old = _batch()
    mask = batch["response_mask"]
    data, metrics = ppo.prepare(bp.algorithm, batch, old, old, iteration=1)
    log_ratio = (old - batch["rollout_logp"]) * mask
    raw = torch.exp(log_ratio) if level == "token" else torch.exp(log_ratio.sum(1, keepdim=True)).expand_as(old)
    torch.testing.assert_close(data.is_weights, raw.clamp(max=1.5) * mask)
    assert (data.is_weights == 1.5).any() and (data.is_weights[mask.bool()] < 1.5).any()  # some capped, some not
    m = {k.removeprefix("rollout_corr/"): v for k, v in metrics.items() if k.startswith("rollout_corr/")}
    assert m["kl"] == pytest.approx(float(((batch["rollout_logp"] - old) * mask).sum() / mask.sum()), rel=1e-5)
    assert m["k3_kl"] > 0

    g = torch.Generator().manual_seed(1)
    logp = old + torch.randn(old.shape, generator=g) * 0.3
    on, _, info = _loss(bp, batch, old, logp)
    unweighted, _, _ = _loss(off, batch, old, logp)
    cfg = ppo.actor_config(off.algorithm, off.rollout.n)
    cfg.global_batch_info.update(info)
    want, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=logp, advantages=data.adv, response_mask=mask,
        loss_agg_mode=bp.algorithm.loss_agg_mode, config=cfg, rollout_is_weights=data.is_weights)
    torch.testing.assert_close(on, want, rtol=0, atol=1e-7)
    assert off.algorithm.rollout_correction is False and not torch.allclose(unweighted, on)


def test_rollout_correction_names_a_batch_without_rollout_logprobs():
    from verlflow.core.blueprint import Blueprint
    from verlflow.core.ml import ppo

    bp = Blueprint.model_validate({"algorithm": {"rollout_correction": True}, "resources": {"nproc_per_node": 1}})
    batch, old = _batch()
    del batch["rollout_logp"]
    with pytest.raises(ValueError, match="no rollout_logp.*rollout_correction=false"):
        ppo.prepare(bp.algorithm, batch, old, old, iteration=1)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.weights=fp8"], r"rollout.engine=static"),
    (["rollout.weights=fp8", "rollout.engine=static"], r"algorithm.rollout_correction=true.*old_logprobs=rollout"),
    (["rollout.weights=auto"], r"rollout.weights=auto is the static engine's"),
    (["rollout.weights=auto", "rollout.engine=static"], r"may sample from an fp8 model.*rollout_correction=true"),
    (["rollout.weights=fp8", "rollout.engine=static", "algorithm.rollout_correction=true", "resources.device=cuda"],
     r"fsdp.mixed_precision=fp32.*set fsdp.mixed_precision=bf16"),
    (["algorithm.rollout_correction=true", "algorithm.old_logprobs=rollout"], r"old_logprobs=recompute"),
    (["algorithm.rollout_correction=true", "algorithm.rollout_is=null"], r"algorithm.rollout_is \(token or sequence"),
    (["algorithm.rollout_correction=true", "rollout.top_p=0.9"], r"untruncated sampling.*rollout_correction=false"),
])
def test_fp8_and_the_correction_refuse_what_they_cannot_do(overrides, message):
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.errors import BlueprintError

    with pytest.raises(BlueprintError, match=message):
        load_blueprint(None, overrides)
    ok = load_blueprint(None, ["rollout.weights=fp8", "rollout.engine=static", "algorithm.rollout_correction=true"])
    assert ok.rollout.weights == "fp8"
    assert load_blueprint(None, ["rollout.weights=fp8", "rollout.engine=static",
                                 "algorithm.old_logprobs=rollout"]).rollout.weights == "fp8"


def test_auto_weights_are_decided_before_the_engine_and_recorded(tiny_kit, tmp_path):
    """rollout.weights=auto: the rollout stage decides it (on a CPU: the model's weights, not timed, nothing kept)
    and the engine gets model or fp8, never auto; the rollout's metrics record the choice, and promotion may name
    it. The memory plan counts the larger of the two weight copies."""
    from tinybp import ONE_RANK, tiny_blueprint

    from verlflow.core import metrics
    from verlflow.core.checks import memplan
    from verlflow.core.ml.fastgen import choices
    from verlflow.core.ml.fastgen.weightcheck import fp8_pays
    from verlflow.core.orchestrate.pipeline import run_pipeline

    assert fp8_pays(transformers.Qwen2Config(), torch.bfloat16, 8, "cpu") == (
        False, {"fp8": False, "reason": "no fp8 matmul off CUDA"})
    assert not choices.where().exists() or "weights" not in choices.where().read_text()
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", *ONE_RANK, "rollout.engine=static", "rollout.weights=auto",
                        "algorithm.rollout_correction=true")
    (rollout,) = [r.manifest for r in run_pipeline(bp, "auto", on_line=lambda line: None)
                  if r.manifest["stage"] == "rollout"]
    assert rollout["metrics"]["weights_fp8"] == 0 and "rollout/weights_fp8" in metrics.available(bp)
    shape = memplan.Shape.of(tiny_kit["model_dir"])
    each = {w: memplan.engine_weights_bytes(bp.model_copy(update={"rollout": bp.rollout.model_copy(
        update={"weights": w})}), shape, 4) for w in ("model", "fp8", "auto")}
    assert each["auto"] == max(each["model"], each["fp8"]) > 0


def test_fp8_rollout_with_the_correction_through_the_pipeline(tiny_kit, tmp_path):
    """Two iterations on two ranks in a warm pool: each rollout samples from the fp8 copy of the current policy (the
    pool's engine re-quantized after the first update), each update weighs its loss by the correction and reports the
    gap; the metrics it lists for promotion are the ones it records."""
    from tinybp import tiny_blueprint

    from verlflow.core import metrics
    from verlflow.core.orchestrate.pipeline import run_pipeline

    bp = tiny_blueprint(tiny_kit, tmp_path / "store", "rollout.engine=static", "rollout.weights=fp8",
                        "algorithm.rollout_correction=true", "algorithm.rollout_is=token", "iterations=2",
                        "promote.metric=update/rollout_corr/k3_kl")
    results = run_pipeline(bp, "fp8", on_line=lambda line: None)
    updates = [r.manifest for r in results if r.manifest["stage"] == "update"]
    assert len(updates) == 2
    listed = {n.removeprefix("update/rollout_corr/") for n in metrics.available(bp) if "rollout_corr" in n}
    for m in updates:
        corr = {k.removeprefix("rollout_corr/"): v for k, v in m["metrics"].items() if k.startswith("rollout_corr/")}
        assert listed <= set(corr), listed - set(corr)
        assert corr["k3_kl"] > 1e-7 and corr["log_ppl_abs_diff"] > 1e-5, corr  # fp8 sampled, fp32 trained
        assert 0.5 < corr["rollout_is_mean"] < 1.5, corr
    # promotion, the trackers and the figure read the gap under its name; the figure plots it, a point an iteration
    from verlflow.core.orchestrate import figures
    from verlflow.core.store.artifacts import open_store

    store = open_store(bp.storage)
    assert [metrics.of_iteration(store, "fp8", i)["update/rollout_corr/k3_kl"] for i in (1, 2)] == \
        [m["metrics"]["rollout_corr/k3_kl"] for m in updates]
    fig = figures.run_figure(figures.history(store, "fp8"), "fp8")
    (ax,) = [ax for ax in fig.axes if ax.get_title() == "Rollout vs trained policy"]
    assert list(ax.get_lines()[0].get_ydata()) == [m["metrics"]["rollout_corr/k3_kl"] for m in updates]


@pytest.mark.parametrize("numerics", [{"weights": "fp8"}, {"kv_cache": "fp8"}, {"weights": "fp8", "kv_cache": "fp8"},
                                      {"weights": "fp8", "fp8": Fp8Choices(gemm="rowwise")}])
def test_compiled_fp8_step_equals_the_eager_one(numerics):
    """The fp8 decode step as the GPU runs it (dynamo + AOTAutograd: inductor's input), torch._scaled_mm and the fp8
    cache's quantize and read-back inside the traced graph: greedy tokens equal the eager fp8 engine's, and the decode
    layer compiles once for every cache bucket."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from verlflow.core.ml.fastgen.layers import _decode_layer

    torch._dynamo.reset()
    model = build("qwen3")
    ids, mask = left_padded([5, 11, 3, 8])
    eager = FastGen(model, 4, 12, 10, EngineOptions(bucket=8, **numerics))
    eager = eager.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD)
    eng = FastGen(model, 4, 12, 10, EngineOptions(bucket=8, compile=True, compile_backend="aot_eager", **numerics))
    assert torch.equal(eng.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD), eager)
    assert len(_debug_get_cache_entry_list(_decode_layer.__code__)) == 1


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="fp8 matmuls need a GPU of compute capability 8.9 or newer")
def test_cuda_fp8_engine_samples_from_the_fp8_model():
    """bf16 on the GPU, compiled and graph-captured: the engine passes its fp8 self-check (each projection against its
    fp32 definition), and the log-probs it records for its samples are nearer the fp8 model's (HF with fp8
    projections, scored over prompt + response) than the bf16 model's. Not by a wide margin: e4m3 rounding is a step
    function, and bf16's noise before it moves an element a whole e4m3 step now and then (the H200 measured 0.16
    against 0.21 on the test model of the other tests, whose activations are large; this one's are the kit's)."""
    model = copy.deepcopy(build("qwen3", initializer_range=0.02)).to("cuda", torch.bfloat16)
    ref = fp8_reference(model)
    ids, mask = (t.cuda() for t in left_padded([5, 11, 3, 16, 8, 1], seed=0))
    eng = FastGen(model, 6, 16, 20, EngineOptions(weights="fp8"))
    assert eng.options.graphs and eng.w.fp8 and eng._fp8_error() < 1e-2
    torch.manual_seed(0)
    out = eng.generate(ids, mask, SamplingConfig(1.0), [EOS], PAD)
    live = live_tokens(out)
    lp = eng.last_logprobs[live]
    to_fp8 = (lp - teacher_forced_logp(ref, ids, mask, out, 1.0)[live]).abs().mean().item()
    to_model = (lp - teacher_forced_logp(model, ids, mask, out, 1.0)[live]).abs().mean().item()
    assert to_fp8 < to_model, (to_fp8, to_model)


@pytest.mark.parametrize("loss", ["vanilla", "bypass_mode"])
def test_icepop_band_zeroes_what_lies_outside_it(loss):
    """algorithm.rollout_is_threshold_lower: token weights outside [lower, threshold] drop to 0 (verl's IcePop)
    instead of being capped, in the decoupled correction and in bypass_mode's own weighting (REINFORCE: its PPO-clip
    variant takes no weights)."""
    fields = {"use_kl_loss": False, "rollout_is": "token", "rollout_is_threshold": 1.5}
    fields.update({"rollout_correction": True} if loss == "vanilla" else
                  {"policy_loss": "bypass_mode", "old_logprobs": "rollout", "bypass_loss_type": "reinforce"})
    batch, old = _batch()
    mask = batch["response_mask"]
    if loss == "bypass_mode":
        old = batch["rollout_logp"]  # the rollout's log-probs are the old ones
    g = torch.Generator().manual_seed(1)
    logp = old + torch.randn(old.shape, generator=g) * 0.5
    band, d_band, _ = _loss(_bp(**fields, rollout_is_threshold_lower=0.7), batch, old, logp)
    capped, d_capped, _ = _loss(_bp(**fields), batch, old, logp)
    if loss == "vanilla":
        w = (old - batch["rollout_logp"]).exp() * mask
        torch.testing.assert_close(d_band.is_weights, torch.where((w >= 0.7) & (w <= 1.5), w, 0.0))
        torch.testing.assert_close(d_capped.is_weights, w.clamp(max=1.5))
    assert torch.isfinite(band) and not torch.allclose(band, capped)


def test_icepop_band_must_not_be_empty():
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.errors import BlueprintError

    with pytest.raises(BlueprintError, match=r"rollout_is_threshold_lower=3.0 is above.*rollout_is_threshold=2.0"):
        load_blueprint(None, ["algorithm.rollout_is_threshold_lower=3.0"])


def test_evaluation_samples_the_policy_not_its_fp8_copy():
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.ml.evaluate import sampling

    bp = load_blueprint(None, ["rollout.engine=static", "rollout.weights=fp8", "algorithm.rollout_correction=true"])
    cfg = sampling(bp.eval, bp.rollout)
    assert bp.rollout.weights == "fp8" and cfg.weights == "model" and cfg.engine == "static"
