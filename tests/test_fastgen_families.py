"""verlflow.core.ml.fastgen (rollout.engine=static) on the families past Llama/Qwen2 (core/ml/fastgen/families.py):
Qwen3, Mistral, Phi-3, Gemma-2, Gemma-3 text, OLMo-2. Tiny random models from each HF config class, fp32 on CPU:

* greedy decoding equals HF generate token for token on left-padded prompts (bmm and sdpa decode attention);
* sampled responses' log-probs equal HF's forward over prompt + response (catches what greedy cannot see:
  Gemma's final soft-cap is monotonic);
* first-token frequencies match HF's warped distribution and HF's own samples (chi-square), with and without
  soft-capping;
* in bf16 the building blocks (every norm, q/k norms, rotary, embedding scale, logits) equal HF's modules bitwise;
* what the engine cannot serve raises a ValueError naming the field.

Weights are drawn wider than HF's init (initializer_range 0.2, norms and biases random) so attention is far from
uniform: a missing window, rotary or soft-cap changes the tokens (checked by breaking each on purpose)."""

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from test_fastgen import EOS, PAD, hf_generate, hf_warped_probs, left_padded  # noqa: E402
from verlflow.core.ml.fastgen import (  # noqa: E402
    HAVE_TRITON, SUPPORTED_MODEL_TYPES, EngineOptions, FastGen, SamplingConfig,
)
from verlflow.core.ml.fastgen.families import FAMILIES  # noqa: E402
from verlflow.core.ml.fastgen.layers import _logits, _rms, _rope, _Weights  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=384, initializer_range=0.2, pad_token_id=PAD, eos_token_id=EOS,
              bos_token_id=1, tie_word_embeddings=False)
WINDOW = 8  # < prompt + new tokens below: the window drops keys
GEMMA = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=2.0)
CASES = {  # name: (config class, fields, attn_implementation)
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=True), "sdpa"),
    # layer 0 full, layers 1-2 sliding (config.layer_types)
    "qwen3-window": ("Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1), "sdpa"),
    "mistral": ("MistralConfig", dict(sliding_window=None), "sdpa"),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW), "sdpa"),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5), "sdpa"),
    "phi3-window": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=WINDOW), "sdpa"),
    # eager: HF applies attn_logit_softcapping; layer_types alternate sliding / full
    "gemma2": ("Gemma2Config", dict(GEMMA, attn_logit_softcapping=1.0), "eager"),
    # sdpa: HF drops attn_logit_softcapping, and so must the engine
    "gemma2-sdpa": ("Gemma2Config", dict(GEMMA, attn_logit_softcapping=1.0), "sdpa"),
    # HF's Gemma-3 never applies attn_logit_softcapping; local / global rotary bases, the global one scaled
    "gemma3_text": ("Gemma3TextConfig", dict(
        GEMMA, attn_logit_softcapping=1.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}),
        "sdpa"),
    "olmo2": ("Olmo2Config", dict(attention_bias=True), "sdpa"),
}
FAMILY_OF = {case: case.split("-")[0] for case in CASES}
_MODELS: dict = {}


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def build(case: str, **fields):
    """The case's tiny model, fp32, eval; norms and biases random (HF starts them at 1 / 0: a wrong norm form or a
    bias read in the wrong place would not show)."""
    key = (case, repr(sorted(fields.items())))
    if key in _MODELS:
        return _MODELS[key]
    cls, kw, attn = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{**COMMON, **kw, **fields})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    assert model.config.model_type == FAMILY_OF[case]
    g = torch.Generator().manual_seed(1)
    gemma_form = FAMILIES[FAMILY_OF[case]].norm_form == "gemma"  # x * (1 + w): w around 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma_form else 1.0) + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    _MODELS[key] = model
    return model


def capped(case: str) -> bool:
    return build(case).config._attn_implementation == "eager" and FAMILIES[FAMILY_OF[case]].attn_softcap


