"""rollout.mode agent in the blueprint (issue 40): the schema's rules, the stage keys, the checks that refuse a bad
environment, tool schema, dataset or chat template at validate (naming the field and the file), and the tiny
calculator kit (`verlflow make-tiny --task calculator`) that blueprints/tiny-agent.yaml runs on."""

import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from verlflow.core.blueprint import Blueprint, load_blueprint
from verlflow.core.checks.agent import tool_template_problems
from verlflow.core.checks.inputs import missing_inputs
from verlflow.core.errors import BlueprintError
from verlflow.core.stagespec import SPECS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

# sha256 of the default kit's file table (kit.json "files": every file's sha256 and size). The demo's printed
# rewards come from these bytes: a change to the default kit must be deliberate (update this and say why).
DEFAULT_KIT_FILES = "3a8079a62fbc1f9e41c15070af1e848eb76873556b5e60dfce14733fef36e6a0"

ENVS = '''
from verlflow.core.agent.env import Environment, Step


class BadSchema(Environment):
    def tools(self):
        return [{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"key": {"type": "text"}}}}}]

    def step(self, model_text):
        return Step(None, done=True)


class NeedsToolsKwargs(Environment):
    required_columns = ("prompt", "extra_info.tools_kwargs")

    def step(self, model_text):
        return Step(None, done=True)
'''


@pytest.fixture(scope="module")
def agent_kit(tmp_path_factory) -> dict:
    """The calculator kit, made through the CLI flag."""
    from verlflow.flows.cli import main

    out = tmp_path_factory.mktemp("agent") / "kit"
    assert main(["make-tiny", str(out), "--task", "calculator"]) == 0
    kit = json.loads((out / "kit.json").read_text())
    return {**kit, "root": out, "model_dir": str(out / "model"), **{f"{k}_file": str(out / kit[k])
                                                                    for k in ("train", "test", "sft")}}


@pytest.fixture(scope="module")
def user_envs(tmp_path_factory):
    """A module of test environments on sys.path (rollout.agent.environment: 'agent_test_envs:Class')."""
    folder = tmp_path_factory.mktemp("envs")
    (folder / "agent_test_envs.py").write_text(ENVS)
    sys.path.insert(0, str(folder))
    yield folder / "agent_test_envs.py"
    sys.path.remove(str(folder))
    sys.modules.pop("agent_test_envs", None)


def agent_bp(kit: dict, tmp_path: Path, *, rollout: dict | None = None, agent: dict | None = None,
             **sections) -> Blueprint:
    """blueprints/tiny-agent.yaml on `kit`, with changes."""
    data = yaml.safe_load((REPO / "blueprints/tiny-agent.yaml").read_text())
    data["model"]["path"] = kit["model_dir"]
    data["data"]["train_files"] = [kit["train_file"]]
    data["phases"][0]["data"]["train_files"] = [kit["sft_file"]]
    data["storage"]["uri"] = str(tmp_path / "store")
    data["rollout"]["agent"].update(agent or {})
    data["rollout"].update(rollout or {})
    for name, value in sections.items():
        data[name] = {**data.get(name, {}), **value}
    return load_blueprint(data=data)


# ---------------------------------------------------------------------------------------------------- schema


def test_single_mode_is_the_default_and_takes_no_agent_section():
    assert Blueprint().rollout.mode == "single" and Blueprint().rollout.agent is None
    with pytest.raises(BlueprintError, match=r"rollout.agent is read in rollout.mode=agent only"):
        load_blueprint(overrides=["rollout.agent.environment=calculator"])
    with pytest.raises(BlueprintError, match=r"rollout.mode=agent needs rollout.agent"):
        load_blueprint(overrides=["rollout.mode=agent"])


@pytest.mark.parametrize("overrides, message", [
    (["rollout.agent.max_total_tokens=100"], r"rollout.agent.max_total_tokens=100 leaves no room for a model turn "
                                             r"after a prompt of data.max_prompt_length=128"),
    (["data.max_prompt_length=8", "rollout.max_new_tokens=64", "rollout.agent.max_total_tokens=32"],
     r"rollout.agent.max_total_tokens=32 is below rollout.max_new_tokens=64"),
    (["eval.max_new_tokens=4096"], r"eval.max_new_tokens=4096 .* is above rollout.agent.max_total_tokens=2048"),
    (["rollout.agent.max_turns=0"], r"rollout.agent.max_turns"),
    (["rollout.agent.max_failed_fraction=1.5"], r"rollout.agent.max_failed_fraction"),
    (["rollout.agent.tool_timeout_s=0"], r"rollout.agent.tool_timeout_s"),
    (["rollout.agent.environment=pkg.mod:A:B"], r"rollout.agent.environment: 'pkg.mod:A:B' is neither"),
])
def test_agent_limits_are_refused_naming_the_fields(overrides, message):
    with pytest.raises(BlueprintError, match=message):
        load_blueprint(overrides=["rollout.mode=agent", "rollout.agent.environment=calculator", *overrides])


