"""CPU smoke runs of the update and stage-boundary benchmarks, so the GPU measurements' code cannot rot."""

import json

import benchmark_script
import pytest
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.stages

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(reason="covered by test_benchmarks::test_e2e_benchmark_smoke")
def test_update_benchmark_smoke_two_ranks(tmp_path):
    """torchrun, 2 ranks (gloo): the baseline and the packed/deferred-sync paths of verlflow.core.ml.ppo on a ragged batch, and LoRA."""
    out = tmp_path / "u.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "infra/bench/update.py"),
           "--smoke", "--configs", "baseline,packed_no_ac,best_defer,fused_32k_keep,lora", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| config | world | train MFU | ratio vs baseline |" in proc.stdout
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"baseline", "packed_no_ac", "best_defer", "fused_32k_keep", "lora"}
    assert rows["lora"]["trainable_params"] < rows["baseline"]["trainable_params"] / 2  # adapters only
    for r in rows.values():
        assert "error" not in r, r
        assert r["world"] == 2 and r["train_flops_per_s_per_gpu"] > 0 and r["tokens_per_s_per_gpu"] > 0
        assert r["real_tokens"] < r["padded_tokens"]  # the batch is ragged, as RL batches are
        assert r["samples"] == 8 * 2 * 1, r  # --smoke: 8 samples per GPU, 2 ranks, 1 timed step


@pytest.mark.slow(reason="covered by test_benchmarks::test_e2e_benchmark_smoke (the same warm-pool path)")
def test_boundaries_benchmark_smoke(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "infra/bench/boundaries.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("| measure | one process (baseline) | warm pool (ours, async commits) | ratio | warm pool, commits inline "
            "| fresh stage jobs |") in proc.stdout
    assert "| iteration 2: rollout + update + export |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["steady_iteration"] == 2 and res["monolithic_work_s"] > 0
    assert 0 < res["warm_staged_s"] < res["staged_s"]  # no spawn and imports per stage
    assert res["warm_staged_s"] < res["warm_first_s"]  # iteration 2 takes its models from memory
    assert res["warm_mode"] == "async" and res["warm_tail_s"] >= 0  # the last background commits, after the stages
    assert res["warm_ratio_vs_work"] == pytest.approx(res["warm_staged_s"] / res["monolithic_work_s"], rel=0.01)
    st, warm = res["stages"], res["warm_stages"]
    for s in ("rollout", "update", "export"):
        assert st[s]["launch_to_worker_s"] > 0 and st[s]["wall_s"] >= st[s]["stage_s"]
        assert warm[s]["launch_to_worker_s"] < st[s]["launch_to_worker_s"]
    assert {"save_s", "export_s", "rollout_s", "update_s"} <= set(st["monolithic"])
    assert [it["iteration"] for it in res["monolithic_per_iteration"]] == [1, 2]
    assert all(it["rollout_s"] > 0 and it["update_s"] > 0 for it in res["monolithic_per_iteration"])