def test_the_registry_is_the_supported_list():
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES) == {"llama", "qwen2", *FAMILY_OF.values()}


# ------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_hf_generate_left_padded(case):
    model = build(case)
    n = 20
    prompts = [left_padded(lens, seed) for seed, lens in ((0, [5, 11, 3, 16, 8, 1]), (1, [14, 2, 9]))]
    refs = [hf_generate(model, ids, mask, n) for ids, mask in prompts]
    # sdpa cannot soft-cap: the engine refuses it there; bmm is the CPU default
    attns = ["bmm"] if capped(case) else ["bmm", "sdpa"]
    if capped(case):
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            FastGen(model, 6, 16, n, EngineOptions(attn="sdpa"))
    for attn in attns:  # sdpa also prefills in micro-batches of two rows (each with its own masks)
        eng = FastGen(model, 6, 16, n, EngineOptions(bucket=8, attn=attn,
                                                     prefill_tokens=32 if attn == "sdpa" else 32768))
        assert eng.attn == attn and not eng.options.graphs
        for i, ((ids, mask), ref) in enumerate(zip(prompts, refs)):  # the second call reuses the engine
            ours = eng.generate(ids, mask, SamplingConfig(temperature=0.0), [EOS], PAD)
            assert torch.equal(ours, ref), f"{case} {attn} prompts {i}:\n{ours}\n{ref}"


