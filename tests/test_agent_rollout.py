"""Agent rollouts (rollout.mode=agent; core/agent/loop.py, core/ml/agent_rollout.py): token-exact trajectories, the
observations' zero share of the update's gradient, whole-trajectory GRPO advantages, tool timeouts and failing
environments, and the hf engine end to end on the tiny model, in-process."""

import copy
import random
import time
from pathlib import Path

import pytest
import torch
from tinybp import tiny_blueprint

from verlflow.core.agent.env import EnvContext, Environment, Step
from verlflow.core.agent.loop import AgentLoop, Limits
from verlflow.core.agent.registry import register_environment
from verlflow.core.blueprint.sections import AgentSpec, AlgorithmSpec, RewardSpec, RolloutSpec
from verlflow.core.metrics import AGENT_KEYS
from verlflow.core.ml import model as M, ppo
from verlflow.core.ml.agent_rollout import check_failures, generate_agent_share
from verlflow.core.ml.data import Prompts
from verlflow.core.ml.forward import Rows, forward
from verlflow.core.ml.placement import Placement
from verlflow.core.ml.rollout import load_batch, save_batch
from verlflow.core.stages.update import ppo_spec

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

# The tiny kit's tokens, with tools (a system line of their names) and tool results (user turns saying "tool:").
TOOL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- '<|system|>tools: ' + (tools | map(attribute='function') | map(attribute='name') "
    "| join(', ')) + eos_token -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}{{- '<|user|>tool: ' + message['content'] + eos_token -}}"
    "{%- else -%}{{- '<|' + message['role'] + '|>' + message['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks a word up.",
                                         "parameters": {"type": "object", "properties": {}}}}


@register_environment("test_scripted", overwrite=True)
class ScriptedEnv(Environment):
    """Each step answers "result <turn>", with the row's extra_info plan: `rewards` (one per turn; done after the
    last), `sleep` {turn: seconds}, `raise_at` (the turn whose step raises)."""

    def reset(self, row):
        self.plan, self.turn, self.texts, self.calls_at_once, self.running = row["extra_info"], 0, [], 0, 0
        return row["prompt"]

    def tools(self):
        return [TOOL]

    def step(self, model_text):
        self.running += 1
        self.calls_at_once = max(self.calls_at_once, self.running)
        try:
            k, self.turn = self.turn, self.turn + 1
            self.texts.append(model_text)
            if self.plan.get("raise_at") == k:
                raise ValueError("the tool exploded")
            time.sleep(self.plan.get("sleep", {}).get(k, 0.0))
            rewards = self.plan.get("rewards", [0.0])
            return Step(f"result {k}", reward=rewards[k], done=k + 1 >= len(rewards), info={"tool_calls": 1})
        finally:
            self.running -= 1


@pytest.fixture(scope="module")
def tok(tiny_kit):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    t.chat_template = TOOL_TEMPLATE
    return t


@pytest.fixture(scope="module")
def model(tiny_kit):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"], dtype=torch.float32).eval()


def rows(plans: list[dict]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Look up word {i}."}], "extra_info": plan}
            for i, plan in enumerate(plans)]


def agent_loop(tok, tmp_path, plans, *, timeout=5.0, max_turns=4, max_total=200, envs=None):
    ctx = EnvContext(tool_timeout_s=timeout, reward_fn=None, scratch=Path(tmp_path))
    envs = [] if envs is None else envs

    def make():
        envs.append(ScriptedEnv({}, ctx))
        return envs[-1]

    return AgentLoop(tok, make, rows(plans), Limits(max_turns, max_total, 8, timeout), ordered=True,
                     max_prompt_len=100)


def drive(loop, answer, limit: int = 3, within: float = 10.0):
    """A scripted engine: each ready turn gets `answer(turn)` (its tokens), log-prob -0.5 each."""
    end = time.monotonic() + within
    while loop.wait(timeout=1.0):
        assert time.monotonic() < end, "the agent loop hangs"
        for turn in loop.ready(limit):
            tokens = answer(turn)
            loop.done(turn, tokens, [-0.5] * len(tokens))
    return loop.records()


def agent_samples(trajs) -> list[dict]:
    """The sample dicts generate_agent_share makes of trajectories (one prompt group)."""
    return [{"sample": t.key, "group": 0, "row": t.key, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
             "logprobs": t.logprobs, "response": "", "ground_truth": "", "score": t.score, "gen_s": 1.0,
             "env_wait_s": 0.0, "agent_rank": 0, "engine_turns": 0, "turns_resumed": 0, "loss_mask": t.loss_mask, "turn_rewards": t.turn_rewards,
             "agent": {"turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                       "tool_timeouts": t.tool_timeouts, "truncated": t.truncated, "failed": t.failed,
                       "env_s": t.env_s}} for t in trajs]


