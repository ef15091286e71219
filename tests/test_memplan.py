"""The memory plan (core/checks/memplan.py): its per-term arithmetic against what a real tiny model allocates on
CPU, and how `auto` chooses (or refuses) on the cards people have, from a model folder holding only its config."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verlflow.core.blueprint import load_blueprint
from verlflow.core.checks import memplan

pytestmark = pytest.mark.stages

ROOT = Path(__file__).resolve().parents[1]
GPU_BLUEPRINT = ROOT / "blueprints/gpu-qwen2.5-1.5b.yaml"
H100, H200 = int(79.19 * 2**30), int(139.7 * 2**30)  # torch.cuda.get_device_properties().total_memory
QWEN = {  # Qwen2.5's shapes (infra/bench/rollout.py SHAPES)
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}


def config_folder(tmp_path: Path, size: str) -> Path:
    folder = tmp_path / size
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN[size]}))
    return folder


def gpu_bp(model: Path, *overrides: str):
    return load_blueprint(GPU_BLUEPRINT, [f"model.path={model}", "resources.nproc_per_node=1", *overrides])


# ------------------------------------------------------------------------------------ the terms, measured on CPU


def test_weight_gradient_and_adamw_terms_match_a_tiny_fsdp_build(tiny_kit):
    """Two gloo ranks build the tiny policy with the update's own code and take one AdamW step: each rank's bytes of
    parameters, gradients and AdamW moments are the plan's terms (full fine-tune, and LoRA: adapters only). The
    rollout's inference copy, filled from the trained policy a tensor at a time in bf16 (no second whole copy on the
    device), holds what loading the whole state dict and casting after gave."""
    base = [f"model.path={tiny_kit['model_dir']}", "resources.device=cpu", "resources.nproc_per_node=2",
            "fsdp.mixed_precision=fp32", "data.batch_size=4", "algorithm.ppo_mini_batch_size=2", "rollout.n=2",
            "algorithm.ppo_micro_batch_size_per_gpu=2"]
    cases = [base, base + ["model.lora={rank: 4, target_modules: [q_proj, v_proj]}"]]
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(ROOT / "tests/memplan_probe.py"), json.dumps(cases)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert got.returncode == 0, got.stderr[-3000:]
    measured = json.loads(got.stdout.strip().splitlines()[-1])
    for overrides, m in zip(cases, measured):
        bp = load_blueprint(None, overrides)
        shape = memplan.Shape.of(bp.model.path, bp.model.lora)
        update = memplan.terms(bp, shape, memplan._fixed(bp))["update"]
        for term, key in (("policy weights", "weights"), ("gradients", "gradients"), ("AdamW state", "adamw")):
            assert update.term(term).bytes == pytest.approx(m[key], rel=0.15), (overrides[-1], term, m)
    full, lora = measured
    assert lora["adamw"] < full["adamw"] / 10  # the adapters' moments only
    assert full["copy_equal"] and lora["copy_equal"]


def _saved_bytes_per_token(model, checkpointing: bool) -> float:
    """Bytes autograd saves for the backward per token (the slope between two lengths; parameters not counted)."""
    import torch

    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(tokens: int) -> int:
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(0, 500, (1, tokens)))
        return sum(n for ptr, n in seen.items() if ptr not in params)

    return (saved(384) - saved(128)) / 256


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_per_token_match_what_autograd_saves(checkpointing):
    """An eager Qwen2 decoder (fp32 on CPU, the hidden/intermediate ratio of the real models): the bytes per token it
    saves for the backward are the plan's eager estimate, with and without activation checkpointing (with it, the
    forward keeps each layer's inputs; the plan adds the one layer recomputed in the backward)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=256, intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=3, vocab_size=512, attn_implementation="sdpa")
    torch.manual_seed(0)
    measured = _saved_bytes_per_token(Qwen2ForCausalLM(cfg), checkpointing)
    shape = memplan.Shape(params=0, trainable=0, hidden=256, layers=3, intermediate=1536, heads=4, kv_heads=2,
                          head_dim=64, vocab=512, embed=0)
    planned = memplan.act_per_token(shape, compiled=False, checkpointing=checkpointing, cdt=4)
    if checkpointing:
        planned -= memplan.act_per_token(shape, compiled=False, checkpointing=False, cdt=4) / shape.layers
    assert planned == pytest.approx(measured, rel=0.15)


def test_parameter_count_is_the_safetensors_headers(tiny_kit):
    from safetensors import safe_open

    with safe_open(str(Path(tiny_kit["model_dir"]) / "model.safetensors"), framework="numpy") as f:
        numel = sum(f.get_tensor(k).size for k in f.keys())
    assert memplan.Shape.of(tiny_kit["model_dir"]).params == numel


