"""The agent story as users run it (issue 40): blueprints/tiny-agent.yaml, as shipped, on the calculator kit made
here (sft 2 epochs, then 6 GRPO iterations on 2 ranks in one warm pool), with a held-out evaluation before RL and
after it. One run, then three short ones: a rerun that reuses every stage, `--from rollout[6]` with rank 1
SIGKILLed in the agent rollout, and the rerun that resumes there.

Overrides of the shipped blueprint: the store (tmp), no trackers (an MLflow store costs seconds), and the
evaluation (eval.*): its files are the kit's test split."""

import re
import shutil
from collections import Counter
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from verlflow.core.agent.envs.calculator import Calculator
from verlflow.core.blueprint import Blueprint, load_blueprint
from verlflow.core.ml.evaluate import pass_at_k
from verlflow.core.orchestrate.launcher import StageFailure
from verlflow.core.orchestrate.pipeline import run_pipeline
from verlflow.core.store.artifacts import open_store
from verlflow.core.testing.tinykit import EOS, TOOL_ROLE, make_tiny

pytestmark = pytest.mark.stages

REPO = Path(__file__).resolve().parents[1]
RUN, LAST = "agent", 6  # the blueprint's iterations
PROMPTS, N = 8, 4  # evaluated prompts, trajectories per prompt
NEXT_TURN = "<|assistant|>"  # the kit's generation prompt: an observation's tokens end with it
# A tool turn in a shown trajectory, and how the calculator's results start (a number or an error, a line per call)
TOOL_TURN = re.compile(re.escape(TOOL_ROLE) + "(.*?)" + re.escape(EOS + NEXT_TURN), re.S)
RESULT = re.compile(r"-?\d|Error: ")
# What differs between two runs of a rollout or an evaluation: wall-clock times and the warm pool's reuse in the
# metrics; the files a rerun writes again byte for byte (a rollout's samples.parquet holds wall-clock env_s, and
# two saves of the same DCP policy differ in bytes: the export's weights stand for the update's)
TIMED = {"agent/env_s", "agent/env_wait_s", "agent/gen_s", "tokens_per_s", "warm_cache_hits"}
SAME_BYTES = {"rollout": "batch.safetensors", "evaluate": "samples.parquet", "export": "hf/model.safetensors"}


def agent_blueprint(folder: Path) -> tuple[Blueprint, dict]:
    """The shipped blueprint beside a `tiny/agent` kit made here (its relative paths reach it). Evaluated: 8 test
    prompts x 4 trajectories before RL and after the last iteration; a trajectory is correct when it earned the
    calculator's call reward (eval.threshold 0.5: no policy this small gets the final answer right yet)."""
    kit = make_tiny(folder / "tiny/agent", task="calculator")
    (folder / "blueprints").mkdir()
    shutil.copy(REPO / "blueprints/tiny-agent.yaml", folder / "blueprints")
    bp = load_blueprint(folder / "blueprints/tiny-agent.yaml", [
        f"storage.uri={folder / 'store'}", "tracking.backends=[]", f"eval.files=[{kit['test_file']}]",
        f"eval.max_prompts={PROMPTS}", f"eval.n={N}", "eval.temperature=1.0", f"eval.pass_k=[1,{N}]",
        "eval.threshold=0.5", f"eval.every={LAST}"])
    assert bp.iterations == LAST and bp.rollout.mode == "agent"
    return bp, kit


@dataclass(frozen=True)
class Story:
    bp: Blueprint
    kit: dict
    store: Path
    first: dict  # the run's StageResults by step name
    again: dict  # the rerun's
    again_lines: list[str]
    killed_lines: list[str]  # `--from rollout[6]` with rank 1 killed in it
    after_kill: dict | None  # rollout[6]'s manifest after the kill
    resumed: dict  # the rerun after the kill
    resumed_lines: list[str]


