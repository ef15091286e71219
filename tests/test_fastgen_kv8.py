"""rollout.kv_cache=fp8: the static engine's KV cache in e4m3, one fp32 scale per KV head and slot. On CPU, fp32:
the engine is the model whose attention reads rounded keys and values, exactly (HF with its attention's inputs
rounded, ``kv8_reference.py``): greedy tokens token for token, the recorded log-probs that model's, on every path that
reads the cache (bmm, sdpa, continuous batching's refills, with fp8 projections too). The Triton kernel reading the
cache directly runs under Triton's interpreter in tests/test_triton_kernels.py."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kv8_reference import engine_codes, fp8_cache, round_kv  # noqa: E402
from test_fastgen import EOS, PAD, cut, eos_biased, hf_generate, left_padded, prompts_of  # noqa: E402
from test_fastgen_families import build  # noqa: E402
from test_fastgen_fp8 import (assert_recorded_logprobs_are, fp8_reference, live_tokens, read_positions,  # noqa: E402
                               teacher_forced_logp)
from verlflow.core.ml.fastgen import EngineOptions, FastGen, SamplingConfig  # noqa: E402


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("case,attn", [("qwen3", "bmm"), ("qwen3", "sdpa"), ("gemma2", "bmm"), ("gemma3_text", "sdpa"),
                                       ("mistral-window", "bmm"), ("phi3", "sdpa"), ("olmo2", "bmm")])
def test_fp8_cache_engine_is_the_rounded_cache_model_token_for_token(case, attn):
    """The engine's cache holds the reference's rounding of every slot a live token reads, code for code, and every
    log-prob it records is the reference's (HF's op order differs: ties within fp32 noise go the engine's way,
    ``kv8_reference.e4m3``; without that, 12.5 % of mistral-window's tokens were ~1e-2 off on one CPU)."""
    model = build(case)
    n = 16
    ids, mask = left_padded([5, 11, 3, 16, 8, 1], seed=0)
    eng = FastGen(model, 6, 16, n, EngineOptions(bucket=8, attn=attn, kv_cache="fp8"))
    assert all(c.dtype == torch.float8_e4m3fn for c in eng.kc + eng.vc) and eng.w.spec.kv8
    ours = eng.generate(ids, mask, SamplingConfig(temperature=0.0), [EOS], PAD)
    with fp8_cache(model, engine_codes(eng)):
        assert torch.equal(ours, hf_generate(model, ids, mask, n)), case
    torch.manual_seed(3)
    out = eng.generate(ids, mask, SamplingConfig(0.8), [EOS], PAD)
    live = live_tokens(out)
    cache, seen = engine_codes(eng), {}
    with fp8_cache(model, cache, seen):
        want = teacher_forced_logp(model, ids, mask, out, 0.8)
    read = read_positions(mask, out)
    for layer, kv in enumerate(cache):
        for got, ref in zip(kv, seen[layer]):
            got, ref = (c[:, :, :read.shape[1]].transpose(1, 2)[read] for c in (got, ref))
            assert torch.equal(got, ref), (layer, (got != ref).sum())
    assert_recorded_logprobs_are(eng, want, live)
    # ... and the rounded cache is another model than the model's own
    gap = (teacher_forced_logp(model, ids, mask, out, 0.8) - want)[live].abs().max().item()
    assert gap > 1e-3, gap


@pytest.mark.parametrize("case,attn,weights", [("qwen3", "bmm", "model"), ("mistral-window", "sdpa", "fp8")])
def test_fp8_cache_continuous_batching_is_the_rounded_cache_model_prompt_by_prompt(case, attn, weights):
    """The pipeline's default path: rows refilled mid-generation, each refill's prompt prefilled into its rows with
    its scales, next to rows still decoding; with fp8 projections too (both switches: one fp8 model)."""
    model = eos_biased(build(case), factor=2.0)
    ref = fp8_reference(model) if weights == "fp8" else model
    lens = [5, 11, 3, 16, 8, 1, 13, 2, 9]
    limits = [20, 3, 20, 7, 20, 20, 1, 20, 11]
    prompts = prompts_of(lens, seed=4)
    eng = FastGen(model, 3, 16, 20, EngineOptions(bucket=8, attn=attn, check_every=2, weights=weights, kv_cache="fp8"))
    ours, _ = eng.generate_many(prompts, SamplingConfig(temperature=0.0), [EOS], PAD, limits=limits, refill_min=1)
    with fp8_cache(ref):
        want = [cut(hf_generate(ref, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), n)[0].tolist())
                for p, n in zip(prompts, limits)]
    assert ours == want and eng.last_stats["refills"] >= 4
    assert len({len(r) for r in ours}) >= 4  # responses of many lengths: rows refilled at different steps


