"""verlflow.core.ml.fastgen (rollout.engine=static) on CPU, fp32: greedy decoding identical to HF generate, sampling
that matches HF's warpers (directly and in distribution), EOS, top_k, the rollout dispatch, and the
benchmark's smoke run (so infra/bench/rollout.py cannot rot)."""

import io
import os
from contextlib import redirect_stdout
import pytest

pytestmark = pytest.mark.stages

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import benchmark_script  # noqa: E402
from verlflow.core.ml.placement import Placement  # noqa: E402
from verlflow.core.ml.fastgen import (  # noqa: E402
    HAVE_TRITON, EngineOptions, FastGen, SamplingConfig, _Stats, nucleus_member, sample_logits, topk_filter,
    topk_values,
)

EOS, PAD = 3, 0  # verlflow.core.testing.tinykit's special-token ids


@pytest.fixture(scope="module")
def models(tiny_kit, tiny_llama_kit):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(kit["model_dir"]).eval()
            for arch, kit in (("qwen2", tiny_kit), ("llama", tiny_llama_kit))}


def left_padded(lens, seed=0, vocab=384):
    g = torch.Generator().manual_seed(seed)
    P = max(lens)
    ids = torch.full((len(lens), P), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, P - n:] = torch.randint(7, vocab, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


def hf_generate(model, ids, mask, n, eos=EOS, **kw):
    kw = kw or dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, pad_token_id=PAD,
                             eos_token_id=eos, **kw)[:, ids.shape[1]:]
    return torch.nn.functional.pad(out, (0, n - out.shape[1]), value=PAD)


def hf_warped_probs(x, cfg: SamplingConfig):
    """The distribution HF's sampling draws from: its own warpers, in generate's order."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    s = x.clone()
    if cfg.temperature != 1.0:
        s = TemperatureLogitsWarper(cfg.temperature)(None, s)
    if cfg.top_k:
        s = TopKLogitsWarper(cfg.top_k)(None, s)
    if cfg.top_p < 1.0:
        s = TopPLogitsWarper(cfg.top_p)(None, s)
    return s.softmax(-1)


# ------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("arch,attn", [("qwen2", "bmm"), ("llama", "bmm"), ("qwen2", "sdpa")])
def test_greedy_equals_hf_generate_left_padded(models, arch, attn):
    model = models[arch]
    eng = FastGen(model, 8, 20, 20, EngineOptions(bucket=8, attn=attn))  # 8 > 6 rows
    assert not eng.options.graphs and not eng.compile  # CPU: eager
    for seed, lens in ((0, [5, 11, 3, 16, 8, 1]), (1, [20, 2, 9])):  # second call reuses the engine
        ids, mask = left_padded(lens, seed)
        ours = eng.generate(ids, mask, SamplingConfig(temperature=0.0), [EOS], PAD)
        ref = hf_generate(model, ids, mask, 20)
        assert torch.equal(ours, ref), f"{arch} seed {seed}:\n{ours}\n{ref}"


def test_eos_rows_stop_and_all_finished_exits_early(models):
    model = models["qwen2"]
    ids, mask = left_padded([4, 9, 6, 12], seed=3)
    eng = FastGen(model, 4, 12, 40, EngineOptions(check_every=4))
    free = eng.generate(ids, mask, SamplingConfig(0.0), [1], PAD)  # id 1 (<|unk|>) never comes up
    assert eng.last_stats["steps"] == 40
    # every row's token at step 2 becomes an EOS: rows stop there (or earlier) and emit pad after
    stops = sorted(set(free[:, 2].tolist()))
    ours = eng.generate(ids, mask, SamplingConfig(0.0), stops, PAD)
    ref = hf_generate(model, ids, mask, 40, eos=stops)
    assert torch.equal(ours, ref)
    for row in ours:
        hit = [i for i, t in enumerate(row.tolist()) if t in stops]
        assert hit and hit[0] <= 2 and (row[hit[0] + 1:] == PAD).all()
    assert eng.last_stats["steps"] <= 4 < 40  # all rows finished: stopped at the first check


# ------------------------------------------------------------------------------- continuous batching


def prompts_of(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 384, (n,), generator=g).tolist() for n in lens]


def eos_biased(model, factor=5.0):
    """A copy of the model that says EOS often: responses end at very different lengths."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight[EOS] *= factor
    return m