# -------------------------------------------------------------------------------------------- the choice logic


def test_auto_fits_the_shipped_blueprint_on_each_card(tmp_path):
    """The shipped GPU blueprint (all three settings auto) on one H100, one H200 and 8 H100s: a plan that fits with
    headroom, whose choice is the first in the order of preference that fits (the ones before it do not)."""
    model = config_folder(tmp_path, "1.5b")
    seen = {}
    for name, capacity, gpus in (("h100", H100, 1), ("h200", H200, 1), ("8xh100", H100, 8)):
        bp = gpu_bp(model, f"resources.nproc_per_node={gpus}")
        shape = memplan.Shape.of(model)
        plan = memplan.plan(bp, shape, capacity, name)
        assert plan.fits and plan.peak <= capacity * memplan.HEADROOM
        assert plan.chosen == memplan.AUTO_FIELDS
        candidates = memplan._candidates(bp)
        earlier = candidates[:candidates.index(plan.choice)]
        assert all(max(s.peak for s in memplan.terms(bp, shape, c).values()) > plan.limit for c in earlier)
        assert plan.choice.token_budget >= memplan.seq_len(bp)  # a packed micro-batch holds a whole sample
        assert plan.choice.rows <= memplan.samples_per_rank(bp)
        seen[name] = plan.choice
    # the H200 samples in 2 waves and trains without recomputation at 28k tokens; one H100 cannot keep both (its
    # update would hold ~100 GiB) and recomputes; on 8 H100s the sharded state leaves room to train without it
    assert seen["h200"] == memplan.Choice(False, 28672, 640)
    assert seen["h100"].rows == 640
    assert seen["h100"].activation_checkpointing and not seen["8xh100"].activation_checkpointing
    assert seen["8xh100"].rows == 160  # the rank's whole share of the 1,280 samples


def test_a_setting_that_does_not_fit_is_refused_with_the_numbers_and_the_fix(tmp_path):
    model = config_folder(tmp_path, "1.5b")
    bp = gpu_bp(model, "fsdp.activation_checkpointing=false", "algorithm.ppo_max_token_len_per_gpu=32768")
    plan = memplan.plan(bp, memplan.Shape.of(model), H100, "NVIDIA H100 80GB HBM3")
    assert not plan.fits
    assert "does not fit NVIDIA H100 80GB HBM3: update needs ~" in plan.problem
    assert "activations" in plan.problem and "against 71.3 GiB usable (79.2 GiB x 90%)" in plan.problem
    # the fix: the setting that makes it fit (the budget alone cannot, at >= the longest sample)
    assert "Set fsdp.activation_checkpointing: true (or auto" in plan.problem
    assert memplan.plan(memplan.with_auto(bp), memplan.Shape.of(model), H100).fits


def test_a_model_no_setting_fits_names_the_gpus_that_would_hold_it(tmp_path):
    model = config_folder(tmp_path, "7b")
    bp = gpu_bp(model)
    plan = memplan.plan(bp, memplan.Shape.of(model), H100, "H100")
    assert not plan.fits and "No setting of fsdp.activation_checkpointing" in plan.problem
    assert re.search(r"; \d+ GPUs would hold it", plan.problem) and "model.lora" in plan.problem
    lora = gpu_bp(model, "model.lora={rank: 16}", "model.dtype=bfloat16")
    assert memplan.plan(lora, memplan.Shape.of(model, lora.model.lora), H100).fits  # 7B LoRA fits one H100


def test_resolved_sets_only_the_auto_fields(tmp_path):
    model = config_folder(tmp_path, "1.5b")
    bp = gpu_bp(model, "rollout.micro_batch_size=64")
    plan = memplan.plan(bp, memplan.Shape.of(model), H200)
    out = memplan.apply(bp, plan.choice)
    assert out.rollout.micro_batch_size == 64 and plan.choice.rows == 64
    assert out.fsdp.activation_checkpointing is False and out.algorithm.ppo_max_token_len_per_gpu == 32768
    assert memplan.auto_fields(out) == [] and bp.fsdp.activation_checkpointing == "auto"
    table = plan.table()
    assert "KV cache" in table and "activations" in table and "update" in table


def test_ppo_max_token_len_auto_needs_packed_micro_batches():
    with pytest.raises(Exception, match="use_remove_padding"):
        load_blueprint(None, ["algorithm.ppo_max_token_len_per_gpu=auto"])


# ------------------------------------------------------------------------------------------- out of memory