def split_word(tok) -> tuple[list[int], list[int]]:
    """Ids of a word sampled letter by letter, and what encoding its text gives (one merged token)."""
    for token in sorted(tok.get_vocab()):
        if len(token) >= 3 and token.isalpha() and token.islower():
            letters = tok.convert_tokens_to_ids(list(token))
            if tok.unk_token_id not in letters:
                return letters, tok.encode(tok.decode(letters), add_special_tokens=False)
    raise AssertionError("no merged word in the tiny vocabulary")


# ------------------------------------------------------------------------------------------- token-exact


def test_trajectories_hold_the_sampled_ids_and_the_templates_observation_tokens(tok, tmp_path):
    letters, reencoded = split_word(tok)
    assert reencoded != letters  # a decode -> encode round trip would change this turn's tokens
    eos = tok.eos_token_id
    envs = []
    loop = agent_loop(tok, tmp_path, [{"rewards": [0.0, 0.0, 1.0]}], envs=envs)
    (t,) = drive(loop, lambda turn: letters + [eos])
    word = tok.decode(letters)
    assert t.turns == 3 and not t.truncated and t.score == 1.0 and envs[0].texts == [word] * 3
    model_runs = [t.response_ids[i:i + len(letters) + 1] for i, m in enumerate(t.loss_mask)
                  if m and (i == 0 or not t.loss_mask[i - 1])]
    assert model_runs == [letters + [eos]] * 3  # trained: exactly the sampled ids
    assert sum(t.loss_mask) == 3 * (len(letters) + 1) and t.logprobs.count(-0.5) == sum(t.loss_mask)
    # Every token after the prompt is the template's rendering of the conversation, turn by turn.
    conversation = [{"role": "user", "content": "Look up word 0."}]
    for k in range(2):
        conversation += [{"role": "assistant", "content": word}, {"role": "tool", "content": f"result {k}"}]
    want = tok.apply_chat_template(conversation, tools=[TOOL], add_generation_prompt=True, tokenize=False) + word
    assert tok.decode(t.prompt_ids + t.response_ids) == want + tok.eos_token
    assert [v for _, v in t.turn_rewards] == [0.0, 0.0, 1.0]
    assert t.turn_rewards[-1][0] == len(t.response_ids) - 1  # the reward sits on the turn's last model token
    assert [t.loss_mask[p] for p, _ in t.turn_rewards] == [1, 1, 1]


# ------------------------------------------------------------------------------------------- rewards, advantages


def test_grpo_compares_whole_trajectories_and_observations_get_no_advantage(tok, tmp_path):
    plans = [{"rewards": [1.0, 0.0]}, {"rewards": [0.0, 1.0]}, {"rewards": [0.5, 0.5]}, {"rewards": [0.0, 0.0]}]
    trajs = drive(agent_loop(tok, tmp_path, plans), lambda turn: [50, 60, tok.eos_token_id])
    save_batch(agent_samples(trajs), tmp_path, tok.pad_token_id, max_new_tokens=8)
    b = load_batch(tmp_path)
    assert b["responses"].shape[1] == max(len(t.response_ids) for t in trajs) > 8  # the longest trajectory
    assert b["scores"].tolist() == [1.0, 1.0, 1.0, 0.0]  # each trajectory's turn rewards summed
    assert b["token_rewards"].sum(1).tolist() == [1.0, 1.0, 1.0, 0.0]
    zeros = torch.zeros_like(b["token_rewards"])
    adv, _, _ = ppo.advantages(AlgorithmSpec(adv_estimator="grpo"), b, zeros, zeros)
    model_tok, obs = b["loss_mask"].bool(), b["response_mask"].bool() & ~b["loss_mask"].bool()
    assert obs.any() and (adv[obs] == 0).all()
    per_traj = [adv[i][model_tok[i]].unique().tolist() for i in range(4)]
    assert all(len(v) == 1 for v in per_traj)
    assert per_traj[0] == per_traj[1] == per_traj[2] and per_traj[0][0] > 0 > per_traj[3][0]


# ------------------------------------------------------------------------------------------- gradient