def cut(row: list[int], eos=EOS) -> list[int]:
    return row[:row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("arch,attn", [("qwen2", "bmm"), ("llama", "sdpa")])
def test_continuous_batching_greedy_equals_hf_generate_prompt_by_prompt(models, arch, attn):
    """11 prompts through 3 rows: a row that finishes (EOS or its own token budget) takes the next prompt while
    the others go on; every response is HF generate's for that prompt alone, token for token."""
    model = eos_biased(models[arch])
    lens = [5, 11, 3, 16, 8, 1, 13, 2, 9, 6, 12]
    limits = [20, 3, 20, 7, 20, 20, 1, 20, 11, 20, 5]  # forced stops as well as EOS
    prompts = prompts_of(lens, seed=4)
    eng = FastGen(model, 3, 16, 20, EngineOptions(bucket=8, attn=attn, check_every=2))
    ours, logps = eng.generate_many(prompts, SamplingConfig(temperature=0.0), [EOS], PAD, limits=limits,
                                    refill_min=1)
    want = []
    for p, n in zip(prompts, limits):
        ids = torch.tensor([p])
        want.append(cut(hf_generate(model, ids, torch.ones_like(ids), n)[0].tolist()))
    assert ours == want
    assert all(len(lp) == len(r) for lp, r in zip(logps, ours))
    assert len({len(r) for r in ours}) >= 4, [len(r) for r in ours]  # ragged: rows really finished apart
    stats = eng.last_stats
    assert stats["refills"] >= 5 and stats["tokens"] == sum(map(len, ours))  # rows were reused mid-generation


def test_refills_come_in_few_shapes_and_still_decode_exactly(models, monkeypatch):
    """Refills take a multiple of refill_min rows while more prompts wait than rows are free (the rest wait for the
    next check), and left-pad their prompts to a multiple of 16 slots: a handful of distinct (rows, width) shapes
    instead of one per refill (the GPU pays per-shape work once a shape). Every response is still HF's own."""
    model = eos_biased(models["qwen2"], factor=4.0)
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 41, (40,), generator=g).tolist()
    limits = torch.randint(1, 13, (40,), generator=g).tolist()
    prompts = prompts_of(lens, seed=6)
    eng = FastGen(model, 8, 40, 12, EngineOptions(bucket=8, check_every=2))
    seen = []
    start = eng._start_rows
    monkeypatch.setattr(eng, "_start_rows", lambda rows, ids, *a: (seen.append((len(rows), ids.shape[1])),
                                                                   start(rows, ids, *a))[1])
    ours, _ = eng.generate_many(prompts, SamplingConfig(temperature=0.0), [EOS], PAD, limits=limits, refill_min=3)
    rows_taken = [n for n, _ in seen]
    assert sum(rows_taken) == len(prompts)
    assert all(n % 3 == 0 for n in rows_taken[:-1]), seen  # the last refill takes whatever is left
    assert all(w % 16 == 0 or w == 40 for _, w in seen), seen
    assert len(set(seen)) <= 6 < len(seen), seen  # few shapes, many refills
    assert eng.last_stats["refill_shapes"] == len(set(seen))
    want = []
    for p, n in zip(prompts, limits):
        ids = torch.tensor([p])
        want.append(cut(hf_generate(model, ids, torch.ones_like(ids), n)[0].tolist()))
    assert ours == want


def test_continuous_batching_decodes_with_the_attention_timed_for_spread_lengths(models, monkeypatch):
    """On CUDA, attn="auto" times the attention twice; where rows at spread lengths (continuous batching) favour
    another than one length (a micro-batch) does, generate_many runs that one (``ragged_attn``) and generate the
    other, each with its own captured steps, and the engine's choice is back in place afterwards, error or not."""
    model = eos_biased(models["qwen2"])
    prompts = prompts_of([5, 11, 3, 9], seed=2)
    eng = FastGen(model, 2, 12, 8, EngineOptions(bucket=8, attn="bmm"))
    eng.ragged_attn = ("sdpa", {})
    used = []
    step = eng._step
    monkeypatch.setattr(eng, "_step", lambda *a: (used.append(eng.attn), step(*a))[1])
    ours, _ = eng.generate_many(prompts, SamplingConfig(0.0), [EOS], PAD)
    assert set(used) == {"sdpa"} and eng.attn == "bmm"
    used.clear()
    ids, mask = left_padded([5, 11], vocab=384)
    eng.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD)
    assert set(used) == {"bmm"}
    want = []
    for p in prompts:
        t = torch.tensor([p])
        want.append(cut(hf_generate(model, t, torch.ones_like(t), 8)[0].tolist()))
    assert ours == want
    with pytest.raises(ValueError):
        eng.generate_many([[5] * 20], SamplingConfig(0.0), [EOS], PAD)  # wider than max_prompt_len
    assert eng.attn == "bmm"


@pytest.mark.parametrize("many", [True, False])
def test_warm_up_covers_every_cache_length_a_generation_decodes_at(models, monkeypatch, many):
    """On CUDA every decode step replays a graph captured before generation; one captured mid-generation would reset
    every live row. So the warm-up's cache lengths must cover every length generation asks for, up to continuous
    batching's last slot T - 1 (here T = 65 and buckets of 64: slot 64 is a bucket of its own)."""
    eng = FastGen(models["qwen2"], 2, 17, 48, EngineOptions(attn="sdpa"))
    assert (eng.T, eng.bucket) == (65, 64)
    asked = set()
    decode = eng._decode
    monkeypatch.setattr(eng, "_decode", lambda kv, cfg: (asked.add(kv), decode(kv, cfg))[1])
    prompts = prompts_of([17, 9, 17], seed=1)
    if many:
        eng.generate_many(prompts, SamplingConfig(0.0), [-1], PAD)  # no EOS: every row runs its whole budget
        warm = eng._warm_kvs(min(map(len, prompts)), True)
    else:
        ids, mask = left_padded([17, 9], vocab=384)
        eng.generate(ids, mask, SamplingConfig(0.0), [-1], PAD)
        warm = eng._warm_kvs(17, False)
    assert asked and asked <= set(warm), (sorted(asked), warm)
    assert not many or max(asked) == eng.T  # the last slot's bucket was asked for, and warmed


