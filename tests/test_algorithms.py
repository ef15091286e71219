"""verl's estimators and policy losses by name, DAPO's dynamic sampling, remax's greedy baseline, LR schedules.

The names come from verl's registries at test time: a verl that adds one fails the table test until verlflow
either runs it or refuses it at validate.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from tinybp import tiny_blueprint

from verlflow.core import algos
from verlflow.core.blueprint import Blueprint, load_blueprint
from verlflow.core.errors import BlueprintError
from verlflow.core.orchestrate.launcher import LaunchSpec, launch
from verlflow.core.orchestrate.runner import RunContext, run_stage

pytestmark = pytest.mark.stages

QUIET = dict(on_line=lambda line: None)


def registered() -> tuple[set, set]:
    from verl.trainer.ppo import core_algos

    return ({str(getattr(n, "value", n)) for n in core_algos.ADV_ESTIMATOR_REGISTRY},
            set(core_algos.POLICY_LOSS_REGISTRY))


# How each registered name is covered. "probe": one update on the reference batch (2 ranks, FSDP2) with these
# algorithm fields; "pipeline": a test below runs it through the rollout and update stages; "refused": the blueprint
# refuses it (until its inputs exist) with a message naming the field.
ESTIMATORS = {
    **{n: ("probe", {}) for n in ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized",
                                  "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg",
                                  "optimal_token_baseline", "tir_optimal_token_baseline")},
    "remax": ("pipeline", "test_remax_rollout_samples_a_greedy_baseline_and_the_update_subtracts_it"),
    "gae": ("pipeline", "test_stages.py::test_learning_beats_random_variation[gae]"),
    "gdpo": ("refused", "reward components"),
}
LOSSES = {
    **{n: ("probe", {}) for n in ("vanilla", "gspo", "sapo", "clip_cov", "kl_cov", "gpg", "geo_mean", "cispo",
                                  "dppo_tv", "dppo_kl")},
    "dro": ("probe", {"dro_beta": 0.1}),
    "bypass_mode": ("probe", {"old_logprobs": "rollout"}),
}


def test_the_blueprint_lists_every_name_verls_registries_hold():
    estimators, losses = registered()
    assert set(algos.ADV_ESTIMATORS) == estimators and set(ESTIMATORS) == estimators, estimators
    assert set(algos.POLICY_LOSSES) == losses and set(LOSSES) == losses, losses
    assert algos.registry_drift() == []
    out = subprocess.run([sys.executable, "-m", "verlflow.flows.cli", "schema"], capture_output=True,
                         text=True, check=True).stdout
    props = json.loads(out)["$defs"]["AlgorithmSpec"]["properties"]
    assert set(props["adv_estimator"]["enum"]) == estimators and set(props["policy_loss"]["enum"]) == losses
    with pytest.raises(BlueprintError, match=r"algorithm\.adv_estimator.*grpo_passk"):
        load_blueprint(None, ["algorithm.adv_estimator=grpo_pass"])  # the list of names comes with the error


def test_every_estimator_and_loss_runs_an_update_on_two_ranks(reference, tmp_path):
    combos = [{"adv_estimator": n, **o} for n, (how, o) in ESTIMATORS.items() if how == "probe"]
    combos += [{"policy_loss": n, **o} for n, (how, o) in LOSSES.items() if how == "probe"]
    runs = reference.root / "runs" / reference.run_id
    job = {"blueprint": reference.bp.model_dump(mode="json"), "meta": str(runs / "init/build/hf_meta"),
           "ckpt": str(runs / "1/update/policy"), "batch": str(runs / "2/rollout"), "combos": combos,
           "out": str(tmp_path / "out.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    launch(LaunchSpec("verlflow.core.testing.algo_probe", [str(tmp_path / "job.json")], nproc_per_node=2,
                      timeout_s=300), **QUIET)
    results = json.loads((tmp_path / "out.json").read_text())
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    adv = {r["adv_estimator"]: r["adv_abs_mean"] for r in results if "adv_estimator" in r}
    assert len(set(adv.values())) >= 5, adv  # the estimators differ: each name reached its own function
    assert all(r["steps"] == 2 and r["grad_norm"] > 0 for r in results), results


def test_names_whose_inputs_are_missing_are_refused_naming_the_field(tiny_kit, tmp_path):
    cases = [(["algorithm.adv_estimator=gdpo"], r"algorithm.adv_estimator=gdpo.*reward components"),
             (["algorithm.policy_loss=dro"], r"algorithm.dro_beta"),
             (["algorithm.policy_loss=bypass_mode"], r"algorithm.old_logprobs=rollout"),
             (["algorithm.adv_estimator=optimal_token_baseline", "algorithm.old_logprobs=rollout"],
              r"algorithm.old_logprobs=recompute"),
             (["algorithm.adv_estimator=rloo", "rollout.n=1"], r"rollout.n >= 2")]
    for overrides, message in cases:
        with pytest.raises(BlueprintError, match=message):
            tiny_blueprint(tiny_kit, tmp_path, *overrides)


@pytest.mark.parametrize("loss,fields", [
    ("vanilla", {"clip_ratio_high": 0.28}),
    ("gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}),
    ("clip_cov", {"clip_cov_ratio": 0.2, "clip_cov_lb": -5.0, "clip_cov_ub": 5.0})])
def test_the_update_loss_equals_verls_function_called_directly(loss, fields):
    """Our wiring (config knobs, aggregation, global token counts) against verl's loss with a config built here."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    from verlflow.core.ml import ppo
    from verlflow.core.ml.placement import Placement
    from verlflow.core.stages.update import ppo_spec

    bp = Blueprint.model_validate({"algorithm": {"policy_loss": loss, "use_kl_loss": False, **fields},
                                   "resources": {"nproc_per_node": 1}})
    g = torch.Generator().manual_seed(0)
    N, R = 8, 6
    mask = (torch.rand(N, R, generator=g) > 0.2).float()
    mask[:, 0] = 1
    old = -torch.rand(N, R, generator=g) * 3
    logp = old + torch.randn(N, R, generator=g) * 0.3
    adv = torch.randn(N, R, generator=g)
    tensors = {"response_mask": mask, "prompts": torch.zeros(N, 2, dtype=torch.long),
               "responses": torch.zeros(N, R, dtype=torch.long), "prompt_mask": torch.ones(N, 2, dtype=torch.long)}
    data = ppo.PPOBatch(tensors, 1, old, old, adv, adv)
    upd = ppo._Update(ppo_spec(bp), data, Placement(0, 1, "cpu"))
    info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": N}
    upd.cfg.global_batch_info.update(info)
    torch.manual_seed(1)  # clip_cov draws the tokens it cuts at random (torch's global generator)
    got, _ = upd._policy_loss(logp, torch.zeros(N, R), list(range(N)), info)

    a = bp.algorithm
    cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=a.ppo_mini_batch_size, rollout_n=bp.rollout.n,
                      ppo_micro_batch_size_per_gpu=4, clip_ratio_low=a.clip_ratio_low,
                      clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
                      policy_loss=PolicyLossConfig(loss_mode=loss, clip_cov_ratio=fields.get("clip_cov_ratio", 2e-4),
                                                   clip_cov_lb=fields.get("clip_cov_lb", 1.0),
                                                   clip_cov_ub=fields.get("clip_cov_ub", 5.0)))
    cfg.global_batch_info.update(info)
    torch.manual_seed(1)
    want, _ = core_algos.get_policy_loss_fn(loss)(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                                                  loss_agg_mode=a.loss_agg_mode, config=cfg)
    assert torch.allclose(got, want, rtol=0, atol=1e-7), (float(got), float(want))