def by_name(results) -> dict:
    return {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r for r in results}


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> Story:
    folder = tmp_path_factory.mktemp("agent")
    bp, kit = agent_blueprint(folder)
    lines: list[str] = []
    first = by_name(run_pipeline(bp, RUN, on_line=lines.append))
    assert f"export[{LAST}]" in first, "\n".join(lines[-60:])
    again_lines: list[str] = []
    again = by_name(run_pipeline(bp, RUN, on_line=again_lines.append))
    killed: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERLFLOW_FAULT", "kill_rank1_in_rollout")
        with pytest.raises(StageFailure):
            run_pipeline(bp, RUN, on_line=killed.append, force_from=f"rollout[{LAST}]")
    after_kill = open_store(bp.storage).read_manifest(f"runs/{RUN}/{LAST}/rollout")
    resumed_lines: list[str] = []
    resumed = by_name(run_pipeline(bp, RUN, on_line=resumed_lines.append))
    return Story(bp, kit, folder / "store", first, again, again_lines, killed, after_kill, resumed, resumed_lines)


def launched(lines: list[str]) -> list[str]:
    """The steps a run launched (`[verlflow] rollout[6] -> file://...`)."""
    return [line.split()[1] for line in lines if line.startswith("[verlflow] ") and " -> " in line]


# ------------------------------------------------------------------------------------------------ learning


def test_grpo_raises_the_share_of_right_tool_calls_and_the_reward(story):
    """After sft, GRPO raises the share of trajectories with a tool call that returned a result, and the reward,
    from the first RL iteration to the last (measured with seed 0: 0.16 -> 0.69 and 0.08 -> 0.33)."""
    rl = [f"{stage}[{i}]" for i in range(1, LAST + 1) for stage in ("rollout", "update", "export")]
    assert list(story.first) == ["validate[init]", "build[init]", "sft[sft.1]", "sft[sft.2]", "build[rl]",
                                 "evaluate[0]", *rl[:-1], f"evaluate[{LAST}]", rl[-1]]
    first, last = (story.first[f"rollout[{i}]"].manifest["metrics"] for i in (1, LAST))
    assert last["agent/tool_success_frac"] > first["agent/tool_success_frac"] + 0.3, (first, last)
    assert last["reward_mean"] > first["reward_mean"] + 0.15, (first, last)
    assert last["agent/failed"] == last["agent/tool_timeouts"] == 0 and last["agent/turns_mean"] > 1


# ---------------------------------------------------------------------------------------------- evaluation


def test_the_evaluation_runs_trajectories_and_reports_pass_at_k_over_them(story):
    """evaluate[0] (the sft'd policy) and evaluate[6] run agent trajectories of the test split; pass@k is over a
    prompt's trajectories; the shown responses are whole trajectories, the calculator's results in tool turns.
    (What the store holds now: evaluate[6] as the resumed run committed it again.)"""
    store = open_store(story.bp.storage)
    before, after = (store.read_manifest(f"runs/{RUN}/{i}/evaluate") for i in (0, LAST))
    assert before["inputs"]["policy"]["stage"] == f"runs/{RUN}/rl/build"
    m0, m = before["metrics"], after["metrics"]
    assert m["accuracy"] > m0["accuracy"] + 0.25, (m0, m)  # measured 0.28 -> 0.78
    table = pq.read_table(story.store / f"runs/{RUN}/{LAST}/evaluate/samples.parquet").to_pylist()
    assert len(table) == m["samples"] == PROMPTS * N
    correct = Counter()
    for r in table:
        correct[r["row"]] += r["correct"]
    assert len(correct) == PROMPTS
    for k in (1, N):
        want = sum(pass_at_k(N, c, k) for c in correct.values()) / PROMPTS
        assert m[f"pass@{k}"] == pytest.approx(want, abs=1e-6), k
    assert m[f"pass@{N}"] > m["pass@1"]
    tool_turns = [TOOL_TURN.findall(r["response"]) for r in table]
    assert sum(map(bool, tool_turns)) > len(table) / 2, [r["response"] for r in table[:4]]
    assert all(RESULT.match(turn) for turns in tool_turns for turn in turns)


# ------------------------------------------------------------------------------------------- staged machinery


