"""Checks of the static engine's Triton kernels under Triton's interpreter, run by tests/test_triton_kernels.py.

Run as `TRITON_INTERPRET=1 python tests/triton_interpreted.py CHECK...`: the interpreter is chosen when a kernel
is defined, so it needs a process of its own. Prints one JSON line: for each check, what its test asserts on. fp32
throughout (the interpreter's bf16 `tl.dot` is broken); the kernels' bf16 path is the GPU's (the engine's start-up
self-check)."""

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

def _scalar_index_shim():
    """Triton 3.6's interpreter turns a scalar tensor into a Python int with int() on a one-element array, which
    numpy >= 2.4 refuses; a loop whose bounds are loaded values (the RANGED attention) needs it. Compiled kernels do
    not pass through here."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _rounding_shim():
    """Triton 3.6's interpreter casts fp32 down (to e4m3, bf16, fp16) rounding half up without carrying into the
    exponent (31.76 to e4m3 becomes 16, not 32); the GPU's cvt.rn rounds to nearest even, as torch does. Kernels that
    round (the down projection's fp8 input) are held to torch's casts, so the interpreter casts with torch."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    to = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.int16),
          tl.float16: (torch.float16, torch.int16)}

    def rounded(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype in to and input_dtype == tl.float32:
            dt, bits = to[output_dtype]
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            if dt == torch.float8_e4m3fn:  # (the GPU's cast saturates; torch's gives NaN past 448)
                x = x.clamp(-448.0, 448.0)
            return x.to(dt).view(bits).numpy().view(np.uint8 if bits == torch.uint8 else np.uint16).reshape(
                input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = rounded


_scalar_index_shim()
_rounding_shim()

from verlflow.core.ml.fastgen import EngineOptions, FastGen, Fp8Choices, SamplingConfig  # noqa: E402
from verlflow.core.ml.fastgen import checks  # noqa: E402
from verlflow.core.ml.fastgen.kernels import (combine_splits, decode_attention_triton,  # noqa: E402
                                              reference_decode_attention, sample_logits_triton)
from verlflow.core.ml.fastgen.sampling import sample_logits  # noqa: E402

EOS, PAD = 3, 0


def pairwise(i: int, slot_sets: list, variants: list) -> list[tuple]:
    """Configuration i's (slots, variant) cases: each slot set once, each with another variant, the pairing shifted
    by i, so that every configuration meets every slot set and every variant, and the configurations together meet
    every (slot set, variant) pair (pairwise coverage: a third of the full product, which took a minute)."""
    return [(slots, variants[(k + i) % len(variants)]) for k, slots in enumerate(slot_sets)]


def interpreted_once(check):
    """``check(i, cfg)`` for each configuration attn="auto" may pick, by its JSON; a configuration that differs from
    an earlier one only in num_warps or num_stages gets that one's result: the interpreter runs a program as one
    thread, so they run the same code (the compile test in tests/test_triton_kernels.py builds each)."""
    out, seen = {}, {}
    for i, cfg in enumerate(FastGen._ATTN_CONFIGS):
        loops = json.dumps({k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}, sort_keys=True)
        if loops not in seen:
            seen[loops] = check(i, cfg)
        out[json.dumps(cfg, sort_keys=True)] = seen[loops]
    return out


def attention() -> dict:
    """Every configuration attn="auto" may pick, against the reference: rows with their own pad and slot, slots
    and pads on and beside block edges (where a bounded split's first or last block is kept or skipped), each
    with and without a window and soft-capping, and with a head dim not a power of two (Phi-3's 96: runs padded)."""
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, T = 4, 12, 2, 300
    pad = torch.tensor([0, 63, 64, 150])
    slot_sets = [[127, 128, 191, 299], [64, 255, 256, 150], [299, 63, 64, 191]]

    def worst(i, cfg):
        err = 0.0
        for k, (slots, (win, cap)) in enumerate(pairwise(i, slot_sets, [(0, 0.0), (40, 0.0), (64, 2.0)])):
            D = 24 if k == i % len(slot_sets) else 32  # each configuration pads the head dim in one of its cases
            q, kc, vc = (torch.randn(*s, generator=g) for s in ((B, nh, D), (B, nkv, T, D), (B, nkv, T, D)))
            slot = torch.tensor(slots)
            got = combine_splits(*decode_attention_triton(q, kc, vc, pad, slot, 0.2, nkv, window=win, softcap=cap,
                                                          **cfg), nh // nkv)
            want = reference_decode_attention(q, kc, vc, pad, slot, 0.2, window=win, softcap=cap)
            err = max(err, (got - want).abs().max().item())
        return err

    return {"max_abs_error": interpreted_once(worst)}


def attention_fp8_cache() -> dict:
    """Every configuration reading an fp8 cache (e4m3 with a scale per slot, the slots' sizes four decades apart)
    against the reference reading it back, in two cases: slots on block edges, and a window, soft-capping and a
    padded head dim (the edges' and variants' combinations are attention()'s); the error is relative to the
    output's size."""
    from verlflow.core.ml.fastgen.layers import quantize_slots

    g = torch.Generator().manual_seed(1)
    B, nh, nkv, T = 4, 12, 2, 300
    pad = torch.tensor([0, 63, 64, 150])
    size = torch.logspace(-2, 2, T).view(T, 1)

    def worst(i, cfg):
        err = 0.0
        for D, slots, (win, cap) in ((32, [127, 128, 191, 299], (0, 0.0)), (24, [64, 255, 256, 150], (40, 2.0))):
            q = torch.randn(B, nh, D, generator=g)
            (kc, ks), (vc, vs) = (quantize_slots(torch.randn(B, nkv, T, D, generator=g) * sz)
                                  for sz in (size, size.flip(0)))
            slot = torch.tensor(slots)
            got = combine_splits(*decode_attention_triton(q, kc, vc, pad, slot, 0.2, nkv, window=win, softcap=cap,
                                                          ks=ks, vs=vs, **cfg), nh // nkv)
            want = reference_decode_attention(q, kc, vc, pad, slot, 0.2, window=win, softcap=cap, ks=ks, vs=vs)
            err = max(err, ((got - want).abs().max() / want.abs().max()).item())
        return err

    return {"max_rel_error": interpreted_once(worst)}


def nucleus() -> dict:
    """The two-pass nucleus test against the one-pass kernel and the torch sampler, for the same uniforms."""
    from verlflow.core.ml.fastgen.kernels import _first_decided

    g = torch.Generator().manual_seed(0)
    rows, out = 32, []
    for top_p, temperature in ((0.95, 1.0), (0.7, 0.8), (0.5, 1.3)):
        logits = torch.randn(rows, 5000, generator=g) * 3
        logits[:rows // 4] *= 4  # peaked rows: their first candidate is rejected more often
        cfg = SamplingConfig(temperature, top_p)
        u = torch.rand(rows, cfg.candidates(), 2, generator=g)
        decided = []  # the rows the first pass settled, as the two-pass sampler saw them

        def first_pass(*a):
            le0, done = _first_decided(*a)
            decided.append(done)
            return le0, done

        two, lp2 = sample_logits_triton(logits, cfg, u, decided_fn=first_pass, two_pass=True)
        one, lp1 = sample_logits_triton(logits, cfg, u, two_pass=False)
        ref = sample_logits(logits, cfg, u)
        out.append({"top_p": top_p, "two_eq_one": torch.equal(two, one), "two_eq_torch": torch.equal(two, ref),
                    "logp_diff": (lp2 - lp1).abs().max().item(), "settled": int(decided[0].sum()), "rows": rows,
                    "distinct": len(set(two.tolist()))})
    return {"cases": out}


def tiny_model():
    """A tiny Qwen3 with a sliding-window layer (the kernel's window variant), fp32, weights wide enough that
    attention is far from uniform."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=384, initializer_range=0.2,
                                   use_sliding_window=True, sliding_window=6, max_window_layers=1, pad_token_id=PAD,
                                   eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 384, (n,), generator=g).tolist() for n in lens]


# the configuration the engine's self-checks run on: splits of one block (the check's 200 slots in 4 splits; the
# generations' configuration, blocks of 8, cuts them into 13, interpreted 6 times more slowly)
SELF_CHECKED = {"split_n": 64, "block_n": 64, "num_warps": 4, "bounded": True}


def engine() -> dict:
    """The engine on the Triton paths (bounded attention, the Triton sampler): greedy equals HF's generate prompt by
    prompt under continuous batching; sampled tokens equal, for one seed, across the two nucleus tests and the torch
    sampler; the start-up self-check keeps the kernels, and drops a broken one."""
    model = tiny_model()
    lens = [5, 11, 3, 9, 1, 12]
    ps = prompts(lens, seed=3)
    res = {}
    eng = FastGen(model, 3, 12, 8, EngineOptions(attn="triton", sampler="triton", check_every=2))
    hf = []
    for p in ps:
        ids = torch.tensor([p])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=PAD, eos_token_id=EOS)[0, len(p):].tolist()
        hf.append(out[:out.index(EOS) + 1] if EOS in out else out)
    eng.attn_cfg = {"splits": 3, "block_n": 8, "num_warps": 1}  # each row's slots in 3 runs, of 1-2 blocks
    res["greedy_equals_hf_ranged"] = eng.generate_many(ps, SamplingConfig(0.0), [EOS], PAD, refill_min=1)[0] == hf
    eng.attn_cfg = {"split_n": 16, "block_n": 8, "num_warps": 1, "bounded": True}  # splits of two blocks
    ours, _ = eng.generate_many(ps, SamplingConfig(0.0), [EOS], PAD, refill_min=1)
    res["greedy_equals_hf"] = ours == hf
    cfg = SamplingConfig(1.0, 0.9)
    sampled = {}
    # the samplers compared over one attention, CPU's own (greedy above has the kernel's): the same logits for the
    # three, and no interpreted attention in three more generations
    for name, (sampler, nucleus) in {"two_pass": ("triton", "two_pass"), "one_pass": ("triton", "one_pass"),
                                     "torch": ("torch", "two_pass")}.items():
        e = FastGen(model, 3, 12, 8, EngineOptions(attn="bmm", sampler=sampler, nucleus=nucleus, check_every=2))
        torch.manual_seed(7)
        sampled[name] = e.generate_many(ps, cfg, [EOS], PAD, refill_min=1)
    res["sampled_two_eq_one"] = sampled["two_pass"][0] == sampled["one_pass"][0]
    res["sampled_two_eq_torch"] = sampled["two_pass"][0] == sampled["torch"][0]
    res["sampled_differs_from_greedy"] = sampled["two_pass"][0] != ours
    res["logp_diff"] = max(abs(a - b) for ra, rb in zip(sampled["two_pass"][1], sampled["torch"][1])
                           for a, b in zip(ra, rb))
    eng.attn_cfg = SELF_CHECKED
    eng._self_check()
    res["self_check_keeps"] = [eng.attn, eng.sampler]
    real = checks.first_mass_triton
    checks.first_mass_triton = lambda *a, **k: real(*a, **k) * 1.01  # a first pass 1 % off
    eng._self_check()
    checks.first_mass_triton = real
    res["self_check_after_breaking_the_sampler"] = [eng.attn, eng.sampler]
    real_attn = checks.decode_attention_triton
    checks.decode_attention_triton = lambda *a, **k: tuple(t[:, :, :1] for t in real_attn(*a, **k))  # 1 of 4 splits
    eng._self_check()
    checks.decode_attention_triton = real_attn
    res["self_check_after_breaking_attention"] = [eng.attn, eng.sampler]
    return res


def engine_fp8_cache() -> dict:
    """The engine reading its fp8 cache with the Triton kernel (bounded, under continuous batching, a sliding-window
    layer): greedy equals HF's generate prompt by prompt over rounded keys and values; the start-up self-check keeps
    the kernel, and drops one that ignores the values' scales."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kv8_reference import fp8_cache

    model = tiny_model()
    ps = prompts([5, 11, 3, 9, 1, 12], seed=3)
    eng = FastGen(model, 3, 12, 8, EngineOptions(attn="triton", sampler="torch", check_every=2, kv_cache="fp8"))
    eng.attn_cfg = {"split_n": 16, "block_n": 8, "num_warps": 1, "bounded": True}  # splits of two blocks
    ours, _ = eng.generate_many(ps, SamplingConfig(0.0), [EOS], PAD, refill_min=1)
    hf = []
    with fp8_cache(model):
        for p in ps:
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[0, len(p):].tolist()
            hf.append(out[:out.index(EOS) + 1] if EOS in out else out)
    res = {"greedy_equals_hf": ours == hf, "cache": str(eng.kc[0].dtype)}
    eng.attn_cfg = SELF_CHECKED
    eng._self_check()
    res["self_check_keeps"] = eng.attn
    real_attn = checks.decode_attention_triton
    checks.decode_attention_triton = lambda *a, vs=None, **k: real_attn(*a, vs=torch.ones_like(vs), **k)
    eng._self_check()
    checks.decode_attention_triton = real_attn
    res["self_check_after_breaking_the_scales"] = eng.attn
    return res


def picking() -> dict:
    """attn="auto"'s choice logic (its timer needs CUDA graphs: here it reports times the check chose): a failing
    configuration is not timed; one length and spread lengths each keep their fastest; the kept record round-trips."""
    from verlflow.core.ml.fastgen import choices

    every = FastGen._ATTN_CONFIGS
    # two bounded and the first ranged one: the choice among kinds (the picker checks each candidate, interpreted:
    # every configuration's check is attention()'s)
    bounded = [c for c in every if c.get("bounded")]
    configs = (*bounded[:2], next(c for c in every if c.get("splits")))
    broken = {"split_n": 64, "block_n": 48, "num_warps": 4}  # 48: not a power of two, Triton refuses the block
    FastGen._ATTN_CONFIGS = configs + (broken,)
    last_bounded = max(i for i, c in enumerate(configs) if c.get("bounded"))
    seen = []

    def times(fns, dev):  # sdpa fastest at one length; the last bounded configuration at spread lengths
        seen.append(sorted(fns))
        spread = len(seen) == 2
        return {k: (30.0 if spread else 10.0) if k == "sdpa" else
                (15.0 if spread and k == f"triton{last_bounded}" else 20.0 + int(k[6:])) for k in fns}

    def kept(e):
        return [e.attn, e.attn_cfg, list(e.ragged_attn or []), e.attn_timings, e.ragged_timings]

    def round_trip(e):
        again = FastGen(tiny_model(), 4, 8, 8, EngineOptions(attn="triton", sampler="torch"))
        again._take_choice(json.loads(json.dumps(e._choice())))  # through JSON, as the cache file keeps it
        return kept(again) == kept(e)

    graph_times, choices.graph_times = choices.graph_times, times
    try:
        eng = FastGen(tiny_model(), 4, 8, 8, EngineOptions(attn="triton", sampler="torch"))
        eng._pick_attention()
        choices.graph_times = lambda fns, dev: {k: 10.0 if k == "sdpa" else 20.0 for k in fns}  # sdpa both times
        FastGen._ATTN_CONFIGS = configs[:1]  # one candidate is enough to lose to sdpa (each checks, interpreted)
        same = FastGen(tiny_model(), 4, 8, 8, EngineOptions(attn="triton", sampler="torch"))
        same._pick_attention()
    finally:
        FastGen._ATTN_CONFIGS, choices.graph_times = every, graph_times
    return {"timed": seen, "broken_index": len(configs), "attn": [eng.attn, eng.attn_cfg],
            "ragged": list(eng.ragged_attn or []), "last_bounded": configs[last_bounded],
            "round_trip": round_trip(eng), "same_choice": [same.attn, same.ragged_attn, bool(same.ragged_timings)],
            "same_round_trip": round_trip(same)}


def run(names: list[str]) -> dict:
    """Each check's result, or {"error": its traceback}: several in one process (a process's imports of torch,
    Triton and transformers cost 2-4 CPU-s), each from the random state a process of its own starts with."""
    import traceback

    fresh, out = torch.initial_seed(), {}
    for name in names:
        torch.manual_seed(fresh)
        try:
            out[name] = globals()[name]()
        except Exception:  # noqa: BLE001 - the test of that check shows it
            out[name] = {"error": traceback.format_exc()}
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