def test_a_critics_training_is_reported_under_verls_names(tiny_kit, tmp_path):
    """adv_estimator gae: the update's metrics (what MLflow, TensorBoard, compare and promote.metric read) carry the
    critic's vf_loss, vf_clipfrac, vpred_mean (verl's compute_value_loss and its critic/* names) and the values'
    explained variance (verl's compute_data_metrics), on one rank of the tiny kit's real models."""
    from verl.trainer.ppo import core_algos
    from verl.utils.torch_functional import masked_mean

    from verlflow.core.metrics import CRITIC_KEYS, available, flat
    from verlflow.core.ml import model as M, ppo
    from verlflow.core.ml.optim import make_optimizer
    from verlflow.core.ml.placement import Placement
    from verlflow.core.stages.update import ppo_spec

    bp = tiny_blueprint(tiny_kit, tmp_path, "resources.nproc_per_node=1", "algorithm.adv_estimator=gae",
                        "data.batch_size=2", "rollout.n=4", "algorithm.ppo_mini_batch_size=2",
                        "algorithm.ppo_micro_batch_size_per_gpu=8", "promote.metric=update/vf_explained_var")
    torch.manual_seed(0)
    policy, critic = (M.build_module(bp.model.path, bp.model, critic=c) for c in (False, True))
    models = ppo.Models(ppo.Trainee(policy, make_optimizer(policy, bp.algorithm.optim)),
                        ppo.Trainee(critic, make_optimizer(critic, bp.algorithm.critic_optim)))
    g = torch.Generator().manual_seed(0)
    N, P, R = 8, 5, 6
    mask = torch.ones(N, R, dtype=torch.long)
    mask[::2, 4:] = 0
    batch = {"prompts": torch.randint(3, 60, (N, P), generator=g), "prompt_mask": torch.ones(N, P, dtype=torch.long),
             "responses": torch.randint(3, 60, (N, R), generator=g), "response_mask": mask,
             "scores": torch.rand(N, generator=g), "group": torch.arange(N) // 4}
    at = Placement(0, 1, "cpu")
    spec = ppo_spec(bp)
    old = ppo.score_all(policy, batch, spec, at)
    values = ppo.score_all(critic, batch, spec, at, critic=True)
    data, adv_metrics = ppo.prepare(bp.algorithm, batch, old, old, values, iteration=1)
    metrics = {**adv_metrics, **ppo.update_metrics(ppo.train(spec, models, data, at))}

    m = mask.float()  # one micro-batch: the critic's first forward is `values` again
    info = {"dp_size": 1, "batch_num_tokens": int(m.sum()), "global_batch_size": N}
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(values, data.ret, values, m, bp.algorithm.cliprange_value,
                                                         bp.algorithm.loss_agg_mode, **info)
    ret, val = data.ret[m.bool()], values[m.bool()]
    want = {"vf_loss": float(vf_loss), "vf_clipfrac": float(vf_clipfrac), "vpred_mean": float(masked_mean(values, m)),
            "vf_explained_var": float(1 - torch.var(ret - val) / (torch.var(ret) + 1e-5))}
    assert {k: metrics[k] for k in want} == pytest.approx(want, abs=1e-5), metrics
    assert metrics["vf_loss"] > 0 and metrics["critic_grad_norm"] > 0
    named = flat("update", metrics)
    assert {f"update/{k}" for k in CRITIC_KEYS} <= set(named) & set(available(bp)), named


@pytest.fixture
def half_uniform_reward(tmp_path, monkeypatch):
    """A reward module: prompts whose answer starts with an even digit score 0 whatever the response (uniform
    groups); the others score by response length (samples differ)."""
    (tmp_path / "halfuniform.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if int(str(ground_truth)[0]) % 2 == 0:\n"
        "        return 0.0\n"
        "    return (len(solution_str) % 7) / 7\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "halfuniform:score"


def _rollout(bp, run_id: str) -> tuple[dict, dict]:
    from verlflow.core.ml.rollout import load_batch

    run_stage(RunContext(bp, run_id, **QUIET), "build", "init", {})
    build = f"runs/{run_id}/init/build"
    res = run_stage(RunContext(bp, run_id, **QUIET), "rollout", 1, {"build": build, "policy": build})
    folder = bp.storage.uri.removeprefix("file://") + f"/runs/{run_id}/1/rollout"
    return load_batch(__import__("pathlib").Path(folder)), res.manifest["metrics"]


@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_dynamic_sampling_keeps_informative_groups_and_fills_the_batch(tiny_kit, tmp_path, half_uniform_reward):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", "reward.function=" + half_uniform_reward,
                        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=6",
                        "resources.nproc_per_node=1", "data.batch_size=4")
    batch, m = _rollout(bp, "dyn")
    groups = batch["group"].tolist()
    assert sorted(set(groups)) == [0, 1, 2, 3] and len(groups) == 16  # the batch is full: 4 groups x 4 samples
    for g in range(4):
        scores = batch["scores"][batch["group"] == g]
        assert len(set(scores.tolist())) > 1, (g, scores)  # every kept group is informative
    assert m["filter_groups/rounds"] >= 2 and m["filter_groups/uniform_groups"] >= 1, m
    assert m["filter_groups/filled_with_uniform"] == 0 and m["prompts_consumed"] == 4 * m["filter_groups/rounds"]
    assert int(batch["prompts_consumed"][0]) == m["prompts_consumed"]

    # The next rollout starts after every prompt the rounds took: the update moves the data cursor that far.
    build = "runs/dyn/init/build"
    run_stage(RunContext(bp, "dyn", **QUIET), "update", 1, {"build": build, "policy": build,
                                                           "rollout": "runs/dyn/1/rollout"})
    from verlflow.core.ml import checkpoint

    state = checkpoint.read_state(__import__("pathlib").Path(bp.storage.uri.removeprefix("file://"))
                                  / "runs/dyn/1/update/policy")
    assert state["data_cursor"] == m["prompts_consumed"]


@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_dynamic_sampling_fills_with_uniform_groups_when_rounds_run_out(tiny_kit, tmp_path, half_uniform_reward):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", "reward.function=" + half_uniform_reward,
                        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                        "resources.nproc_per_node=1", "data.batch_size=4")
    batch, m = _rollout(bp, "fill")
    assert len(batch["scores"]) == 16 and m["filter_groups/rounds"] == 1
    uniform = sum(len(set(batch["scores"][batch["group"] == g].tolist())) == 1 for g in range(4))
    assert uniform == m["filter_groups/filled_with_uniform"] == m["filter_groups/uniform_groups"] >= 1, m