# ----------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_logprobs_equal_hf_forward(case):
    """The log-probs the engine records for its sampled tokens (temperature 0.8) are HF's over prompt + response."""
    model = build(case)
    ids, mask = left_padded([6, 12, 3, 9], seed=4)
    eng = FastGen(model, 4, 12, 12)
    torch.manual_seed(3)
    out = eng.generate(ids, mask, SamplingConfig(0.8), [EOS], PAD)
    ours = eng.last_logprobs
    full = torch.cat([ids, out], 1)
    fmask = torch.cat([mask, torch.ones_like(out)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=fmask, position_ids=(fmask.cumsum(1) - 1).clamp(min=0)).logits
    P = ids.shape[1]
    want = torch.log_softmax(logits[:, P - 1:-1].float() / 0.8, -1).gather(2, out.unsqueeze(2)).squeeze(2)
    live = torch.ones_like(out, dtype=torch.bool)  # up to and with each row's first EOS
    live[:, 1:] = (out[:, :-1] != EOS).cumprod(1).bool()
    torch.testing.assert_close(ours[live], want[live], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("case", ["gemma2", "qwen3"])  # with and without soft-capping (attention and final)
def test_first_token_distribution_matches_hf_generate(case):
    """As tests/test_fastgen.py's: our first tokens and HF's samples against HF's warped next-token
    distribution, and against each other (two-sample chi-square)."""
    model = build(case)
    cfg = SamplingConfig(0.9, 0.85)
    ids, mask = left_padded([7], seed=5)
    n = 4096
    ids, mask = ids.expand(n, -1).contiguous(), mask.expand(n, -1).contiguous()
    eng = FastGen(model, n, 7, 1)
    torch.manual_seed(0)
    ours = eng.generate(ids, mask, cfg, [EOS], PAD)[:, 0]
    with torch.no_grad():
        p = hf_warped_probs(model(ids[:1]).logits[:, -1].float(), cfg)[0].double()
    assert p.max() > 4 / p.numel() and (p > 0).sum() > 10  # far from uniform, and many tokens in play
    torch.manual_seed(0)
    hf = hf_generate(model, ids, mask, 1, do_sample=True, temperature=0.9, top_p=0.85, top_k=0)[:, 0]
    f_ours = torch.bincount(ours, minlength=p.numel()).double() / n
    f_hf = torch.bincount(hf, minlength=p.numel()).double() / n
    assert (f_ours[p == 0] == 0).all() and (f_hf[p == 0] == 0).all()
    sigma = (p * (1 - p) / n).sqrt()
    assert ((f_ours - p).abs() <= 5 * sigma + 2 / n).all()
    assert ((f_hf - p).abs() <= 5 * sigma + 2 / n).all()
    c1, c2 = f_ours * n, f_hf * n
    seen = (c1 + c2) > 0
    chi2 = ((c1 - c2)[seen] ** 2 / (c1 + c2)[seen]).sum().item()
    dof = int(seen.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


# ------------------------------------------------------------------------------------ bf16 building blocks


@pytest.mark.parametrize("case", ["qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "olmo2"])
def test_bf16_building_blocks_equal_hf_modules(case):
    """Where fp32 cannot tell them apart (Llama's w * x.to(bf16) against OLMo-2's (w * x).to(bf16); OLMo-2's
    rotary in fp32; Gemma's scale in bf16), the engine's pieces against HF's own modules, bitwise."""
    model = copy.deepcopy(build(case)).to(torch.bfloat16)
    fam = FAMILIES[model.config.model_type]
    w = _Weights(model)
    S, L, layer = w.spec, w.layers[0], model.model.layers[0]
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(3, 5, model.config.hidden_size, generator=g)).to(torch.bfloat16)
    for slot, name in zip(("ln1", "ln_pa", "ln2", "ln_pf"), fam.norms):
        assert (L[slot] is None) == (name is None)
        if name is not None:
            assert torch.equal(_rms(x, L[slot], S.eps, S.norm32), getattr(layer, name)(x)), name
    assert torch.equal(_rms(x, w.norm_w, w.norm_eps, S.norm32), model.model.norm(x))
    if fam.qk_norm:
        width = {"head": (S.hd, S.hd), "full": (S.nh * S.hd, S.nkv * S.hd)}[fam.qk_norm]
        for key, name, d in (("qn", "q_norm", width[0]), ("kn", "k_norm", width[1])):
            t = (3 * torch.randn(3, 5, d, generator=g)).to(torch.bfloat16)
            assert torch.equal(_rms(t, L[key], S.eps, S.norm32), getattr(layer.self_attn, name)(t)), name
    # rotary: our tables and formula against the family's apply_rotary_pos_emb, each table (Gemma-3: two)
    apply = __import__(type(model).__module__, fromlist=["x"]).apply_rotary_pos_emb
    pos = torch.arange(40)
    q = (3 * torch.randn(2, S.nh, 40, S.hd, generator=g)).to(torch.bfloat16)
    k = (3 * torch.randn(2, S.nkv, 40, S.hd, generator=g)).to(torch.bfloat16)
    for key, (cos, sin) in zip(w.rope_keys, w.rope_tables(pos)):
        args = (x, pos[None]) if key is None else (x, pos[None], key)
        hc, hs = model.model.rotary_emb(*args)
        hq, hk = apply(q, k, hc, hs)
        assert torch.equal(_rope(q, cos, sin, S.rot), hq) and torch.equal(_rope(k, cos, sin, S.rot), hk)
    ids = torch.randint(0, 384, (2, 9), generator=g)
    eng = FastGen(model, 1, 4, 1)
    assert torch.equal(eng._embed(ids), model.model.embed_tokens(ids))
    # the head, with HF's soft-cap formula (Gemma2/3ForCausalLM.forward), in bf16
    want = model.lm_head(model.model.norm(x))
    cap = getattr(model.config, "final_logit_softcapping", None) if fam.final_softcap else None
    if cap is not None:
        want = torch.tanh(want / cap) * cap
    assert torch.equal(_logits(x, w.norm_w, w.lm_w, w.norm_eps, S.norm32, w.final_cap), want)


# --------------------------------------------------------------------------------------------- refusals


REFUSED = {  # name: (case, config fields, the field the error must name)
    "dynamic rope": ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                     "rope_type"),
    "gemma3 dynamic global rope": ("gemma3_text", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}), "rope_type"),
    "activation": ("olmo2", dict(hidden_act="gelu_new"), "hidden_act"),
    "gemma activation": ("gemma2", dict(hidden_activation="relu"), "hidden_activation"),
    "bidirectional": ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unservable_configs_are_refused_naming_the_field(name):
    case, fields, field = REFUSED[name]
    model = build(case, **fields)
    with pytest.raises(ValueError, match=field) as err:
        FastGen(model, 2, 8, 4)
    assert "rollout.engine=hf" in str(err.value)


def test_unsupported_family_lists_the_supported_ones():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(ValueError) as err:
        FastGen(transformers.GPT2LMHeadModel(cfg).eval(), 2, 8, 4)
    msg = str(err.value)
    assert "'gpt2'" in msg and ", ".join(SUPPORTED_MODEL_TYPES) in msg and "rollout.engine=hf" in msg


# ------------------------------------------------------------------------------------ the Triton kernel


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="the decode kernel runs on CUDA")
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 2.0), (40, 2.0)])
def test_triton_decode_attention_windows_and_softcap(window, softcap):
    from verlflow.core.ml.fastgen.kernels import combine_splits, decode_attention_triton, reference_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, nh, nkv, T, D = 3, 8, 2, 300, 64
    q = torch.randn(B, nh, D, generator=g, device="cuda").to(torch.bfloat16)
    kc = torch.randn(B, nkv, T, D, generator=g, device="cuda").to(torch.bfloat16)
    vc = torch.randn(B, nkv, T, D, generator=g, device="cuda").to(torch.bfloat16)
    pad = torch.tensor([0, 37, 150], device="cuda")
    for cur in (150, 170, 299):
        slot = torch.tensor([cur, max(cur - 90, 40), cur], device="cuda")  # each row its own slot
        got = combine_splits(*decode_attention_triton(q, kc, vc, pad, slot, 0.125, nkv, window=window,
                                                      softcap=softcap), nh // nkv)
        want = reference_decode_attention(q, kc, vc, pad, slot, 0.125, window=window, softcap=softcap)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="the CUDA engine: graphs, compile, Triton")