def test_a_rerun_reuses_every_stage(story):
    assert list(story.again) == list(story.first)
    assert all(r.skipped for r in story.again.values()) and launched(story.again_lines) == []
    assert {n: r.manifest["key"] for n, r in story.again.items()} == \
        {n: r.manifest["key"] for n, r in story.first.items()}


def test_a_killed_agent_rollout_resumes_there_with_the_same_results(story):
    """`--from rollout[6]` with rank 1 SIGKILLed in the agent rollout leaves it uncommitted; the rerun starts at
    that rollout, runs the steps after it again (they had committed before it), reuses every earlier one, and
    commits what the uncrashed run committed: the same batch, evaluation and exported weights, byte for
    byte, and the same metrics."""
    assert any("SIGKILL in rollout" in line for line in story.killed_lines), story.killed_lines[-20:]
    assert launched(story.killed_lines) == [f"rollout[{LAST}]"] and story.after_kill is None
    rerun = [f"{stage}[{LAST}]" for stage in ("rollout", "update", "evaluate", "export")]
    assert launched(story.resumed_lines) == rerun and list(story.resumed) == list(story.first)
    assert {n for n, r in story.resumed.items() if not r.skipped} == set(rerun)
    new, old = ({n: story.resumed[n].manifest for n in rerun}, {n: story.first[n].manifest for n in rerun})
    assert {n: m["key"] for n, m in new.items()} == {n: m["key"] for n, m in old.items()}
    for stage, file in SAME_BYTES.items():
        name = f"{stage}[{LAST}]"
        assert new[name]["files"][file]["sha256"] == old[name]["files"][file]["sha256"], name
        if stage != "export":
            assert {k: v for k, v in new[name]["metrics"].items() if k not in TIMED} == \
                {k: v for k, v in old[name]["metrics"].items() if k not in TIMED}, name


# ---------------------------------------------------------------------------------------------- the batch


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, at = [], 0
    for value, run in groupby(mask):
        n = len(list(run))
        out.append((value, at, at + n))
        at += n
    return out


def test_the_batch_masks_exactly_the_observation_tokens(story):
    """In the committed batch each trajectory is its model turns (loss_mask 1) with, between them, observation
    tokens (loss_mask 0, log-prob 0) that are exactly the chat template's tool turn holding the calculator's answer
    to the model turn before (replayed here); token_rewards sit on model turns' last tokens and sum to the score."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(story.kit["model_dir"])
    folder = story.store / f"runs/{RUN}/{LAST}/rollout"
    b = load_file(str(folder / "batch.safetensors"))
    samples = pq.read_table(folder / "samples.parquet").to_pylist()
    assert {"loss_mask", "token_rewards"} <= set(b) and len(samples) == len(b["responses"])
    observations = 0
    for i, s in enumerate(samples):
        n = int(b["response_mask"][i].sum())
        ids, mask = b["responses"][i, :n].tolist(), b["loss_mask"][i, :n].int().tolist()
        assert not b["loss_mask"][i, n:].any() and (b["rollout_logp"][i, :n][b["loss_mask"][i, :n] == 0] == 0).all()
        runs = spans(mask)
        model, obs = [r for r in runs if r[0] == 1], [r for r in runs if r[0] == 0]
        assert runs[0][0] == runs[-1][0] == 1 and len(model) == s["turns"] and len(obs) == s["turns"] - 1, (i, runs)
        calculator = Calculator({}, None)
        calculator.reset({"prompt": [], "reward_model": {"ground_truth": s["ground_truth"]}})
        for (_, a, e), (_, oa, oe) in zip(model, obs):
            step = calculator.step(tok.decode(ids[a:e], skip_special_tokens=True))
            assert tok.decode(ids[oa:oe]) == f"{TOOL_ROLE}{step.observation}{EOS}{NEXT_TURN}", (i, tok.decode(ids))
            observations += 1
        rewarded = b["token_rewards"][i].nonzero().flatten().tolist()
        assert set(rewarded) <= {e - 1 for _, _, e in model}
        assert b["token_rewards"][i].sum().item() == pytest.approx(s["score"]) == b["scores"][i].item()
    assert observations >= len(samples)  # measured: 1.8 tool turns per trajectory