@pytest.mark.parametrize("packed", [False, True])
def test_observation_tokens_add_nothing_to_the_update(tok, tiny_kit, tmp_path, packed):
    """One PPO step (KL loss and entropy bonus on) from the same weights, padded or packed: the advantages, old and
    reference log-probs of the observation tokens changed arbitrarily leave the updated weights bit-identical."""
    trajs = drive(agent_loop(tok, tmp_path, [{"rewards": [0.0, r]} for r in (1.0, 0.0, 0.5, 0.2)]),
                  lambda turn: [50 + turn.key, 60, tok.eos_token_id])
    save_batch(agent_samples(trajs), tmp_path, tok.pad_token_id, max_new_tokens=8)
    b = load_batch(tmp_path)
    obs = b["response_mask"].bool() & ~b["loss_mask"].bool()
    assert obs.sum() >= 4 * 5
    bp = tiny_blueprint(tiny_kit, tmp_path / "store", "resources.nproc_per_node=1", "rollout.n=4",
                        "algorithm.use_kl_loss=true", "algorithm.entropy_coeff=0.01", "algorithm.ppo_mini_batch_size=1",
                        "algorithm.ppo_micro_batch_size_per_gpu=2", f"algorithm.use_remove_padding={packed}")
    start = M.build_module(tiny_kit["model_dir"], bp.model, packed=packed).eval()
    at = Placement(0, 1, "cpu")
    old = ppo.score_all(start, b, ppo_spec(bp), at)
    data, _ = ppo.prepare(bp.algorithm, b, old, old - 0.01, iteration=1)
    g = torch.Generator().manual_seed(0)
    noise = lambda x: torch.where(obs, torch.randn(x.shape, generator=g) * 3, x)  # noqa: E731
    messed = ppo.PPOBatch(data.tensors, 1, noise(data.old_logp), noise(data.ref_logp), noise(data.adv), data.ret)
    weights = []
    for d in (data, messed):
        m = copy.deepcopy(start)
        models = ppo.Models(ppo.Trainee(m, torch.optim.AdamW(m.parameters(), lr=1e-2)))
        hist = ppo.train(ppo_spec(bp), models, d, at)
        weights.append((m.state_dict(), hist[-1]["pg_loss"]))
    (w0, l0), (w1, l1) = weights
    assert l0 == l1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(not torch.equal(w0[k], start.state_dict()[k]) for k in w0)  # the step moved the weights


# ------------------------------------------------------------------------------------------- timeouts, failures


def test_a_slow_tool_times_out_and_the_trajectory_goes_on(tok, tmp_path):
    envs = []
    # The first call takes 1.3 s against a 1 s limit; its late reward (5) is dropped. The next call waits for it to
    # return (one call at a time per environment), well within its own second.
    plans = [{"rewards": [5.0, 0.0, 1.0], "sleep": {0: 1.3}}, {"rewards": [0.0, 1.0]}]
    loop = agent_loop(tok, tmp_path, plans, timeout=1.0, envs=envs)
    slow, fast = drive(loop, lambda turn: [50, tok.eos_token_id])
    assert (slow.tool_timeouts, slow.failed, slow.truncated, slow.turns, slow.score) == (1, False, False, 3, 1.0)
    assert "tool: The tool call timed out after 1 s." in tok.decode(slow.response_ids)
    assert (fast.tool_timeouts, fast.turns, fast.score) == (0, 2, 1.0)
    loop.shutdown(5.0)
    assert envs[0].calls_at_once == 1  # the next call waited for the timed-out one: one call at a time


def test_an_environment_that_raises_fails_its_trajectory_not_the_rollout(tok, tmp_path, caplog):
    plans = [{"rewards": [0.0, 1.0], "raise_at": 1}] + [{"rewards": [0.0, 1.0]}] * 3
    trajs = drive(agent_loop(tok, tmp_path, plans), lambda turn: [50, tok.eos_token_id])
    assert [t.failed for t in trajs] == [True, False, False, False]
    assert "ValueError: the tool exploded" in trajs[0].error and "the tool exploded" in caplog.text
    samples = agent_samples(trajs)
    stats = save_batch(samples, tmp_path, tok.pad_token_id, max_new_tokens=8)
    b = load_batch(tmp_path)
    assert b["loss_mask"][0].sum() == 0 and (b["loss_mask"][1:].sum(1) == 4).all()  # the failed one trains nothing
    assert stats["agent/failed"] == 1 and stats["agent/turns_mean"] == 2
    check_failures(samples, 0.25)  # 1 of 4: at the limit
    with pytest.raises(RuntimeError, match="raised in 1 of 4 trajectories, more than "
                                           "rollout.agent.max_failed_fraction=0.2"):
        check_failures(samples, 0.2)