def test_dcp_benchmark_smoke(tmp_path):
    """Today's DCP path and ours, inline and background, saved and loaded in two folders; every load checked."""
    out = tmp_path / "d.json"
    dirs = [tmp_path / "disk", tmp_path / "other"]
    proc = subprocess.run([sys.executable, str(ROOT / "infra/bench/dcp.py"), "--smoke", "--threads", "3", "--json",
                           str(out), "--dirs", ",".join(map(str, dirs))], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| folder | path | operation | threads | stage waits s | behind s | total s | GB | GB/s | files | ok |" \
        in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    ops = [(r["path"], r["op"]) for r in rows]
    assert ops == 2 * [("old", "save inline"), ("old", "load"), ("new", "load (old ckpt)"),
                       ("old", "save background 1st"), ("new", "save inline"), ("new", "load"),
                       ("new", "save inline, no fsync"), ("new", "save inline, staged"),
                       ("new", "save background 1st"), ("new", "save background 2nd"),
                       ("new", "load (background ckpt)")]
    assert [r["dir"] for r in rows[::11]] == list(map(str, dirs))
    assert all(r["ok"] for r in rows if "load" in r["op"])
    old, new = rows[0], rows[4]
    assert (old["files"], new["files"]) == (2, 4)  # .metadata and a file per writer thread
    assert all(r["files"] == r["threads"] + 1 for r in rows if r["op"].startswith("save background 2"))
    assert abs(new["bytes"] - old["bytes"]) < 0.01 * old["bytes"] and all(r["gb_per_s"] > 0 for r in rows)
    assert [list(d.iterdir()) for d in dirs] == [[], []]  # every checkpoint deleted


def test_e2e_benchmark_smoke(tiny_kit, tmp_path):
    """infra/bench/e2e.py on CPU: a config through the real pipeline (warm pool), a report whose numbers agree with
    the committed artifacts and with each other. One config (the rollout's log-probs): its other one, `baseline`,
    is the pipeline every other test runs, and a second pool would double the test's time."""
    from safetensors.torch import load_file

    out, store = tmp_path / "e.json", tmp_path / "store"
    # the session's tiny kit, where a rerun with this --root finds its own (the smoke's kit is make_tiny's): making
    # it again cost ~5 CPU-s
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny/e2e-kit.json").write_text(json.dumps({k: tiny_kit[k] for k in ("model_dir", "train_file")}))
    proc = subprocess.run([sys.executable, str(ROOT / "infra/bench/e2e.py"), "--smoke", "--root", str(tmp_path),
                           "--store", str(store), "--keep", "--json", str(out), "--configs", "rollout_logprobs"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| config | iteration | wall s | tokens | tok/s/GPU | store GB |" in proc.stdout
    res = json.loads(out.read_text())
    assert list(res["configs"]) == ["rollout_logprobs"]
    for name, c in res["configs"].items():
        its = c["iterations"]
        assert [it["iteration"] for it in its] == [1, 2]
        for it in its:
            # tokens are the committed batch's non-pad prompt + response tokens (the last config's batch is on disk)
            if name == "rollout_logprobs":
                t = load_file(str(store / f"runs/e2e/{it['iteration']}/rollout/batch.safetensors"))
                assert it["tokens"] == int(t["prompt_mask"].sum() + t["response_mask"].sum())
                assert it["response_tokens"] == int(t["response_mask"].sum()) > 0
            assert it["samples"] == c["samples_per_iteration"] == 8
            assert it["tokens"] == it["prompt_tokens"] + it["response_tokens"]
            assert it["tok_per_s_per_gpu"] == pytest.approx(it["tokens"] / it["wall_s"] / c["gpus"], rel=0.01)
            stage_sum = sum(it["stages"][s]["wall_s"] for s in ("rollout", "update", "export"))
            assert stage_sum <= it["wall_s"] + it["pool_start_s"] + 0.05  # the stages run inside the iteration
            assert {"ref_s", "old_logp_s", "train_s", "save_s"} <= set(it["stages"]["update"])
            assert {"generate_s", "engine_setup_s"} <= set(it["stages"]["rollout"])
            assert it["store_bytes"] > 0
        assert its[0]["pool_start_s"] == 0  # the warm pool started in validate (it runs again per config)
        assert c["first"]["iterations"] == [1] and c["steady"]["iterations"] == [2]
        assert c["first"]["wall_s"] == its[0]["wall_s"] and c["steady"]["tokens"] == its[1]["tokens"]
        assert c["first_over_steady"] == pytest.approx(its[0]["wall_s"] / its[1]["wall_s"], rel=0.01)
        up = [it["stages"]["update"] for it in its]
        # (the benchmark rounds each mean and their difference to 1e-3: they may be up to 1.5e-3 apart)
        assert c["first_extra_s"]["update.train_s"] == pytest.approx(up[0]["train_s"] - up[1]["train_s"], abs=2e-3)
        assert c["store_bytes_end"] > 0
        assert its[1]["stages"]["update"]["warm_cache_hits"] == ["policy", "ref"]  # steady state: from memory
        # iteration 1 starts from the build's policy, whose weights the reference has: no reference to read
        assert [it["stages"]["update"]["ref_source"] for it in its] == ["policy", "cache"]
        # the build reserved the first update's CPU copy, and the second refills it
        assert [it["stages"]["update"]["save_copy"] for it in its] == ["reserved", "refilled"]
    assert not res["configs"]["rollout_logprobs"]["setup"]["build"]["skipped"]
    # the GPU blueprint's `auto` settings: validate's memory plan chose them (here the smoke fixes two of three)
    plan = res["configs"]["rollout_logprobs"]["setup"]["validate"]["memory_plan"]
    assert plan["chosen"] == ["fsdp.activation_checkpointing"] and plan["choices"]["rollout.micro_batch_size"] == 8
    assert plan["stages_gib"]["update"] <= plan["usable_gib"]


def _gpu_call(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "infra/bench/gpu_call.sh"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


@pytest.mark.parametrize("plan", ["next", "attention", "families", "big", "e2e", "tests"])
def test_gpu_call_commands_are_accepted_by_their_benchmarks(plan):
    """Every command a device call of infra/bench/gpu_call.sh would run is one its benchmark's argument parser accepts
    (shapes, variant names, JSON options, config names): a flag renamed here must not cost a GPU call, which cannot
    be rerun in the same session."""
    import contextlib
    import io
    import shlex

    got = _gpu_call("--print", plan)
    assert got.returncode == 0, got.stderr
    commands = [shlex.split(line) for line in got.stdout.splitlines() if line.strip()]
    assert commands
    for cmd in commands:
        assert cmd[0] == "python", cmd
        if cmd[1:3] == ["-m", "pytest"]:
            files = [a for a in cmd[3:] if a.endswith(".py")]
            assert files and all((ROOT / f).is_file() for f in files), cmd
            continue
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                benchmark_script.load(cmd[1]).parser().parse_args(cmd[2:])
            except SystemExit:
                pytest.fail(f"{shlex.join(cmd)}: {err.getvalue()}")


def test_gpu_call_refuses_a_bad_plan_and_parsers_refuse_bad_names():
    """An unknown plan exits 2 before touching the machine; the benchmarks' parsers refuse the names a typo makes."""
    got = _gpu_call("--print", "nxt")
    assert got.returncode == 2 and "unknown plan nxt" in got.stderr
    rollout, e2e = benchmark_script.load("rollout.py"), benchmark_script.load("e2e.py")
    for parser, argv in ((rollout.parser(), ["--fp8-variants", "fp8,fp8_act"]),
                         (rollout.parser(), ["--ab-inductor", "{triton.enable_pdl: true}"]),
                         (rollout.parser(), ["--ab-inductor", "[1]"]),
                         (e2e.parser(), ["--configs", "baseline,fp8_correct"])):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def _collected(*args: str) -> list[str]:
    """The test ids pytest selects with these arguments (collection only)."""
    got = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert got.returncode in (0, 5), got.stdout[-2000:] + got.stderr[-2000:]  # 5: none selected
    return [line for line in got.stdout.splitlines() if "::" in line]


def test_gpu_call_tests_plan_runs_every_triton_kernel_test():
    """The `tests` plan selects each test of tests/test_triton_kernels.py (a `-k cuda` over it selected none of
    them): for every pytest command the plan prints, that file's tests under the command's own -k."""
    import shlex

    every = _collected("tests/test_triton_kernels.py")
    assert len(every) >= 7
    selected = []
    for line in _gpu_call("--print", "tests").stdout.splitlines():
        cmd = shlex.split(line)
        if "tests/test_triton_kernels.py" not in cmd:
            continue
        k = cmd[cmd.index("-k") + 1:cmd.index("-k") + 2] if "-k" in cmd else []
        selected += _collected("tests/test_triton_kernels.py", *(["-k", *k] if k else []))
    assert sorted(selected) == sorted(every)


def test_gpu_call_e2e_plan_turns_tracking_off(tmp_path):
    """The `e2e` plan's blueprint has no tracking backend: the GPU image has no mlflow, and the blueprint's default
    backend stopped the pipeline at validate."""
    import shlex

    from verlflow.core.blueprint import load_blueprint

    e2e = benchmark_script.load("e2e.py")
    (cmd,) = [shlex.split(line) for line in _gpu_call("--print", "e2e").stdout.splitlines() if "e2e.py" in line]
    args = e2e.parser().parse_args(cmd[2:])
    kit = {"model_dir": str(ROOT / "tiny/qwen2/model"), "train_file": str(tmp_path / "train.parquet")}
    for config in args.configs.split(","):
        bp = load_blueprint(e2e.BLUEPRINT, e2e.overrides(args, kit, tmp_path / "store", config))
        assert bp.tracking.backends == [], config