def test_the_run_form_describes_every_agent_field():
    from verlflow.core.blueprint import json_schema

    defs = json_schema()["$defs"]
    assert "agent" in defs["RolloutSpec"]["properties"]["mode"]["description"]
    agent = defs["AgentSpec"]["properties"]
    assert set(agent) == {"environment", "module", "config", "max_turns", "max_total_tokens", "tool_timeout_s",
                          "max_failed_fraction", "tool_config"}
    assert all(len(p.get("description", "")) > 20 for p in agent.values()), agent


@pytest.mark.parametrize("stage", ["rollout", "update", "evaluate", "validate"])
def test_stage_keys_hash_the_agent_fields(stage):
    keys = SPECS[stage].key_sections
    agent = ["rollout.mode=agent", "rollout.agent.environment=calculator"]
    a, b, c = (load_blueprint(overrides=o) for o in ([], agent, [*agent, "rollout.agent.max_turns=2"]))
    assert len({bp.section_hash(*keys) for bp in (a, b, c)}) == 3


def test_tool_config_is_relative_to_the_blueprint_file(tmp_path):
    (tmp_path / "bp.yaml").write_text("rollout: {mode: agent, agent: {environment: verl_tools, "
                                      "tool_config: tools/calc.yaml}}\n")
    assert load_blueprint(tmp_path / "bp.yaml").rollout.agent.tool_config == str(tmp_path / "tools/calc.yaml")


# ---------------------------------------------------------------------------------------------------- checks


def test_a_good_agent_blueprint_validates(agent_kit, tmp_path):
    from transformers import AutoTokenizer

    from verlflow.core.checks.preflight import rollout_problems
    from verlflow.core.ml.data import load_prompts

    bp = agent_bp(agent_kit, tmp_path, eval={"files": [agent_kit["test_file"]]})
    assert missing_inputs(bp) == []
    tok = AutoTokenizer.from_pretrained(agent_kit["model_dir"])
    assert rollout_problems(bp, tok, load_prompts(bp.data.train_files)) == []


def test_an_unknown_environment_is_refused(agent_kit, tmp_path):
    (problem,) = missing_inputs(agent_bp(agent_kit, tmp_path, agent={"environment": "abacus"}))
    assert problem.startswith("rollout.agent.environment: unknown environment 'abacus'. Known: calculator")
    assert "rollout.agent.module" in problem  # the fix: how to register one
    (problem,) = missing_inputs(agent_bp(agent_kit, tmp_path, agent={"environment": "no_such_pkg.envs:Env"}))
    assert "rollout.agent.environment: cannot import module 'no_such_pkg.envs'" in problem


def test_a_tool_schema_that_is_not_json_schema_is_refused(agent_kit, tmp_path, user_envs):
    (problem,) = missing_inputs(agent_bp(agent_kit, tmp_path, agent={"environment": "agent_test_envs:BadSchema"}))
    assert problem.startswith(f"rollout.agent.environment agent_test_envs:BadSchema ({user_envs}): tool 0: "
                              "function.parameters is not a valid JSON Schema: at properties/key/type"), problem
    assert '"parameters": {"type": "object"' in problem  # the fix: what a schema looks like


def test_rows_missing_the_environments_columns_are_refused(agent_kit, tmp_path, user_envs):
    rows = pq.read_table(agent_kit["train_file"]).to_pylist()[:8]
    without = tmp_path / "without.parquet"
    pq.write_table(pa.Table.from_pylist(rows), without)
    for i, r in enumerate(rows):
        r["extra_info"]["tools_kwargs"] = None if i == 5 else json.dumps({"calculator": {}})
    gap = tmp_path / "gap.parquet"
    pq.write_table(pa.Table.from_pylist(rows), gap)
    bp = agent_bp(agent_kit, tmp_path, agent={"environment": "agent_test_envs:NeedsToolsKwargs"},
                  data={"train_files": [str(gap)]}, eval={"files": [agent_kit["test_file"], str(without)]},
                  algorithm={"ppo_mini_batch_size": 4})
    assert missing_inputs(bp) == [
        f"data.train_files[0]: {gap} row 5 has no value in column extra_info.tools_kwargs (1 of 8 rows), which "
        "rollout.agent.environment NeedsToolsKwargs reads; fill it in every row or drop those rows.",
        f"eval.files[0]: {agent_kit['test_file']} has no column extra_info.tools_kwargs, which "
        "rollout.agent.environment NeedsToolsKwargs reads (NeedsToolsKwargs.required_columns = ['prompt', "
        "'extra_info.tools_kwargs']); add it to every row.",
        f"eval.files[1]: {without} has no column extra_info.tools_kwargs, which rollout.agent.environment "
        "NeedsToolsKwargs reads (NeedsToolsKwargs.required_columns = ['prompt', 'extra_info.tools_kwargs']); add "
        "it to every row."]
    single = agent_bp(agent_kit, tmp_path, data={"train_files": [str(gap)]}, rollout={"mode": "single", "agent": None})
    assert missing_inputs(single) == []  # single mode reads no environment's columns