def test_compiled_advance_updates_the_decode_state_as_eager_does():
    """The step's bookkeeping (emit the tokens and log-probs of the live rows, advance their column, position and
    slot, finish rows at an EOS or their budget; feed resumed rows their known tokens, EOS ids among them, before
    they emit) runs compiled on CUDA; it mutates the engine's state in place. Compiled by inductor (here for the
    CPU), every state tensor equals eager's after every step."""
    from verlflow.core.ml.fastgen.state import _advance_rows

    compiled = torch.compile(_advance_rows, fullgraph=True)
    B, N = 6, 5

    def state():
        return dict(live=torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool),
                    out=torch.full((B, N), PAD, dtype=torch.long), out_logp=torch.zeros(B, N),
                    col=torch.tensor([0, 1, 4, 2, 3, 0]), pos=torch.tensor([5, 6, 9, 7, 8, 5]),
                    slot=torch.tensor([7, 8, 11, 9, 10, 7]), limit=torch.tensor([5, 5, 5, 5, 4, 1]),
                    eos=torch.tensor([EOS, 6, -1, -1]), pad_id=torch.tensor(PAD), tok=torch.zeros(B, dtype=torch.long),
                    force=torch.tensor([[0] * 3, [EOS, 9, 6], [0] * 3, [0] * 3, [0] * 3, [EOS, 8, 0]]),
                    fidx=torch.tensor([0, 1, 0, 0, 0, 1]), flen=torch.tensor([0, 3, 0, 0, 0, 2]))

    eager, comp = state(), state()
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        nxt, logp = torch.randint(2, 8, (B,), generator=g), torch.randn(B, generator=g)
        _advance_rows(nxt, logp, **eager, max_new=N)
        compiled(nxt, logp, **comp, max_new=N)
        assert all(torch.equal(eager[k], comp[k]) for k in eager), {k: (eager[k], comp[k]) for k in eager}
    assert not eager["live"].any() and (eager["out"] != PAD).any()  # rows finished, by EOS or budget, and emitted
    assert eager["fidx"].tolist() == [0, 3, 0, 0, 0, 2]  # the resumed rows were fed all they were given