def test_cuda_engine_on_a_softcapped_windowed_family():
    """Gemma-2 (eager: attention soft-cap, sliding layers) on the GPU: attn="auto" times only what can soft-cap
    (the Triton variants, never sdpa), and the compiled, graph-captured bmm step is HF's greedy decoding."""
    model = copy.deepcopy(build("gemma2")).cuda()
    ids, mask = (t.cuda() for t in left_padded([5, 11, 3, 16, 8, 1]))
    ref = hf_generate(model, ids, mask, 20)
    eng = FastGen(model, 6, 16, 20, EngineOptions(bucket=8))
    assert eng.options.graphs and eng.attn == "triton" and eng.attn_timings and "sdpa" not in eng.attn_timings
    assert eng.attn == "triton"  # fp32: the kernel's dots are IEEE fp32 (not TF32) and pass the strict self-check
    assert torch.equal(eng.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD), ref)
    eng = FastGen(model, 6, 16, 20, EngineOptions(bucket=8, attn="bmm"))
    assert torch.equal(eng.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD), ref)


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="the CUDA engine: graphs, compile, Triton")
@pytest.mark.parametrize("attn", ["bmm", "triton"])
def test_cuda_continuous_batching_refills_rows_inside_the_captured_step(attn):
    """Continuous batching on the GPU (compiled, graph-captured steps, refills between replays), fp32: with the
    captured step (bmm, or the Triton kernel with IEEE fp32 dots) every response is HF's greedy one for that prompt
    alone, every row keeps its budget and its log-probs are the model's own, teacher-forced."""
    from test_fastgen import cut, eos_biased, prompts_of

    model = eos_biased(build("qwen3")).cuda()
    prompts = prompts_of([5, 11, 3, 16, 8, 1, 13, 2, 9, 6, 12], seed=4)
    limits = [20, 3, 20, 7, 20, 20, 1, 20, 11, 20, 5]
    eng = FastGen(model, 3, 16, 20, EngineOptions(bucket=8, attn=attn, check_every=2))
    assert eng.options.graphs and eng.attn == attn
    ours, logps = eng.generate_many(prompts, SamplingConfig(0.0), [EOS], PAD, limits=limits, refill_min=1)
    assert eng.last_stats["refills"] >= 5
    for p, r, lp, n in zip(prompts, ours, logps, limits):
        assert 0 < len(r) <= n
        ids = torch.tensor([p], device="cuda")
        assert r == cut(hf_generate(model, ids, torch.ones_like(ids), n)[0].tolist())
        with torch.no_grad():
            x = model(torch.tensor([p + r], device="cuda")).logits[0, len(p) - 1:len(p) - 1 + len(r)].float()
        want = x.log_softmax(-1).gather(1, torch.tensor(r, device="cuda")[:, None])[:, 0].cpu()
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-4, rtol=0)


