"""`python`: code execution with a test-based reward.

Dataset rows: verl's RL columns; the tests are ``reward_model.ground_truth`` (where a reward function finds the
answer, so the same file also serves single-turn rollouts): a list of assert statements (each item one test, a
line or a block), or that list as a JSON string, or one string of assert lines (one test a line).

The tool ``python(code)`` runs the code in the sandbox (verlflow.core.agent.sandbox: its own process and folder,
no network, no new process, limits below) and answers with its stdout and stderr, or the limit it hit, cut at
``max_output_chars``. A bare body (``<tool_call>print(2**10)</tool_call>``, not JSON) is taken as the code.

A turn without a call is the final answer: the last fenced code block (```python ... ```, or a bare ``` block)
runs in the sandbox followed by the tests, each on its own: the reward is the share that pass; done. A test
passes when it raises nothing; the harness reports each pass on a descriptor of its own with a random tag the
code never sees in its text, so printing or exiting early earns nothing (code that digs the tag out of the
interpreter's frames could forge it: the sandbox is not a boundary against that, see sandbox_child.py).

Config (defaults): ``cpu_s`` 5, ``memory_mb`` 512, ``wall_s`` 10 (each also at most 0.9 x
rollout.agent.tool_timeout_s, so the environment answers before the loop times the call out),
``max_output_chars`` 2000.
"""

import json
import re
import secrets
from pathlib import Path

from verlflow.core.agent.env import Environment, Step, column
from verlflow.core.agent.registry import register_environment
from verlflow.core.agent.sandbox import run_python
from verlflow.core.agent.toolcalls import parse_tool_calls

SCHEMA = {"type": "function", "function": {
    "name": "python",
    "description": "Run Python code (standard library only) in a sandbox without network or files outside its "
                   "folder; returns what it prints (stdout and stderr).",
    "parameters": {"type": "object", "properties": {"code": {
        "type": "string", "description": "The program to run."}}, "required": ["code"]},
}}
_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def parse_tests(value) -> list[str]:
    """The tests of a row's ground truth (see the module's doc); ValueError when there are none."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = json.loads(text)
        else:
            value = [line for line in text.splitlines() if line.strip()]
    tests = [t for t in (list(value) if not isinstance(value, (str, bytes, dict)) else []) if isinstance(t, str)]
    if not tests or len(tests) != len(value):
        raise ValueError("python: reward_model.ground_truth must be a non-empty list of assert statements "
                         f"(or a JSON string of one), got {str(value)[:200]!r}")
    return tests


def final_code(text: str) -> str | None:
    """The last fenced code block of an answer."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def harness(code: str, tests: list[str], tag: str) -> str:
    """The solution, then each test on its own. The solution's stdout goes to a file in its folder; a pass is
    written to the descriptor saved before, as `tag index`."""
    head = ("import os\n_verlflow_fd = os.dup(1)\n"
            "os.dup2(os.open('stdout.txt', os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)\n")
    runner = (f"\nfor _verlflow_i, _verlflow_t in enumerate({tests!r}):\n"
              "    try:\n        exec(_verlflow_t, globals())\n    except BaseException:\n        continue\n"
              f"    __import__('os').write(_verlflow_fd, ('{tag} %d\\n' % _verlflow_i).encode())\n")
    return head + code + "\n" + runner


@register_environment("python")
class Python(Environment):
    required_columns = ("prompt", "reward_model.ground_truth")

    def __init__(self, config: dict, context):
        super().__init__(config, context)
        cap = 0.9 * float(context.tool_timeout_s)
        self.limits = {"cpu_s": min(float(self.config.get("cpu_s", 5)), cap),
                       "memory_mb": int(self.config.get("memory_mb", 512)),
                       "wall_s": min(float(self.config.get("wall_s", 10)), cap),
                       "scratch": Path(context.scratch) / "python-env"}
        self.max_output = int(self.config.get("max_output_chars", 2000))
        self.tests: list[str] = []

    def tools(self) -> list[dict]:
        return [SCHEMA]

    def reset(self, row: dict) -> list[dict]:
        self.tests = parse_tests(column(row, "reward_model.ground_truth"))
        return super().reset(row)

    def step(self, model_text: str) -> Step:
        calls, errors = parse_tool_calls(model_text, bare_call=("python", "code"))
        if calls or errors:
            return self._tool_turn(calls, errors)
        code = final_code(model_text)
        if code is None:
            return Step(None, reward=0.0, done=True, info={"tool_calls": 0, "tool_errors": 0, "tests_passed": 0})
        passed = self.score(code)
        return Step(None, reward=passed / len(self.tests), done=True,
                    info={"tool_calls": 0, "tool_errors": 0, "tests_passed": passed})

    def score(self, code: str) -> int:
        """How many of the row's tests `code` passes."""
        tag = secrets.token_hex(16)
        result = run_python(harness(code, self.tests, tag), **self.limits, output_cap=64 * len(self.tests))
        return len({line for line in result.stdout.splitlines() if line.startswith(tag + " ")})

    def _tool_turn(self, calls, errors) -> Step:
        answers = [f"Error: {e}" for e in errors]
        failed = len(errors)
        for call in calls:
            code = call.arguments.get("code")
            if call.name != "python" or not isinstance(code, str):
                answers.append(f"Error: the only tool is python(code: string), got {call.name}({call.arguments})"[:500])
                failed += 1
                continue
            result = run_python(code, **self.limits, output_cap=self.max_output)
            answers.append(result.describe(self.max_output))
            failed += not result.ok
        return Step("\n".join(answers), info={"tool_calls": len(answers), "tool_errors": failed})