def test_compiled_engine_compiles_the_decode_step_once_for_every_cache_bucket(models):
    """The compiled engine (dynamo with the aot_eager backend: the same tracing and guards as inductor, without the
    code generation) through three cache buckets and refills of 1-3 rows at several widths: the decode layer is
    compiled once, not once per bucket (the GPU blueprint's rollout compiled it six times), and the tokens are the
    eager engine's."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from verlflow.core.ml.fastgen.layers import _decode_layer, _prefill_layer

    torch._dynamo.reset()
    model = models["qwen2"]
    lens = [5, 11, 3, 16, 8, 1, 13]
    limits = [120, 3, 70, 7, 120, 20, 1]
    prompts = prompts_of(lens, seed=5)
    runs = {}
    for compiled in (False, True):
        eng = FastGen(model, 3, 16, 120, EngineOptions(attn="sdpa", check_every=2, compile=compiled,
                                                       compile_backend="aot_eager"))
        assert eng.bucket == 64  # buckets of 64, 128 and 136 cache slots
        runs[compiled] = eng.generate_many(prompts, SamplingConfig(temperature=0.0), [], PAD, limits=limits,
                                           refill_min=1)[0]  # no EOS: the budgets decide the lengths
        assert eng.last_stats["refills"] >= 3
    assert max(map(len, runs[True])) > 64 + 16  # rows reached the second bucket, and past it
    assert runs[True] == runs[False]
    assert len(_debug_get_cache_entry_list(_decode_layer.__code__)) == 1
    # one for every (rows, width) >= 2, a single row included (it runs as two), and one for a one-token width
    assert len(_debug_get_cache_entry_list(_prefill_layer.__code__)) <= 2
    torch._dynamo.reset()


def test_inductor_options_from_the_environment_reach_the_compiled_functions(models, monkeypatch):
    """VERLFLOW_FASTGEN_INDUCTOR, the A/B hook for inductor's options (PDL, GEMM autotuning), is handed to inductor:
    an option it does not know fails at set-up with inductor's own error; a value that is not a JSON object fails
    naming the variable; a known option sets up."""
    def engine():
        return FastGen(models["qwen2"], 2, 8, 4, EngineOptions(compile=True))

    monkeypatch.setenv("VERLFLOW_FASTGEN_INDUCTOR", '{"no_such_option": 1}')
    with pytest.raises(RuntimeError, match="no_such_option"):
        engine()
    monkeypatch.setenv("VERLFLOW_FASTGEN_INDUCTOR", "[1]")
    with pytest.raises(ValueError, match="VERLFLOW_FASTGEN_INDUCTOR must be a JSON object"):
        engine()
    monkeypatch.setenv("VERLFLOW_FASTGEN_INDUCTOR", '{"triton.enable_pdl": true}')
    assert engine().compile


ENGINE_ENV = ("VERLFLOW_FASTGEN_GRAPHS", "VERLFLOW_FASTGEN_COMPILE", "VERLFLOW_FASTGEN_NUCLEUS",
              "VERLFLOW_FASTGEN_BUCKET_COMPILE", "VERLFLOW_FASTGEN_INDUCTOR", "VERLFLOW_FASTGEN_FP8_GEMM",
              "VERLFLOW_FASTGEN_FP8_FAST_ACCUM", "TRITON_INTERPRET")


def test_engine_options_decide_every_switch_for_the_device(monkeypatch):
    """EngineOptions.resolved leaves nothing "auto" or None: the device's defaults, the environment's A/B variables
    where the caller left a switch open (never over what it gave), and a resolved record resolves to itself (the
    benchmarks build an engine's variants from its resolved options). A bad value is refused naming its field."""
    from verlflow.core.ml.fastgen import Fp8Choices

    for var in ENGINE_ENV:
        monkeypatch.delenv(var, raising=False)

    def on(cuda, have_triton=True, softcap=0.0, **asked):
        return EngineOptions(**asked).resolved(cuda=cuda, have_triton=have_triton, softcap=softcap, model_type="m")

    def switches(o):
        return o.graphs, o.compile, o.attn, o.sampler, o.nucleus, o.bucket_compile, o.inductor, o.fp8

    assert switches(on(False)) == (False, False, "bmm", "torch", "two_pass", "dynamic", {}, Fp8Choices())
    gpu = on(True)
    assert switches(gpu)[:4] == (True, True, "triton", "triton")
    assert gpu.resolved(cuda=True, have_triton=True, softcap=0.0, model_type="m") == gpu
    assert switches(on(True, have_triton=False))[2:4] == ("sdpa", "torch")
    assert on(True, have_triton=False, softcap=50.0).attn == "bmm"  # sdpa cannot soft-cap
    monkeypatch.setenv("VERLFLOW_FASTGEN_GRAPHS", "0")
    monkeypatch.setenv("VERLFLOW_FASTGEN_COMPILE", "0")
    monkeypatch.setenv("VERLFLOW_FASTGEN_NUCLEUS", "one_pass")
    monkeypatch.setenv("VERLFLOW_FASTGEN_BUCKET_COMPILE", "static")
    monkeypatch.setenv("VERLFLOW_FASTGEN_INDUCTOR", '{"triton.enable_pdl": true}')
    monkeypatch.setenv("VERLFLOW_FASTGEN_FP8_GEMM", "rowwise")
    assert switches(on(True)) == (False, False, "triton", "triton", "one_pass", "static", {"triton.enable_pdl": True},
                                  Fp8Choices(gemm="rowwise"))
    given = on(True, graphs=True, compile=True, nucleus="two_pass", bucket_compile="dynamic", inductor={},
               fp8=Fp8Choices())
    assert switches(given) == (True, True, "triton", "triton", "two_pass", "dynamic", {}, Fp8Choices())
    for asked, field in ((dict(graphs=True), "graphs=True"), (dict(attn="flash"), "attn must be one of"),
                         (dict(sampler="numpy"), "sampler must be one of"), (dict(nucleus="3"), "nucleus must be"),
                         (dict(prefill_tokens=0), "prefill_tokens must be at least 1"),
                         (dict(attn="triton", have_triton=False), "'triton' needs Triton"),
                         (dict(fp8=Fp8Choices(gemm="cutlass")), "fp8 gemm must be")):
        with pytest.raises(ValueError, match=field):
            on(False, **asked)
    with pytest.raises(ValueError, match="attn='sdpa' cannot apply attn_logit_softcapping=50.0"):
        on(True, attn="sdpa", softcap=50.0)
    monkeypatch.setenv("VERLFLOW_FASTGEN_NUCLEUS", "three_pass")  # a bad variable is named as the source
    with pytest.raises(ValueError, match=r"nucleus \(VERLFLOW_FASTGEN_NUCLEUS\) must be one of"):
        on(False)


def test_static_bucket_compile_compiles_the_decode_step_once_per_bucket(models):
    """bucket_compile="static" (the A/B against one dynamic compile: infra/bench/rollout.py --ab-static-buckets)
    gives every cache bucket a graph of its own, with its length a constant, and the same tokens as eager. The
    engine has two rows: the set-up's refill compile indexed a third row before."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from verlflow.core.ml.fastgen.layers import _decode_layer

    with pytest.raises(ValueError, match="bucket_compile must be"):
        FastGen(models["qwen2"], 2, 4, 4, EngineOptions(bucket_compile="per-bucket"))
    torch._dynamo.reset()
    prompts, limits = prompts_of([5, 11, 3, 16], seed=5), [120, 3, 70, 7]
    runs, kvs = {}, set()
    for compiled in (False, True):
        eng = FastGen(models["qwen2"], 2, 16, 120, EngineOptions(attn="sdpa", check_every=2, compile=compiled,
                                                                 compile_backend="aot_eager", bucket_compile="static"))
        kv_len = eng._kv_len
        eng._kv_len = lambda slot: kvs.add(kv_len(slot)) or kv_len(slot)  # the buckets the steps ran
        runs[compiled] = eng.generate_many(prompts, SamplingConfig(temperature=0.0), [], PAD, limits=limits,
                                           refill_min=1)[0]
    assert runs[True] == runs[False]
    assert kvs == {64, 128, 136}
    assert len(_debug_get_cache_entry_list(_decode_layer.__code__)) == len(kvs)
    torch._dynamo.reset()


def test_set_up_with_grad_enabled_compiles_what_generation_runs(models):
    """prepare() called by a caller with grad on (infra/bench/ragged.py did) compiles the graphs generation uses:
    dynamo guards on grad mode, and generation runs without grad, so a set-up with grad compiled every prefill,
    sampler and logits function a second time in the first generation (3 compiles, 3 s on the H200)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from verlflow.core.ml.fastgen.layers import _prefill_layer

    torch._dynamo.reset()
    eng = FastGen(models["qwen2"], 3, 12, 8, EngineOptions(attn="sdpa", check_every=2, compile=True,
                                                           compile_backend="aot_eager"))
    assert torch.is_grad_enabled()
    eng.prepare([], PAD, SamplingConfig(temperature=0.0), 4, every_slot=True)
    assert len(_debug_get_cache_entry_list(_prefill_layer.__code__)) == 1
    eng.generate_many(prompts_of([5, 11, 4, 12, 8], seed=2), SamplingConfig(temperature=0.0), [], PAD,
                      limits=[8, 2, 5, 3, 8], refill_min=1)
    assert eng.last_stats["refills"] >= 2
    assert len(_debug_get_cache_entry_list(_prefill_layer.__code__)) == 1  # no second graph for grad mode
    torch._dynamo.reset()


def test_continuous_batching_sampled_logprobs_are_the_models_and_a_seed_reproduces(models):
    """Sampled with temperature and top_p through refilled rows: each token's saved log-prob is the model's own
    log_softmax(logits / T) at that token, recomputed from prompt + response alone (a stale cache slot, position
    or pad offset in a refilled row would change it); the same seed gives the same responses."""
    model = eos_biased(models["qwen2"], 4.0)
    prompts = prompts_of([4, 9, 2, 14, 7, 11, 3, 10, 5], seed=8)
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    eng = FastGen(model, 4, 14, 24, EngineOptions(check_every=3))
    torch.manual_seed(3)
    ours, logps = eng.generate_many(prompts, cfg, [EOS], PAD, refill_min=2)
    assert eng.last_stats["refills"] >= 3
    with torch.no_grad():
        for p, r, lp in zip(prompts, ours, logps):
            assert 0 < len(r) <= 24 and (EOS not in r[:-1])
            x = model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)].float() / 0.7
            want = x.log_softmax(-1).gather(1, torch.tensor(r)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(lp), want, atol=1e-4), (p, r)
    torch.manual_seed(3)
    assert eng.generate_many(prompts, cfg, [EOS], PAD, refill_min=2)[0] == ours