def _oom_message(bp, stage="update", phase=None, oom_retry=False) -> str:
    """The error a stage (memplan.watched, as run_job wraps it) makes of an OOM on its micro-batch of 31,234 tokens."""
    from types import SimpleNamespace

    import torch

    job = SimpleNamespace(name=f"{stage}[3]", stage=stage, blueprint=bp, inputs={"build": "b", "policy": "u2"},
                          phase=phase, oom_retry=oom_retry)
    resolved = memplan.resolved(bp, torch.device("cpu"))
    if oom_retry:
        resolved, _ = memplan.at_half(resolved, stage, phase)
    ctx = SimpleNamespace(job=job, bp=resolved, rank=1, device=torch.device("cpu"))
    with pytest.raises(memplan.DeviceOutOfMemory) as got:
        with memplan.watched(ctx):
            memplan.note(micro_batch_tokens=31234, samples=30)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 532.00 MiB. GPU 0 has ...")
    return str(got.value)


def test_out_of_memory_names_the_stage_work_card_and_setting_and_is_classified_oom(tiny_kit):
    """An OOM inside a stage (the stage worker wraps its run in memplan.watched) becomes one paragraph: the stage,
    the micro-batch's tokens (the forward notes each one), the card, the plan's peak and each setting that lowers
    it with its value now and one to try, then whether the runner runs it again at half (resources.oom_retry); the
    launcher's diagnosis classifies it OOM and shows it without the traceback."""
    from verlflow.core.orchestrate.diagnose import FailureKind, StageFailure, classify

    kit = [f"model.path={tiny_kit['model_dir']}", "resources.device=cpu", "data.max_prompt_length=1024",
           "rollout.max_new_tokens=1024", "algorithm.use_remove_padding=true"]
    bp = load_blueprint(None, [*kit, "algorithm.ppo_max_token_len_per_gpu=auto"])
    msg = _oom_message(bp)
    budget = memplan.resolved(bp, "cpu").algorithm.ppo_max_token_len_per_gpu
    assert msg.startswith("out of memory in update[3] on rank 1, cpu (")
    assert "while working on micro batch tokens 31,234, samples 30" in msg
    assert "the memory plan predicted" in msg and "GiB for update" in msg
    assert (f"Lower it with algorithm.ppo_max_token_len_per_gpu (now {budget} (auto's choice); try {budget // 2}) "
            "or fsdp.activation_checkpointing (now false; try true).") in msg
    assert f"{memplan.RETRYING}algorithm.ppo_max_token_len_per_gpu: {budget // 2}." in msg
    assert "torch: CUDA out of memory. Tried to allocate 532.00 MiB" in msg
    line = f"DeviceOutOfMemory: {msg}"
    assert classify(line) is FailureKind.OOM
    shown = str(StageFailure(classify(line), f"rank 1 failed (exit code 1): {line}", traceback="Traceback ..."))
    assert "Traceback" not in shown and "[OOM, not retryable]" in shown

    # the runner's retry says so; a budget at one whole sample (2,048 tokens) has no half; the switch off: no retry
    retried = _oom_message(bp, oom_retry=True)
    assert f"(now {budget // 2}; try {budget // 4})" in retried and memplan.RETRYING not in retried
    assert "This was the one retry, at half the micro-batch (resources.oom_retry)." in retried
    floor = _oom_message(load_blueprint(None, [*kit, "algorithm.ppo_max_token_len_per_gpu=2048"]))
    assert "(now 2048; its smallest)" in floor and memplan.RETRYING not in floor
    assert "No retry: algorithm.ppo_max_token_len_per_gpu is at its smallest (2048)." in floor
    off = _oom_message(load_blueprint(None, [*kit, "algorithm.ppo_max_token_len_per_gpu=4096",
                                             "resources.oom_retry=false"]))
    assert "(now 4096; try 2048)" in off and memplan.RETRYING not in off and "retry" not in off
    padded = _oom_message(load_blueprint(None, [*kit, "algorithm.use_remove_padding=false",
                                                "fsdp.activation_checkpointing=true"]))
    assert "Lower it with algorithm.ppo_micro_batch_size_per_gpu (now 4; try 2). " in padded
    assert f"{memplan.RETRYING}algorithm.ppo_micro_batch_size_per_gpu: 2." in padded
    rollout = _oom_message(load_blueprint(None, [*kit, "rollout.micro_batch_size=64"]), stage="rollout")
    assert "Lower it with rollout.micro_batch_size (now 64; try 32). torch:" in rollout