def test_a_chat_template_without_tool_support_is_refused(agent_kit, tiny_kit, tmp_path):
    from transformers import AutoTokenizer

    bp = agent_bp(agent_kit, tmp_path, model={"path": tiny_kit["model_dir"]})
    tok = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    template = Path(tiny_kit["model_dir"]) / "chat_template.jinja"
    (problem,) = tool_template_problems(bp, tok)  # the default kit's template raises on the tool role
    assert problem.startswith(f"model.path: the chat template in {template} raised on a conversation with a tool "
                              "and a tool message (TemplateError: tiny chat template: role must be"), problem
    assert "Qwen2.5-Instruct" in problem
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    (problem,) = tool_template_problems(bp, tok)  # renders the tool message, ignores `tools`
    assert problem.startswith(f"model.path: the chat template in {template} does not render the tools (rendered "
                              "with tools=[...]): the model would never see"), problem
    assert tool_template_problems(agent_bp(agent_kit, tmp_path), AutoTokenizer.from_pretrained(
        agent_kit["model_dir"])) == []


# ------------------------------------------------------------------------------------------------------- kits


def test_the_default_kit_is_unchanged(tiny_kit):
    table = json.dumps(tiny_kit["files"], sort_keys=True).encode()
    assert hashlib.sha256(table).hexdigest() == DEFAULT_KIT_FILES, tiny_kit["files"]


def test_the_agent_kit_renders_tools_and_tool_messages(agent_kit):
    from transformers import AutoTokenizer

    from verlflow.core.agent.registry import load_environment
    from verlflow.core.ml.generate import prompt_ids
    from verlflow.core.testing.tinykit import CALC_TOOLS_LINE, build_calculator_tokenizer

    tok = AutoTokenizer.from_pretrained(agent_kit["model_dir"])
    tools = load_environment("calculator")({}, None).tools()
    convo = [{"role": "user", "content": "Ann has 12 pens and gets 30 more. How many pens does she have?"},
             {"role": "assistant", "content": "<tool_call>12+30</tool_call>"}, {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "42"}]
    assert tok.apply_chat_template(convo, tools=tools, tokenize=False) == (
        "<|begin|><|system|>Tools: calculator(expression)<|end|><|user|>Ann has 12 pens and gets 30 more. How many "
        "pens does she have?<|end|><|assistant|><tool_call>12+30</tool_call><|end|><|tool|>42<|end|><|assistant|>"
        "42<|end|>")
    call = tok("<tool_call>12+30</tool_call>", add_special_tokens=False)["input_ids"]
    assert len(call) == 7 and tok.decode(call, skip_special_tokens=True) == "<tool_call>12+30</tool_call>"
    assert tok.convert_ids_to_tokens(call[1:-1]) == ["1", "2", "+", "3", "0"]  # digits one by one
    ref = build_calculator_tokenizer()  # the saved tokenizer encodes as the one made in memory
    text = tok.apply_chat_template(convo, tools=tools, tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"] == ref(text, add_special_tokens=False)["input_ids"]
    # an sft row's system turn is the tools' line: its prompt is the agent rollout's, token for token
    row = pq.read_table(agent_kit["sft_file"]).to_pylist()[0]["messages"]
    assert row[0] == {"role": "system", "content": CALC_TOOLS_LINE} and row[2]["content"].startswith("<tool_call>")
    assert prompt_ids(tok, row[:2]) == prompt_ids(tok, row[1:2], tools)
    # a turn that calls, as the calculator environment sees it, is a right call
    env = load_environment("calculator")({"call_reward": 0.5}, None)
    train = pq.read_table(agent_kit["train_file"]).to_pylist()[0]
    env.reset(train)
    step = env.step(f"<tool_call>{train['extra_info']['expression']}</tool_call>")
    assert (step.observation, step.reward) == (train["reward_model"]["ground_truth"], 0.5)