# ----------------------------------------------------------------------------------- sampling maths


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_nucleus_membership_is_hf_top_p(scale, top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(int(scale * 100 + top_p * 10))
    x = torch.randn(16, 300, generator=g) * scale  # 300: not a multiple of the 128-token block
    kept = torch.isfinite(TopPLogitsWarper(top_p)(None, x.clone()))
    every = torch.arange(300).expand(16, 300)
    assert torch.equal(nucleus_member(_Stats(x), every, top_p), kept)


@pytest.mark.parametrize("k,top_p", [(1, 1.0), (7, 1.0), (7, 0.6), (50, 0.9)])
def test_topk_filter_is_hf_topk_then_top_p(k, top_p):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(8, 5000, generator=g) * 2  # k * 128 < 5000: the block prefilter path
    vals, idx = topk_values(x, k)
    ref_v, ref_i = torch.topk(x, k)
    assert torch.equal(vals, ref_v) and torch.equal(idx, ref_i)
    fv, fi = topk_filter(x, k, top_p)
    ours = torch.zeros_like(x).scatter(1, fi, fv.softmax(-1))
    ref = hf_warped_probs(x, SamplingConfig(1.0, top_p, k))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


CASES = {  # name: (config, method the sampler picks for V=384)
    "temperature": (SamplingConfig(0.8), "reject"),
    "top_p": (SamplingConfig(1.0, 0.9), "reject"),
    "top_p_low": (SamplingConfig(1.3, 0.6), "reject"),  # 23 candidates
    "top_p_sort": (SamplingConfig(1.0, 0.3), "sort"),
    "top_k_top_p": (SamplingConfig(0.7, 0.9, 12), "topk"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampled_frequencies_match_hf_warpers(name):
    cfg, method = CASES[name]
    assert cfg.method(384) == method
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 384, generator=g) * 2.5
    p = hf_warped_probs(x, cfg)[0].double()
    n = 16384
    torch.manual_seed(11)
    draws = sample_logits(x.expand(n, 384).contiguous(), cfg)
    freq = torch.bincount(draws, minlength=384).double() / n
    assert (freq[p == 0] == 0).all(), "sampled a token HF's warpers remove"
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 2 / n).all()
    assert 0.5 * (freq - p).abs().sum() < 0.05


def test_first_token_distribution_matches_hf_generate(models):
    """End to end on the model: our first tokens vs HF's warped next-token distribution and HF's samples."""
    model = models["llama"]
    cfg = SamplingConfig(0.9, 0.85)
    ids, mask = left_padded([7], seed=5)
    n = 4096
    ids, mask = ids.expand(n, -1).contiguous(), mask.expand(n, -1).contiguous()
    eng = FastGen(model, n, 7, 1)
    torch.manual_seed(0)
    ours = eng.generate(ids, mask, cfg, [EOS], PAD)[:, 0]
    with torch.no_grad():
        p = hf_warped_probs(model(ids[:1]).logits[:, -1].float(), cfg)[0].double()
    torch.manual_seed(0)
    hf = hf_generate(model, ids, mask, 1, do_sample=True, temperature=0.9, top_p=0.85, top_k=0)[:, 0]
    f_ours = torch.bincount(ours, minlength=p.numel()).double() / n
    f_hf = torch.bincount(hf, minlength=p.numel()).double() / n
    assert (f_ours[p == 0] == 0).all() and (f_hf[p == 0] == 0).all()
    sigma = (p * (1 - p) / n).sqrt()
    assert ((f_ours - p).abs() <= 5 * sigma + 2 / n).all()
    assert ((f_hf - p).abs() <= 5 * sigma + 2 / n).all()  # p is what HF samples from
    # two-sample chi-square, ours against HF's own samples (equal sizes): ~ chi2(k - 1)
    c1, c2 = f_ours * n, f_hf * n
    seen = (c1 + c2) > 0
    chi2 = ((c1 - c2)[seen] ** 2 / (c1 + c2)[seen]).sum().item()
    dof = int(seen.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


def test_top_k_holds_at_every_step_and_seed_reproduces(models):
    model = models["qwen2"]
    ids, mask = left_padded([6, 10, 3, 8], seed=9)
    cfg = SamplingConfig(1.5, 1.0, 3)
    eng = FastGen(model, 4, 10, 12)
    torch.manual_seed(1)
    a = eng.generate(ids, mask, cfg, [EOS], PAD)
    torch.manual_seed(1)
    assert torch.equal(a, eng.generate(ids, mask, cfg, [EOS], PAD))
    torch.manual_seed(2)
    assert not torch.equal(a, eng.generate(ids, mask, cfg, [EOS], PAD))
    greedy = eng.generate(ids, mask, SamplingConfig(0.0), [EOS], PAD)
    assert not torch.equal(a, greedy)
    with torch.no_grad():
        for r in range(4):
            prompt = ids[r][mask[r].bool()]
            resp = a[r].tolist()
            n = resp.index(EOS) + 1 if EOS in resp else len(resp)
            logits = model(torch.cat([prompt, a[r, :n]])[None]).logits[0, len(prompt) - 1:len(prompt) - 1 + n]
            top3 = logits.topk(3).indices
            assert all(t in top3[i].tolist() for i, t in enumerate(resp[:n]))


# ---------------------------------------------------------------------------------- rollout + bench


def test_rollout_engine_static_matches_hf_path(tiny_kit):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verlflow.core.blueprint import RolloutSpec
    from verlflow.core.ml import fastgen, generate

    with pytest.raises(Exception):
        RolloutSpec(engine="vllm")
    assert RolloutSpec().engine == "hf"
    tok = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"]).eval()
    msgs = [[{"role": "user", "content": f"Write the digit {d} twice."}] for d in range(5)]
    enc = generate.encode_prompts(tok, msgs, 64, list(range(5)))
    cfg = RolloutSpec(temperature=0.0, max_new_tokens=10, micro_batch_size=2, engine="static")
    dev = torch.device("cpu")
    assert fastgen.sample(model, tok, enc, cfg, dev, 0) == generate.sample(model, tok, enc, cfg, dev, 0)
    cfg = RolloutSpec(temperature=1.0, top_p=0.9, max_new_tokens=10, micro_batch_size=2, engine="static")
    a, b = (fastgen.sample(model, tok, enc, cfg, dev, 5) for _ in range(2))
    assert a == b and all(0 < len(r) <= 10 for r in a)


def test_generate_share_dispatches_on_engine(monkeypatch):
    import verlflow.core.ml.fastgen
    import verlflow.core.ml.rollout

    called = []
    monkeypatch.setattr(verlflow.core.ml.fastgen, "sample", lambda *a, **k: called.append("static") or [])
    monkeypatch.setattr(verlflow.core.ml.rollout, "sample", lambda *a, **k: called.append("hf") or [])
    monkeypatch.setattr(verlflow.core.ml.rollout, "encode_prompts", lambda *a, **k: [])
    monkeypatch.setattr(verlflow.core.ml.rollout, "_scores", lambda *a, **k: [])

    class rollout:
        n, engine, micro_batch_size = 1, "static", 1

    class reward:
        function, module = "x", None

        class overlong_buffer:
            enable = False

    class Prompts:
        messages = []
        rows = []

        def __len__(self):
            return 0

    at = Placement(0, 1, None)
    verlflow.core.ml.rollout.generate_share(None, None, rollout, reward, Prompts(), 0, at, max_prompt_len=8, seed=0)
    rollout.engine = "hf"
    verlflow.core.ml.rollout.generate_share(None, None, rollout, reward, Prompts(), 0, at, max_prompt_len=8, seed=0)
    assert called == ["static", "hf"]


def smoke(script: str, *extra: str) -> tuple[dict, str]:
    """infra/bench/<script> --smoke [extra]: (its result, what it printed)."""
    mod = benchmark_script.load(script)
    buf = io.StringIO()
    with redirect_stdout(buf):
        res = mod.main(["--smoke", *extra])
    return res, buf.getvalue()


@pytest.mark.parametrize("top_p", [0.9, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_pass", [True, False])
def test_triton_samplers_logprobs_come_from_its_block_stats_and_equal_log_softmax(monkeypatch, top_p, dtype, two_pass):
    """The Triton sampler returns each token's log-prob from its own block pass (row max, total mass) instead of
    a second full-vocabulary pass. Its two full-vocabulary kernels need CUDA: here torch computes the same
    quantities (the engine's start-up self-check holds the kernels to them), so the composition is what is tested:
    the temperature, the max and the mass must give log_softmax(logits / T) of the chosen token."""
    from verlflow.core.ml.fastgen import kernels
    from verlflow.core.ml.generate import chosen_logprobs

    def block_stats(logits, t):
        st = _Stats(logits.float() / t)
        return st.bmax, st.bsum / torch.exp(st.bmax - st.m)  # each block's sum relative to its own max

    def member_mass(logits, t, m, xc, done=None):
        x = logits.float()
        w = torch.exp(x / t - m.unsqueeze(1))
        le = torch.stack([(w * (x <= xc[:, c:c + 1].float())).sum(1) for c in range(xc.shape[1])], 1)
        return le if done is None else torch.where(done.unsqueeze(1), 0.0, le)

    monkeypatch.setattr(kernels, "block_stats_triton", block_stats)
    monkeypatch.setattr(kernels, "member_mass_triton", member_mass)
    monkeypatch.setattr(kernels, "first_mass_triton", lambda logits, t, m, xc: member_mass(logits, t, m, xc[:, :1]))
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 3000, generator=g) * 3).to(dtype)
    cfg = SamplingConfig(0.7, top_p)
    u = torch.rand(6, cfg.candidates(), 2, generator=g)
    tok, logp = kernels.sample_logits_triton(logits, cfg, u, two_pass=two_pass)
    want = chosen_logprobs(logits.float() / 0.7, tok)
    assert logp.dtype == torch.float32 and tok.shape == logp.shape == (6,)
    assert torch.allclose(logp, want, atol=1e-5), (logp - want).abs().max()
    assert (logp > -50).all() and len(set(tok.tolist())) > 1  # real draws, not the argmax or an underflow


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton sampler's kernels run on CUDA")
@pytest.mark.parametrize("top_p", [0.9, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_samplers_logprobs_equal_log_softmax(top_p, dtype):
    """The same as above with the real Triton kernels, at a vocabulary of Qwen's size."""
    from verlflow.core.ml.fastgen import kernels
    from verlflow.core.ml.generate import chosen_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 151936, generator=g, device="cuda") * 3).to(dtype)
    cfg = SamplingConfig(0.7, top_p)
    u = torch.rand(64, cfg.candidates(), 2, generator=g, device="cuda")
    tok, logp = kernels.sample_logits_triton(logits, cfg, u)
    want = chosen_logprobs(logits.float() / 0.7, tok)
    assert logp.dtype == torch.float32 and tok.shape == logp.shape == (64,)
    assert torch.allclose(logp, want, atol=1e-4), (logp - want).abs().max()
    assert (logp > -50).all() and len(set(tok.tolist())) > 1
    one, _ = kernels.sample_logits_triton(logits, cfg, u, two_pass=False)  # the nucleus test in one pass
    assert torch.equal(one, tok)


def test_benchmark_smoke_prints_the_table():
    res, out = smoke("rollout.py", "--ab-attn", "--ab-inductor", "{}")
    assert "| measure | baseline (HF generate) | ours (fastgen) | ratio | floor |" in out
    for row in ("generated tok/s, sampled", "decode ms/step, sampled", "generated tok/s, greedy"):
        assert row in out
    r = res["tiny"]
    assert r["ours_sampled"]["tokens"] > 0 and r["hf_sampled"]["tokens"] > 0
    assert r["greedy_agreement_vs_hf"]["rows_identical"] == 1.0  # fp32 on CPU: exact
    # the fp8 A/B: its row, and the policy gap it measures (none for the model's weights in fp32, some for fp8)
    assert "ours with fp8 projections" in out and r["ours_fp8_sampled"]["tokens"] > 0
    model_gap, fp8_gap = r["model_policy_gap"], r["fp8_policy_gap"]
    assert model_gap["abs_logp_diff"] < 1e-4 and fp8_gap["abs_logp_diff"] > 1e-3, (model_gap, fp8_gap)
    # ... and the fp8 KV cache's, alone and with fp8 projections
    assert "ours with an fp8 KV cache" in out and r["ours_fp8_kv8_sampled"]["tokens"] > 0
    assert r["kv8_policy_gap"]["abs_logp_diff"] > 1e-4 and r["fp8_kv8_policy_gap"]["abs_logp_diff"] > 1e-3
    # the engine on sdpa beside its choice (bmm on CPU), and under inductor options
    assert r["ours_sdpa_attention_sampled"]["tokens"] == r["ours_inductor0_sampled"]["tokens"] > 0
    assert r["ours_inductor0_options"] == "{}"


def test_ragged_benchmark_smoke_same_tokens_fewer_steps():
    """infra/bench/ragged.py on CPU: both modes honour the same budgets (same tokens); continuous batching needs
    fewer decode steps for them (rows refilled instead of idling until a micro-batch's longest row ends)."""
    res, out = smoke("ragged.py")
    assert ("| mode | tokens | seconds | tok/s | steps | row occupancy | GPU busy % | compiles (s) | "
            "prefill s (refill shapes) | speed-up |") in out
    waves, cont = res["waves"], res["continuous"]
    assert cont["tokens"] == waves["tokens"] > 0
    assert cont["steps"] < waves["steps"] and cont["occupancy"] > waves["occupancy"] and cont["refills"] > 1
    assert 1 <= cont["refill_shapes"] <= cont["refills"]
    assert all(isinstance(res[k]["compiles"], int) for k in ("waves", "continuous", "continuous_again"))


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_rollout_logprobs_equal_the_updates_recomputed_ones(tiny_kit, tmp_path, engine):
    """fp32 on CPU: the log-probs a rollout saves with its batch (the sampling logits over the temperature, of the
    chosen tokens) are the update's recomputed old log-probs, and algorithm.old_logprobs=rollout takes them."""
    from tinybp import tiny_blueprint
    from transformers import AutoTokenizer

    from verlflow.core.ml import model as M, ppo
    from verlflow.core.ml.data import load_prompts
    from verlflow.core.ml.rollout import generate_share, load_batch, save_batch
    from verlflow.core.stages.update import ppo_spec

    bp = tiny_blueprint(tiny_kit, tmp_path, rollout__engine=engine, rollout__temperature=0.7, rollout__n=2,
                        rollout__max_new_tokens=24, rollout__micro_batch_size=3, resources__nproc_per_node=1)
    tok = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    model = M.build_module(tiny_kit["model_dir"], bp.model).eval()
    with torch.no_grad():  # a random model rarely says EOS: make it likelier, so responses are ragged
        model.lm_head.weight[tok.eos_token_id] *= 6
    # A model's own sampling settings (Qwen2.5-Instruct ships some) do not apply: the rollout section says it all.
    model.generation_config.repetition_penalty, model.generation_config.top_k = 1.3, 5
    data = load_prompts(bp.data.train_files, bp.data.prompt_key)
    at = Placement(0, 1, torch.device("cpu"))
    samples = generate_share(model, tok, bp.rollout, bp.reward, data.take(list(range(bp.data.batch_size))), 1, at,
                             max_prompt_len=bp.data.max_prompt_length, seed=bp.seed)
    save_batch(samples, tmp_path, tok.pad_token_id, bp.rollout.max_new_tokens)
    batch = load_batch(tmp_path)
    mask = batch["response_mask"].bool()
    assert 0 < mask.sum(1).min() < mask.shape[1]  # ragged: some responses ended at EOS
    want = ppo.score_all(model, batch, ppo_spec(bp), at)
    got = batch["rollout_logp"]
    assert got.dtype == torch.float32 and (got[~mask] == 0).all()
    torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
    rollout_bp = tiny_blueprint(tiny_kit, tmp_path, algorithm__old_logprobs="rollout", resources__nproc_per_node=1)
    assert torch.equal(ppo.old_logprobs(model, batch, ppo_spec(rollout_bp), at), got)
    assert torch.equal(ppo.old_logprobs(model, batch, ppo_spec(bp), at), want)  # recompute, the default


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()),
                    reason="attn='auto' times its candidates on CUDA with Triton")