def test_the_runner_retries_an_oom_once_where_the_rank_says_half_can_help(tmp_path):
    """run_stage runs a stage again (at half: JobSpec.oom_retry) only after an OOM whose message says it will
    (memplan.RETRYING), once, on one torchrun job of its own, with its inputs committed."""
    from types import SimpleNamespace

    from verlflow.core.orchestrate.diagnose import FailureKind, StageFailure
    from verlflow.core.orchestrate.runner import _retries_oom

    bp = load_blueprint(None, [f"storage.uri={tmp_path}"])
    committed = {"runs/r/1/rollout": {"key": "k"}}
    ctx = SimpleNamespace(bp=bp, store=SimpleNamespace(read_manifest=committed.get))
    run = SimpleNamespace(stage="update", inputs={"rollout": "runs/r/1/rollout"}, oom_retry=False)
    says = StageFailure(FailureKind.OOM, f"rank 1 failed: DeviceOutOfMemory: ... {memplan.RETRYING}x: 2.")
    assert _retries_oom(ctx, run, says)
    assert not _retries_oom(ctx, run, StageFailure(FailureKind.OOM, "rank 1 failed: DeviceOutOfMemory: ..."))
    assert not _retries_oom(ctx, run, StageFailure(FailureKind.USER_ERROR, f"... {memplan.RETRYING}x: 2."))
    assert not _retries_oom(ctx, SimpleNamespace(**{**vars(run), "oom_retry": True}), says)  # once
    assert not _retries_oom(ctx, SimpleNamespace(**{**vars(run), "inputs": {"rollout": "runs/r/1/gone"}}), says)
    multi = bp.model_copy(update={"resources": bp.resources.model_copy(update={"nnodes": 2})})
    assert not _retries_oom(SimpleNamespace(**{**vars(ctx), "bp": multi}), run, says)


def test_a_retry_halves_what_sizes_the_micro_batches_down_to_its_floor(tiny_kit):
    """memplan.at_half: the update's packed budget (and its forward-only one) down to one whole sample, its samples
    per micro-batch (padded, or at the default budget) down to one; a phase's rows per micro-batch."""
    base = [f"model.path={tiny_kit['model_dir']}", "data.max_prompt_length=64", "rollout.max_new_tokens=8"]
    packed = load_blueprint(None, [*base, "algorithm.use_remove_padding=true",
                                   "algorithm.ppo_max_token_len_per_gpu=100",
                                   "algorithm.log_prob_max_token_len_per_gpu=1000"])
    half, recorded = memplan.at_half(packed, "update", None)
    assert recorded == {"oom_retries": 1, "ppo_max_token_len_per_gpu": 72}  # 50 is below a 72-token sample
    assert half.algorithm.log_prob_max_token_len_per_gpu == 500 and packed.algorithm.ppo_max_token_len_per_gpu == 100
    assert memplan.micro_batch("update", half).half is None  # at its floor: no second halving
    default = load_blueprint(None, [*base, "algorithm.use_remove_padding=true", "data.batch_size=10",
                                    "algorithm.ppo_mini_batch_size=5", "rollout.n=2",
                                    "algorithm.ppo_micro_batch_size_per_gpu=5"])
    # 5 samples a rank, in micro-batches of a divisor of 5
    assert memplan.at_half(default, "update", None)[1] == {"oom_retries": 1, "ppo_micro_batch_size_per_gpu": 1}
    assert memplan.micro_batch("update", memplan.at_half(default, "update", None)[0]).half is None


def test_async_lanes_are_sized_by_their_own_ranks(tmp_path):
    """rollout.async on 8 GPUs, 4 of them sampling: the update's state is sharded over its 4 GPUs, not 8, and each
    sampling GPU holds twice the 8 GPUs' share of the rows: a plan by the node's world would promise room that is
    not there."""
    model = config_folder(tmp_path, "1.5b")
    shape = memplan.Shape.of(model)
    lanes = gpu_bp(model, "resources.nproc_per_node=8", "rollout.async.staleness=1", "rollout.async.devices=4",
                   "algorithm.old_logprobs=recompute", "algorithm.rollout_correction=true",
                   "rollout.micro_batch_size=640")
    whole = gpu_bp(model, "resources.nproc_per_node=4", "algorithm.old_logprobs=recompute",
                   "rollout.micro_batch_size=640")
    assert memplan.lane_worlds(lanes) == (4, 4)
    choice = memplan.Choice(True, 16384, 640)
    got, want = memplan.terms(lanes, shape, choice)["update"], memplan.terms(whole, shape, choice)["update"]
    for name in ("policy weights", "AdamW state", "gradients", "reference"):
        assert got.term(name).bytes == want.term(name).bytes, name
    assert memplan.samples_per_rank(lanes) == 1280 // 4
    assert memplan.mini_batch_tokens(lanes) == memplan.mini_batch_tokens(whole)