def test_the_cache_keeps_each_vector_with_its_own_scale():
    """Vectors four decades apart in size keep their relative precision (one scale per slot, not per tensor), and
    the round trip is the reference's rounding."""
    from verlflow.core.ml.fastgen.layers import dequantize_slots, quantize_slots

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=g) * torch.logspace(-3, 1, 40).view(40, 1)
    x8, s = quantize_slots(x)
    assert x8.dtype == torch.float8_e4m3fn and s.shape == (2, 3, 40) and s.dtype == torch.float32
    back = dequantize_slots(x8, s, torch.float32)
    assert torch.equal(back, round_kv(x))
    rel = ((back - x).abs().amax(-1) / x.abs().amax(-1))
    assert rel.max() < 2 ** -4, rel.max()  # e4m3's 3 mantissa bits, at every size
    assert torch.equal(dequantize_slots(*quantize_slots(torch.zeros(1, 4)), torch.float32), torch.zeros(1, 4))


def test_fp8_cache_refused_where_it_cannot_run(monkeypatch):
    from verlflow.core.ml.fastgen.engine import engine_for
    from verlflow.core.ml.fastgen.layers import _kv8_wanted

    model = build("qwen3")
    with pytest.raises(ValueError, match="rollout.kv_cache must be"):
        FastGen(model, 2, 8, 4, EngineOptions(kv_cache="int4"))
    a = engine_for(model, 2, 8, 4)
    b = engine_for(model, 2, 8, 4, EngineOptions(kv_cache="fp8"))  # the cached engine of another cache is not reused
    assert b is not a and b.w.spec.kv8 and engine_for(model, 2, 8, 4, EngineOptions(kv_cache="fp8")) is b
    assert not engine_for(model, 2, 8, 4).w.spec.kv8
    # a GPU without fp8 conversions (the Triton kernel's e4m3 loads): the message names the field and the fix
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"rollout.kv_cache=fp8 needs .*8.9.*A100 has 8.0: use rollout.kv_cache=model"):
        _kv8_wanted("fp8", torch.device("cuda", 0))


@pytest.mark.parametrize("overrides,message", [
    (["rollout.kv_cache=fp8"], r"rollout.kv_cache=fp8 is the static engine's"),
    (["rollout.kv_cache=fp8", "rollout.engine=static"],
     r"rollout.kv_cache=fp8 samples .*algorithm.rollout_correction=true.*old_logprobs=rollout"),
])
def test_fp8_cache_blueprint_refuses_what_it_cannot_do(overrides, message):
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.errors import BlueprintError

    with pytest.raises(BlueprintError, match=message):
        load_blueprint(None, overrides)
    for fix in ("algorithm.rollout_correction=true", "algorithm.old_logprobs=rollout"):
        bp = load_blueprint(None, ["rollout.kv_cache=fp8", "rollout.engine=static", fix])
        assert bp.rollout.kv_cache == "fp8"


def test_evaluation_reads_the_models_own_cache():
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.ml.evaluate import sampling

    bp = load_blueprint(None, ["rollout.kv_cache=fp8", "rollout.weights=fp8", "rollout.engine=static",
                               "algorithm.rollout_correction=true"])
    assert (sampling(bp.eval, bp.rollout).kv_cache, sampling(bp.eval, bp.rollout).weights) == ("model", "model")
    assert (bp.rollout.kv_cache, bp.rollout.weights) == ("fp8", "fp8")


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="the Triton kernel's e4m3 loads need a GPU of compute capability 8.9 or newer")
def test_cuda_engine_reads_its_fp8_cache_and_samples_from_that_model():
    """bf16 on the GPU, compiled and graph-captured, the Triton kernel reading the fp8 cache (its self-check passed):
    the log-probs it records are the rounded-cache model's (HF over rounded keys and values) more closely than the
    bf16 model's."""
    import copy

    model = copy.deepcopy(build("qwen3")).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded([5, 11, 3, 16, 8, 1], seed=0))
    eng = FastGen(model, 6, 16, 20, EngineOptions(attn="triton", kv_cache="fp8"))
    assert eng.options.graphs and eng.attn == "triton" and eng.kc[0].dtype == torch.float8_e4m3fn
    torch.manual_seed(0)
    out = eng.generate(ids, mask, SamplingConfig(1.0), [EOS], PAD)
    live = live_tokens(out)
    lp = eng.last_logprobs[live]
    with fp8_cache(model):
        to_kv8 = (lp - teacher_forced_logp(model, ids, mask, out, 1.0)[live]).abs().mean().item()
    to_model = (lp - teacher_forced_logp(model, ids, mask, out, 1.0)[live]).abs().mean().item()
    assert to_kv8 < to_model, (to_kv8, to_model)