def test_cuda_attention_choice_is_timed_once_per_machine_and_shape(models, tmp_path, monkeypatch):
    """The decode attention an engine timed is kept in the machine's cache folder: a second engine of the same shape
    takes it without timing (a pool's first rollout spent 3.5 s in the checks and timing), another shape times
    again, and an unreadable file only means timing again."""
    import copy
    import json

    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path))
    model = copy.deepcopy(models["qwen2"]).to("cuda", torch.bfloat16)
    kept = tmp_path / "fastgen/attention.json"
    first = FastGen(model, 8, 16, 32)
    assert first.attn_timings, f"no timing (attn {first.attn}: did the Triton kernel fail its start-up check?)"
    assert len(json.loads(kept.read_text())) == 1
    again = FastGen(model, 8, 16, 32)
    assert (again.attn, again.attn_cfg, again.attn_timings) == (first.attn, first.attn_cfg, first.attn_timings)
    assert first.ragged_timings and (again.ragged_attn, again.ragged_timings) == (first.ragged_attn,
                                                                                 first.ragged_timings)
    assert again.setup_parts["checks_s"] < first.setup_parts["checks_s"]
    FastGen(model, 16, 16, 32)
    assert len(json.loads(kept.read_text())) == 2
    kept.write_text("{not json")
    assert FastGen(model, 8, 16, 32).attn_timings
    assert len(json.loads(kept.read_text())) == 1