@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_remax_rollout_samples_a_greedy_baseline_and_the_update_subtracts_it(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", "algorithm.adv_estimator=remax")  # 2 ranks share the greedy pass
    batch, m = _rollout(bp, "remax")
    base = batch["reward_baselines"]
    for g in batch["group"].unique():  # one greedy response per prompt: one baseline per group
        assert len(set(base[batch["group"] == g].tolist())) == 1
    assert m["remax/baseline_reward_mean"] == pytest.approx(float(base.view(-1, bp.rollout.n)[:, 0].mean()), abs=1e-6)
    from verlflow.core.ml import ppo

    zeros = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    adv, _, _ = ppo.advantages(bp.algorithm, batch, zeros, zeros)
    last = batch["response_mask"].sum(1) - 1
    first = adv[:, 0]  # outcome reward: every token's return is the score
    assert torch.allclose(first, batch["scores"] - base, atol=1e-6), (first, batch["scores"] - base)
    assert last.min() >= 0
    build = "runs/remax/init/build"
    res = run_stage(RunContext(bp, "remax", **QUIET), "update", 1, {"build": build, "policy": build,
                                                                   "rollout": "runs/remax/1/rollout"})
    assert res.manifest["metrics"]["grad_norm"] > 0


@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_cosine_schedule_follows_verl_across_a_rerun_at_another_world_size(reference, tmp_path):
    """update[1] at 2 ranks, then update[2] from it at 1 rank: every optimizer step's lr is verl's cosine schedule
    (warm-up 1 step, floor 0.1) at that step of the run, read from the checkpoint's step count."""
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    bp, root = reference.copy(tmp_path)
    bp = bp.model_copy(update={"algorithm": bp.algorithm.model_copy(update={
        "lr_scheduler_type": "cosine", "lr_warmup_steps": 1, "min_lr_ratio": 0.1})})
    src = f"runs/{reference.run_id}"
    lrs = []
    for it, world, policy in ((1, 2, f"{src}/init/build"), (2, 1, "runs/lr/1/update")):
        bp_w = bp.model_copy(update={"resources": bp.resources.model_copy(update={"nproc_per_node": world})})
        res = run_stage(RunContext(bp_w, "lr", **QUIET), "update", it,
                        {"build": f"{src}/init/build", "policy": policy, "rollout": f"{src}/{it}/rollout"})
        lrs += [row["lr"] for row in res.manifest["metrics"]["mini_batches"]]
    total = bp.optimizer_steps()
    assert total == 4 and len(lrs) == total
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=bp.algorithm.lr)
    sched = get_cosine_schedule_with_warmup(opt, 1, total, min_lr_ratio=0.1)
    want = []
    for _ in range(total):  # verl's loop: the step runs at the scheduler's lr, then the scheduler steps
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx(want, rel=1e-9), (lrs, want)
    assert want[0] == 0.0 and want[1] == bp.algorithm.lr  # the warm-up starts at 0


