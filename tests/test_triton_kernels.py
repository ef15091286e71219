"""The static engine's Triton kernels on a machine without a GPU.

* Run: Triton's interpreter executes them (tests/triton_interpreted.py, a process of its own with
  TRITON_INTERPRET=1) against the torch references, inside the engine too.
* Built: Triton's compiler and the ptxas its wheel ships turn every variant the engine may launch into an H200
  (sm_90) binary, so a kernel that would not compile is found here, not in a GPU session.

`make install-dev` installs Triton on CPU machines (GPU machines have torch's own)."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sysdeps import unavailable

pytestmark = pytest.mark.stages

HERE = Path(__file__).resolve().parent


def _triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        unavailable("Triton is not installed (`make install-dev` installs it on CPU machines)")


@pytest.fixture(autouse=True)
def triton_installed():
    _triton()


CHECKS = ("attention", "attention_fp8_cache", "engine_fp8_cache", "nucleus", "engine", "picking")


@pytest.fixture(scope="module")
def checked() -> dict:
    """Every check of tests/triton_interpreted.py in one interpreter process (a process each paid the imports of
    torch, Triton and transformers six times: 15 CPU-s)."""
    _triton()
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(HERE / "triton_interpreted.py"), *CHECKS], env=env, capture_output=True,
                       text=True, timeout=590)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def interpreted(checked):
    def result(check: str) -> dict:
        res = checked[check]
        assert "error" not in res, res.get("error")
        return res
    return result


def test_every_timed_attention_configuration_equals_the_reference(interpreted):
    """Each configuration attn="auto" may keep, the bounded ones (which skip blocks with no valid slot) and the
    ranged ones (loops bounded by each row's slots, some splits empty) among them, at slots and pads on and beside
    block edges, with windows and soft-capping."""
    from verlflow.core.ml.fastgen import FastGen

    errors = interpreted("attention")["max_abs_error"]
    assert len(errors) == len(FastGen._ATTN_CONFIGS)
    assert any('"bounded": true' in k for k in errors) and any('"splits": 2' in k for k in errors)
    bad = {cfg: err for cfg, err in errors.items() if not err < 1e-5}
    assert not bad, bad


def test_every_timed_attention_configuration_reads_an_fp8_cache_as_the_reference(interpreted):
    """rollout.kv_cache=fp8: the kernel loads e4m3 keys and values and their per-slot scales (K's after the dot, V's
    on the probabilities before it), at slots whose sizes span four decades."""
    from verlflow.core.ml.fastgen import FastGen

    errors = interpreted("attention_fp8_cache")["max_rel_error"]
    assert len(errors) == len(FastGen._ATTN_CONFIGS)
    bad = {cfg: err for cfg, err in errors.items() if not err < 1e-5}
    assert not bad, bad


def test_engine_reads_its_fp8_cache_with_the_triton_kernel_and_checks_it(interpreted):
    res = interpreted("engine_fp8_cache")
    assert res["cache"] == "torch.float8_e4m3fn" and res["greedy_equals_hf"]
    assert res["self_check_keeps"] == "triton"
    assert res["self_check_after_breaking_the_scales"] == "sdpa"


def test_two_pass_nucleus_test_picks_the_one_pass_and_torch_samplers_tokens(interpreted):
    """The first pass settles most rows (its candidate is accepted); the rest take the second pass. Either way the
    token is the first accepted candidate: the one-pass kernel's and the torch sampler's, for the same uniforms."""
    for case in interpreted("nucleus")["cases"]:
        assert case["two_eq_one"] and case["two_eq_torch"] and case["logp_diff"] == 0.0, case
        assert 0 < case["settled"] < case["rows"], case  # both passes decided some rows
        assert case["distinct"] > case["rows"] // 2, case  # real draws


def test_engine_on_the_triton_paths_and_its_self_check(interpreted):
    res = interpreted("engine")
    assert res["greedy_equals_hf"]  # bounded attention under continuous batching, a sliding-window layer
    assert res["greedy_equals_hf_ranged"]  # ranged: loops bounded by each refilled row's own pad and slot
    assert res["sampled_two_eq_one"] and res["sampled_two_eq_torch"] and res["sampled_differs_from_greedy"]
    assert res["logp_diff"] < 1e-5
    assert res["self_check_keeps"] == ["triton", "triton"]
    assert res["self_check_after_breaking_the_sampler"] == ["triton", "torch"]  # a first pass 1 % off
    assert res["self_check_after_breaking_attention"] == ["sdpa", "torch"]  # attention over one split of many


def test_attention_choice_per_batching_mode_and_its_record(interpreted):
    res = interpreted("picking")
    assert len(res["timed"]) == 2 and all(f"triton{res['broken_index']}" not in t for t in res["timed"])
    assert all("sdpa" in t and len(t) == res["broken_index"] + 1 for t in res["timed"])  # every good one, and sdpa
    assert res["attn"] == ["sdpa", {}]  # fastest at one length
    assert res["ragged"] == ["triton", res["last_bounded"]]  # fastest at spread lengths
    assert res["round_trip"]
    assert res["same_choice"] == ["sdpa", None, True] and res["same_round_trip"]  # one choice, both timings kept


ATTN_SIG = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KS": "*fp32", "VS": "*fp32", "PAD": "*i64", "SLOT": "*i64",
            "MP": "*fp32", "LP": "*fp32", "OP": "*fp32", "scale": "fp32", "sqb": "i32", "sqh": "i32", "skb": "i32",
            "skh": "i32", "skt": "i32", "ssb": "i32", "ssh": "i32", "NKV": "i32", "NSPLIT": "i32"}
FP8_CACHE = {"K": "*fp8e4nv", "V": "*fp8e4nv"}
ALIGNED = ("sqb", "sqh", "skb", "skh", "skt", "sxb", "sy")  # strides the engine's tensors give, multiples of 16
SAMPLER_SIG = {"X": "*bf16", "sxb": "i32", "V": "i32", "inv_t": "fp32", "M": "*fp32", "XC": "*bf16"}


def variants():
    """(kernel name, signature, constants, warps, stages): every kernel in the variants the engine launches."""
    from verlflow.core.ml.fastgen import FastGen

    for i, cfg in enumerate(FastGen._ATTN_CONFIGS):  # each configuration, plain and reading an fp8 cache; the
        # window, soft-cap and fp32 variants of the first plain, bounded and ranged one (the variants change the
        # body, not the loop structure)
        firsts = [next(j for j, c in enumerate(FastGen._ATTN_CONFIGS) if pick(c))
                  for pick in (lambda c: True, lambda c: c.get("bounded"), lambda c: c.get("splits"))]
        extra = ((4096, 0.0, False), (4096, 50.0, False), (0, 0.0, True)) if i in firsts else ()
        for window, softcap, ieee, kv8 in ((0, 0.0, False, False), (0, 0.0, False, True),
                                           *((*e, False) for e in extra), *((*e, True) for e in extra)):
            dt = "*fp32" if ieee else "*bf16"
            sig = {**ATTN_SIG, "Q": dt, "K": dt, "V": dt, **(FP8_CACHE if kv8 else {})}
            yield ("_decode_attn_kernel", sig,
                   dict(G=6, GP=16, D=128, DP=128, SPLIT_N=cfg.get("split_n", 64), BLOCK_N=cfg["block_n"],
                        WINDOW=window, SOFTCAP=softcap, IEEE=ieee, BOUNDED=bool(cfg.get("bounded")), KV8=kv8,
                        RANGED=bool(cfg.get("splits"))), cfg["num_warps"], cfg.get("num_stages", 3))
    for d, dp in ((96, 128), (256, 256)):  # Phi-3's head dim (padded to 128), Gemma's
        for kv8, ranged in itertools.product((False, True), (False, True)):
            yield ("_decode_attn_kernel", {**ATTN_SIG, **(FP8_CACHE if kv8 else {})},
                   dict(G=4, GP=16, D=d, DP=dp, SPLIT_N=64, BLOCK_N=64, WINDOW=0, SOFTCAP=0.0, IEEE=False,
                        BOUNDED=not ranged, KV8=kv8, RANGED=ranged), 4, 3)
    yield ("_block_stats_kernel", {"X": "*bf16", "sxb": "i32", "V": "i32", "inv_t": "fp32", "BMAX": "*fp32",
                                   "BSUM": "*fp32", "NB": "i32"}, dict(BPP=16, BLK=128), 4, 3)
    for gated in (False, True):
        yield ("_member_kernel", {**SAMPLER_SIG, "LE": "*fp32", "NCH": "i32", "DONE": "*u8"},
               dict(C=7, CP=8, CHUNK=8192 if gated else 2048, SUB=1024, GATED=gated), 8, 3)
    yield ("_first_mass_kernel", {**SAMPLER_SIG, "sxc": "i32", "LE": "*fp32", "NCH": "i32"}, dict(BLK=2048), 4, 3)


def test_every_kernel_variant_compiles_for_the_h200():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from verlflow.core.ml.fastgen import kernels

    built = []
    for name, sig, const, warps, stages in variants():
        fn = getattr(kernels, name)
        sig = {**sig, **{k: "constexpr" for k in const}}
        assert list(sig) == fn.arg_names, f"{name}: the test's signature is not the kernel's: {fn.arg_names}"
        # as the launch specializes them (pointers and the cache's strides are multiples of 16): what lets Triton
        # pipeline the loads through shared memory, and so what decides the kernel's shared memory
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if sig[a].startswith("*") or a in ALIGNED}
        c = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        assert c.asm["cubin"], (name, const)
        # the H200's 227 KiB a block: a kernel over it compiles but fails at launch
        assert c.metadata.shared <= 232448, (name, const, c.metadata.shared)
        built.append(name)
    assert {"_decode_attn_kernel", "_block_stats_kernel", "_member_kernel", "_first_mass_kernel"} <= set(built)