def test_token_and_turn_limits_truncate(tok, tmp_path):
    long_turn = [50] * 8  # no EOS: each turn takes its whole budget
    by_turns = drive(agent_loop(tok, tmp_path, [{"rewards": [0.0] * 9}], max_turns=2), lambda turn: long_turn)
    assert by_turns[0].turns == 2 and by_turns[0].truncated
    loop = agent_loop(tok, tmp_path, [{"rewards": [0.0] * 9}], max_total=40)
    budgets = []
    (t,) = drive(loop, lambda turn: budgets.append(turn.budget) or [50] * turn.budget)
    assert t.truncated and len(t.prompt_ids) + len(t.response_ids) <= 40 and 1 <= min(budgets)


# ------------------------------------------------------------------------------------------- hf engine end to end


def rollout_spec(**agent) -> RolloutSpec:
    return RolloutSpec(mode="agent", n=2, max_new_tokens=6, temperature=1.0, micro_batch_size=3,
                       agent=AgentSpec(environment="test_scripted", max_turns=3, max_total_tokens=120, **agent))


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_agent_rollout_end_to_end_and_its_logprobs_are_the_updates(tok, model, tmp_path, engine):
    """Tool latency varies at random between two runs; on the hf engine (its rounds) the samples do not. The batch's
    rollout log-probs are the forward's over the saved trajectories: the trained context is the sampled one."""
    prompts = Prompts([[{"role": "user", "content": f"Look up word {i}."}] for i in range(2)], ["d"] * 2, ["x"] * 2,
                      [{"rewards": [0.0, 0.5, 1.0]}, {"rewards": [1.0, 0.0, 0.0]}], [10, 11])
    spec = rollout_spec().model_copy(update={"engine": engine, "micro_batch_size": 4})  # a row per trajectory
    runs = []
    for run in range(2 if engine == "hf" else 1):
        jitter = random.Random(time.time_ns())
        for e in prompts.extra_info:
            e["sleep"] = {k: jitter.uniform(0, 0.05) for k in range(3)}
        runs.append(generate_agent_share(model, tok, spec, RewardSpec(), prompts, 1, Placement(0, 1, "cpu"),
                                         max_prompt_len=100, seed=7))
    if engine == "hf":
        assert [s["response_ids"] for s in runs[0]] == [s["response_ids"] for s in runs[1]]
        assert [s["logprobs"] for s in runs[0]] == [s["logprobs"] for s in runs[1]]
    samples = runs[0]
    assert [s["group"] for s in samples] == [0, 0, 1, 1] and [s["row"] for s in samples] == [10, 10, 11, 11]
    assert all(1 <= s["agent"]["turns"] <= 3 for s in samples)
    stats = save_batch(samples, tmp_path, tok.pad_token_id, max_new_tokens=6)
    assert stats["tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert {k for k in stats if k.startswith("agent/")} == {f"agent/{k}" for k in AGENT_KEYS}  # the metric names
    # no turn waits for a row: the static engine resumes a later turn in its row's cache where the row has room
    resumable = sum(s["agent"]["turns"] - 1 for s in samples) / sum(s["agent"]["turns"] for s in samples)
    resumed = stats["agent/turns_resumed_frac"]
    assert 0 < resumed <= resumable + 1e-6 if engine == "static" else resumed == 0.0
    b = load_batch(tmp_path)
    with torch.no_grad():
        logp = forward(model, Rows.of(b), list(range(4)), "cpu", temperature=1.0)[0]
    trained = b["loss_mask"].bool()
    torch.testing.assert_close(logp[trained], b["rollout_logp"][trained], atol=1e-4, rtol=1e-4)
    assert (b["rollout_logp"][~trained] == 0).all()


def test_an_environment_reads_every_column_of_its_dataset_row(tmp_path):
    """verl's agent data has top-level columns beside the RL schema (agent_name); reset(row) sees them, through a
    batch's take() and the held-out split alike."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verlflow.core.blueprint.sections import EvalSpec
    from verlflow.core.ml.agent_rollout import env_row
    from verlflow.core.ml.data import load_prompts
    from verlflow.core.ml.evaluate import load_held_out

    f = tmp_path / "agent.parquet"
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(3)], "data_source": ["calc"] * 3,
        "reward_model": [{"ground_truth": str(i)} for i in range(3)], "extra_info": [{"index": i} for i in range(3)],
        "agent_name": ["tool_agent", "tool_agent", "other"]}), f)
    row = env_row(load_prompts([str(f)]).take([2, 0]), 0)
    assert row["agent_name"] == "other" and row["reward_model"] == {"ground_truth": "2"} and row["index"] == 2
    held = load_held_out(EvalSpec(files=[str(f)]))
    assert env_row(held.prompts, 1)["agent_name"] == "tool_agent"