@pytest.mark.parametrize("name", ["tiny-dapo", "tiny-gspo"])
@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_the_recipe_blueprints_run_on_the_tiny_kit(tiny_kit, tmp_path, name):
    """blueprints/tiny-dapo.yaml and tiny-gspo.yaml, one iteration on the kit (no eval: its speed is not the point)."""
    from pathlib import Path

    from verlflow.core.orchestrate.pipeline import run_pipeline

    repo = Path(__file__).resolve().parent.parent
    bp = load_blueprint(repo / f"blueprints/{name}.yaml", [
        f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
        f"storage.uri={tmp_path / 'store'}", "iterations=1", "eval.files=[]", "promote.metric=null",
        "tracking.backends=[]"])
    results = run_pipeline(bp, "recipe", **QUIET)
    update = next(r.manifest for r in results if r.manifest["stage"] == "update")
    assert update["metrics"]["grad_norm"] > 0
    if name == "tiny-dapo":
        rollout = next(r.manifest for r in results if r.manifest["stage"] == "rollout")
        assert rollout["metrics"]["filter_groups/rounds"] >= 1
        # a random-init model runs to the 12-token limit: the overlong buffer (last 4 tokens) penalises it
        assert rollout["metrics"]["overlong/penalised_frac"] > 0 > rollout["metrics"]["overlong/penalty_mean"]


