"""Agent environments: the registry, tool-call parsing, tool-schema checks, and the shipped environments."""

import builtins
import json
import textwrap

import pytest

from verlflow.core.agent.env import EnvContext, Environment, Step
from verlflow.core.agent.envs.calculator import evaluate
from verlflow.core.agent.envs.python import parse_tests
from verlflow.core.agent.registry import environment_names, load_environment, register_environment
from verlflow.core.agent.toolcalls import ToolCall, check_tool_schema, parse_tool_calls
from verlflow.core.errors import BlueprintError

pytestmark = pytest.mark.unit


def context(tmp_path, **kw):
    return EnvContext(**{"tool_timeout_s": 10.0, "reward_fn": None, "scratch": tmp_path, **kw})


def row(ground_truth, content="What is 6 times 7?"):
    return {"prompt": [{"role": "user", "content": content}], "data_source": "test",
            "reward_model": {"ground_truth": ground_truth}, "extra_info": {}}


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ------------------------------------------------------------------------------------------------ registry
def test_the_builtins_are_registered():
    assert {"calculator", "python", "verl_tools"} <= set(environment_names())
    assert issubclass(load_environment("calculator"), Environment)


def test_an_unknown_environment_names_the_field_the_known_ones_and_how_to_register():
    with pytest.raises(BlueprintError) as e:
        load_environment("calculater")
    msg = str(e.value)
    assert msg.startswith("rollout.agent.environment: unknown environment 'calculater'")
    known = msg.split("Known: ", 1)[1].split(". ", 1)[0].split(", ")  # other test files may register more
    assert {"calculator", "python", "verl_tools"} <= set(known) and "@register_environment" in msg