def test_every_benchmark_shape_is_served_at_its_real_size():
    """infra/bench/rollout.py's shapes are the public models' configs (Llama-3.2-1B, Mistral-7B, Phi-3-mini,
    Gemma-2-2B, Gemma-3-1B, OLMo-2-1B, Qwen2.5, Qwen3): each builds on the meta device with its parameter count, and
    the engine's adapter serves it (no refusal) with the family's features read (soft-caps, windows, rotary tables)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "infra" / "bench" / "rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout_shapes", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = {}
    for shape in bench.SHAPES:
        cfg, attn = bench.model_config(shape)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)
        eng = FastGen(model, 256, 128, 256)
        seen[shape] = (model.config.model_type, round(sum(p.numel() for p in model.parameters()) / 1e9, 2), eng)
    assert {t for t, _, _ in seen.values()} == set(SUPPORTED_MODEL_TYPES)  # every family has a real shape
    sizes = {s: n for s, (_, n, _) in seen.items()}
    assert sizes["llama3.2-1b"] == 1.24 and sizes["mistral-7b"] == 7.25 and sizes["phi3-mini"] == 3.82
    assert sizes["gemma2-2b"] == 2.61 and sizes["gemma3-1b"] == 1.0 and sizes["olmo2-1b"] == 1.48
    gemma2, gemma3 = seen["gemma2-2b"][2], seen["gemma3-1b"][2]
    assert (gemma2.w.spec.softcap, gemma2.w.final_cap) == (50.0, 30.0)  # eager attention applies HF's soft-cap
    assert len(gemma3.rope) == 2 and gemma3.w.spec.act == "gelu_tanh"  # local and global rotary tables


@pytest.mark.parametrize("case", ["olmo2", "gemma2", "gemma3_text", "phi3-window"])
def test_compiled_step_equals_the_eager_one(case):
    """The decode step as the GPU runs it, traced by dynamo and functionalised by AOTAutograd (the aot_eager
    backend: inductor's input, without its code generation), for the families whose layers differ most: no input
    norm (OLMo-2: each layer's graph hands the next its raw output, the head applies the final norm), post norms
    and soft-caps (Gemma-2), two rotary tables (Gemma-3), partial rotary and a window (Phi-3). Greedy tokens equal
    the eager engine's, and the decode layer compiles once."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from verlflow.core.ml.fastgen.layers import _decode_layer

    torch._dynamo.reset()
    model = build(case)
    ids, mask = left_padded([5, 11, 3, 8])
    eager = FastGen(model, 4, 12, 10, EngineOptions(bucket=8)).generate(ids, mask, SamplingConfig(0.0), [EOS], PAD)
    eng = FastGen(model, 4, 12, 10, EngineOptions(bucket=8, compile=True, compile_backend="aot_eager"))
    assert torch.equal(eng.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD), eager)
    assert len(_debug_get_cache_entry_list(_decode_layer.__code__)) == 1