def test_overlong_penalty_equals_verls_dapo_reward_manager():
    """reward.overlong_buffer against verl's own DAPORewardManager on the same responses, every length 1..12."""
    from types import SimpleNamespace

    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    from verlflow.core.ml.rewards import overlong_penalty

    max_len, buf, factor, base = 12, 4, 0.5, 0.25
    lens = list(range(1, max_len + 1))
    N, P = len(lens), 3
    responses = torch.full((N, max_len), 7, dtype=torch.long)
    attention = torch.cat([torch.ones(N, P, dtype=torch.long),
                           (torch.arange(max_len)[None] < torch.tensor(lens)[:, None]).long()], dim=1)
    data = DataProto.from_dict(
        tensors={"prompts": torch.ones(N, P, dtype=torch.long), "responses": responses, "attention_mask": attention},
        non_tensors={"reward_model": [{"ground_truth": "7"}] * N, "data_source": ["tiny"] * N,
                     "extra_info": [{} for _ in range(N)]})
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "x" * len(ids), eos_token="</s>")
    manager = DAPORewardManager(tok, 0, compute_score=lambda **kw: base, max_resp_len=max_len,
                                overlong_buffer_cfg=SimpleNamespace(enable=True, len=buf, penalty_factor=factor,
                                                                    log=False))
    verl_rewards = manager(data)[torch.arange(N), torch.tensor(lens) - 1].tolist()
    ours = [base + overlong_penalty(n, max_len, buf, factor) for n in lens]
    assert ours == pytest.approx(verl_rewards, abs=1e-7), (ours, verl_rewards)
    assert ours[:max_len - buf] == [base] * (max_len - buf) and ours[-1] == pytest.approx(base - factor)
    with pytest.raises(BlueprintError, match=r"reward.overlong_buffer.len = 20 must be at most rollout.max_new"):
        load_blueprint(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=20"])


@pytest.fixture
def reward_parts(tiny_kit, tmp_path, monkeypatch):
    """A tiny random-init Qwen2ForSequenceClassification folder (one label) with the kit's tokenizer, and a batched
    reward module that scores tiny_digits and records the size of every call."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_kit["model_dir"], num_labels=1)
    cfg.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(cfg)
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_kit["model_dir"]).save_pretrained(rm_dir)
    calls = tmp_path / "calls.txt"
    (tmp_path / "batchreward.py").write_text(
        "from verlflow.core.ml.rewards import tiny_digits\n"
        "def score(data_sources, solution_strs, ground_truths, extra_info=None):\n"
        f"    open({str(calls)!r}, 'a').write(f'{{len(solution_strs)}}\\n')\n"
        "    return [tiny_digits(d, s, g) for d, s, g in zip(data_sources, solution_strs, ground_truths)]\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(tmp_path))
    return rm_dir, calls


@pytest.mark.slow(reason="covered by test_algorithms::test_every_estimator_and_loss_runs_an_update_on_two_ranks")
def test_a_reward_model_adds_to_a_batched_rule_reward_deterministically(tiny_kit, tmp_path, reward_parts):
    """reward.model (a random-init sequence classifier) + 0.5 x ... : each sample's score is the batched rule reward
    plus half the model's score of that prompt + response read alone (no padding), and a second run scores the same."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verlflow.core.ml.data import load_prompts
    from verlflow.core.ml.rewards import tiny_digits

    rm_dir, calls = reward_parts
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", "reward.function=batchreward:score", "reward.batched=true",
                        f"reward.model.path={rm_dir}", "reward.combine.model=0.5", "rollout.micro_batch_size=3",
                        "resources.nproc_per_node=1")
    _rollout(bp, "rm1")
    build = "runs/rm1/init/build"  # a second rollout of the same policy, as another run
    run_stage(RunContext(bp, "rm2", **QUIET), "rollout", 1, {"build": build, "policy": build})
    root = tmp_path / "store" / "runs"
    one, two = (pq.read_table(root / f"{r}/1/rollout/samples.parquet").to_pylist() for r in ("rm1", "rm2"))
    assert [s["score"] for s in one] == [s["score"] for s in two]  # deterministic
    assert calls.read_text().split() == ["3", "3", "3", "3", "3", "1"] * 2  # 16 samples, 3 at a time, per run

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    prompts = load_prompts(bp.data.train_files, bp.data.prompt_key)
    by_row = dict(zip(prompts.rows, prompts.messages))
    for s in one:
        text = tok.apply_chat_template(by_row[s["row"]] + [{"role": "assistant", "content": s["response"]}],
                                       tokenize=False)
        with torch.no_grad():
            learned = float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
        want = tiny_digits("", s["response"], s["ground_truth"]) + 0.5 * learned
        assert s["score"] == pytest.approx(want, abs=1e-5), (s, want)


def test_bad_reward_model_and_weights_are_refused_naming_the_field(tiny_kit, tmp_path):
    (tmp_path / "notrm").mkdir()
    (tmp_path / "notrm/config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", f"reward.model.path={tmp_path / 'notrm'}")
    from verlflow.core.checks.inputs import missing_inputs

    problems = " ".join(missing_inputs(bp))
    assert "reward.model.path" in problems and "Qwen2ForCausalLM with 2 labels" in problems, problems
    with pytest.raises(BlueprintError, match=r"reward.combine gives weight 0 to everything"):
        tiny_blueprint(tiny_kit, tmp_path, "reward.combine.function=0")
    with pytest.raises(BlueprintError, match=r"reward.model.path=s3://b/rm: the reward model must be a local"):
        tiny_blueprint(tiny_kit, tmp_path, "reward.model.path=s3://b/rm")