def test_a_module_registers_first_and_the_class_form_loads(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent("""
        from verlflow.core.agent.env import Environment
        from verlflow.core.agent.registry import register_environment

        @register_environment("echo_test_env")
        class Echo(Environment):
            pass

        class NotAnEnv:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_environment("echo_test_env", module="my_envs").__name__ == "Echo"
    assert load_environment("my_envs:Echo").__name__ == "Echo"
    with pytest.raises(BlueprintError, match="subclass of verlflow.core.agent.env.Environment"):
        load_environment("my_envs:NotAnEnv")
    with pytest.raises(BlueprintError, match="has no attribute 'Missing'"):
        load_environment("my_envs:Missing")
    with pytest.raises(BlueprintError, match="rollout.agent.module: cannot import 'no_such_envs'"):
        load_environment("calculator", module="no_such_envs")
    with pytest.raises(BlueprintError, match="already taken"):
        register_environment("echo_test_env")(type("Other", (Environment,), {}))


# ------------------------------------------------------------------------------------------------ tool calls
def test_hermes_calls_are_parsed():
    text = ("Let me compute. " + call("calculator", expression="6*7") +
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "6*7"}),
                                       ToolCall("python", {"code": "print(1)"})], [])
    assert parse_tool_calls("The answer is 42.") == ([], [])


@pytest.mark.parametrize("body,says", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', "not valid JSON"),
    ('{"arguments": {"expression": "1+1"}}', 'no "name"'),
    ('["calculator"]', "must be a JSON object"),
    ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
])
def test_a_malformed_call_is_an_error_string_not_an_exception(body, says):
    calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert calls == [] and len(errors) == 1 and says in errors[0]


def test_an_unclosed_call_is_an_error_and_a_bare_body_is_a_call_of_the_only_tool():
    assert parse_tool_calls('<tool_call>{"name": "x"')[1] == [
        "a <tool_call> without its </tool_call>: the call was cut off or not closed."]
    assert parse_tool_calls("<tool_call>3+4</tool_call>", bare_call=("calculator", "expression")) == (
        [ToolCall("calculator", {"expression": "3+4"})], [])
    assert parse_tool_calls("<tool_call>3+4</tool_call>")[0] == []


GOOD_SCHEMA = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


@pytest.mark.parametrize("schema,says", [
    ({"function": GOOD_SCHEMA["function"]}, 'needs "type": "function"'),
    ({"type": "function", "function": {"name": "bad name!"}}, "function.name must be"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strng"}}}}}, "function.parameters is not a valid JSON Schema: at properties/x/type"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}},
     "not a valid JSON Schema: at required"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}, "JSON Schema of an object"),
])
def test_a_bad_tool_schema_is_refused_naming_where(schema, says):
    check_tool_schema(GOOD_SCHEMA, "x")
    with pytest.raises(BlueprintError) as e:
        check_tool_schema(schema, "tools.yaml: tools[0].tool_schema")
    assert str(e.value).startswith("tools.yaml: tools[0].tool_schema") and says in str(e.value)


# ------------------------------------------------------------------------------------------------ calculator
def calculator(tmp_path, **config):
    env = load_environment("calculator")(config, context(tmp_path))
    for schema in env.tools():
        check_tool_schema(schema, "calculator")
    assert env.reset(row("42")) == [{"role": "user", "content": "What is 6 times 7?"}]
    return env


def test_calculator_calls_then_answers(tmp_path):
    env = calculator(tmp_path, call_reward=0.1)
    first = env.step("I will compute. " + call("calculator", expression="6 * 7"))
    assert first == Step("42", reward=0.1, done=False, info={"tool_calls": 1, "tool_errors": 0})
    assert env.step("<tool_call>(2 + 4) * 7</tool_call>").reward == 0.0  # the call reward is paid once
    assert env.step("So the answer is 42.") == Step(None, reward=1.0, done=True,
                                                     info={"tool_calls": 0, "tool_errors": 0})
    assert calculator(tmp_path).step("It is 41 or 43.").reward == 0.0


def test_calculator_refuses_anything_but_arithmetic_without_eval(tmp_path, monkeypatch):
    monkeypatch.setattr(builtins, "eval", lambda *a, **k: pytest.fail("the calculator called eval"))
    env = calculator(tmp_path, call_reward=0.1)
    for expression in ("__import__('os').system('touch pwned')", "open('x')", "(1).__class__", "9**9**9", "1/0"):
        step = env.step(call("calculator", expression=expression))
        assert step.observation.startswith("Error:") and step.info == {"tool_calls": 1, "tool_errors": 1}, step
        assert step.reward == 0.0 and not step.done
    assert not (tmp_path / "pwned").exists()
    assert env.step(call("calculater", expression="1")).observation.startswith("Error: unknown tool")
    assert env.step('<tool_call>{"name": "calculator"</tool_call>').info == {"tool_calls": 1, "tool_errors": 1}
    assert [evaluate(e) for e in ("2**10", "-(3 - 5) / 4", "1.5 * 2")] == [1024, 0.5, 3.0]


# ------------------------------------------------------------------------------------------------ python
def python_env(tmp_path, tests):
    env = load_environment("python")({"cpu_s": 2, "wall_s": 5}, context(tmp_path))
    env.reset(row(tests, "Write add(a, b)."))
    return env


TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
# reads the program's text (where the pass tag is) from the file it ran from, and writes passes with that tag
FORGER = """def add(a, b):
    return None
import os, re
try:
    text = open('../code.py').read()
except OSError:
    text = ''
for tag in set(re.findall('[0-9a-f]{32}', text)):
    os.write(_verlflow_fd, f'{tag} 0\\n{tag} 1\\n'.encode())"""


def test_python_runs_a_tool_call_in_the_sandbox(tmp_path):
    env = python_env(tmp_path, TESTS)
    step = env.step(call("python", code="print(sum(range(10)))"))
    assert step == Step("45", reward=0.0, done=False, info={"tool_calls": 1, "tool_errors": 0})
    refused = env.step(call("python", code="import os\nos.fork()"))
    assert "refused" in refused.observation and refused.info["tool_errors"] == 1


@pytest.mark.parametrize("solution,reward", [
    ("def add(a, b):\n    return a + b", 1.0),
    ("def add(a, b):\n    return a + b if a > 0 else 7", 0.5),
    ("def add(a, b):\n    return 0\nprint('0 1')\nimport sys\nsys.exit(0)", 0.0),  # printing or exiting earns nothing
    (FORGER, 0.0),
])
def test_python_scores_the_final_code_block_by_its_tests(tmp_path, solution, reward):
    env = python_env(tmp_path, json.dumps(TESTS))
    step = env.step(f"Here it is:\n```python\n{solution}\n```")
    assert step.done and step.reward == reward, step
    assert python_env(tmp_path, TESTS).step("No code, sorry.") == Step(
        None, reward=0.0, done=True, info={"tool_calls": 0, "tool_errors": 0, "tests_passed": 0})


def test_python_test_columns():
    assert parse_tests("assert f(1) == 1\nassert f(2) == 2\n") == ["assert f(1) == 1", "assert f(2) == 2"]
    assert parse_tests('["assert f(1)"]') == parse_tests(["assert f(1)"]) == ["assert f(1)"]
    with pytest.raises(ValueError, match="non-empty list of assert statements"):
        parse_tests([])


# ------------------------------------------------------------------------------------------------ verl_tools
TOOL_MODULE = '''
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Lookup(BaseTool):
    """Answers with the row's create_kwargs secret; rewards each call with 0.5."""
    async def create(self, instance_id=None, create_kwargs=None, **kw):
        self.secret = (create_kwargs or {}).get("secret")
        return "id-1", ToolResponse()
    async def execute(self, instance_id, parameters, **kw):
        return ToolResponse(text=f"{parameters['key']}={self.secret}"), 0.5, {}
'''
TOOL_CONFIG = '''
tools:
  - class_name: verl_lookup_tool.Lookup
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: lookup
        description: Look a key up.
        parameters: {type: object, properties: {key: {type: %s}}, required: [key]}
'''


def test_verl_tools_runs_a_verl_tool_config_and_dataset_columns(tmp_path, monkeypatch, capsys):
    (tmp_path / "verl_lookup_tool.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tools.yaml").write_text(TOOL_CONFIG % "string")
    scored = []

    def reward_fn(data_source, solution, ground_truth, extra_info):
        scored.append((data_source, solution, ground_truth))
        return 1.0

    env = load_environment("verl_tools")({}, context(tmp_path, reward_fn=reward_fn,
                                                        tool_config=tmp_path / "tools.yaml"))
    r = {**row("42"), "agent_name": "tool_agent",
         "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"secret": "s3"}}}}}
    env.reset(r)
    assert [t["function"]["name"] for t in env.tools()] == ["lookup"]
    step = env.step(call("lookup", key="k") + call("nope"))  # verl's max_parallel_calls 1: the second is dropped
    assert step == Step([{"role": "tool", "content": "k=s3"}], reward=0.0, done=False,
                        info={"tool_calls": 1, "tool_errors": 0, "tool_reward": 0.5})
    assert env.step("The answer is 42").reward == 1.0 and scored == [("test", "The answer is 42", "42")]
    (tmp_path / "bad.yaml").write_text(TOOL_CONFIG % "strng")
    with pytest.raises(BlueprintError, match=r"tools\[0\].tool_schema: function.parameters is not a valid JSON"):
        load_environment("verl_tools")({"tool_config": str(tmp_path / "bad.yaml")}, context(tmp_path, reward_fn=len))
