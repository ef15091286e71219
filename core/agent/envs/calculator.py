"""`calculator`: arithmetic word problems where calling the tool is the way to be right.

Dataset rows: verl's RL columns; ``reward_model.ground_truth`` is the answer, a number (``72``, ``"72"``).

The tool ``calculator(expression)`` evaluates ``+ - * / **`` and parentheses on numbers, by walking the parsed
expression (never ``eval``): anything else (names, calls, attributes) is an error the model sees. Exponents are
at most 64 and results at most 1e100 in size, so no call can take long or eat memory.

A turn with a tool call gets the results as the observation; a bare expression as the call's body
(``<tool_call>3+4</tool_call>``, not JSON) is taken as a call of ``calculator`` with it, for small models. A turn
without a call is the final answer: reward 1.0 when its last number equals the ground truth, else 0.0; done.

Config: ``call_reward`` (default 0.0): the reward of the first turn whose calls all parsed and evaluated, paid
once per trajectory (paid every turn, a policy that cannot yet answer would learn to call until max_turns).
"""

import ast
import math
import operator
import re
from typing import Union

from verlflow.core.agent.env import Environment, Step, column
from verlflow.core.agent.registry import register_environment
from verlflow.core.agent.toolcalls import parse_tool_calls

Number = Union[int, float]
MAX_CHARS, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 1e100
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow}
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")

SCHEMA = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * / ** and parentheses; returns the number.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "The expression, e.g. (12 + 30) * 3"}}, "required": ["expression"]},
}}


class CalcError(ValueError):
    """An expression the calculator refuses; its message is the tool's answer."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; CalcError says why not."""
    text = str(expression).strip()
    if not text or len(text) > MAX_CHARS:
        raise CalcError(f"the expression must be 1 to {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError(f"not an arithmetic expression ({type(e).__name__})") from None
    return _value(tree.body)


def format_number(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(str(text))
    return float(found[-1].replace(",", "")) if found else None


@register_environment("calculator")
class Calculator(Environment):
    required_columns = ("prompt", "reward_model.ground_truth")

    def __init__(self, config: dict, context):
        super().__init__(config, context)
        self.call_reward = float(self.config.get("call_reward", 0.0))
        self.answer: float | None = None
        self.paid = False

    def tools(self) -> list[dict]:
        return [SCHEMA]

    def reset(self, row: dict) -> list[dict]:
        truth = column(row, "reward_model.ground_truth")
        self.answer = last_number(truth)
        if self.answer is None:
            raise ValueError(f"calculator: reward_model.ground_truth must be a number, got {truth!r}")
        return super().reset(row)

    def step(self, model_text: str) -> Step:
        calls, errors = parse_tool_calls(model_text, bare_call=("calculator", "expression"))
        if not calls and not errors:
            guess = last_number(model_text)
            right = guess is not None and math.isclose(guess, self.answer, rel_tol=1e-6, abs_tol=1e-6)
            return Step(None, reward=float(right), done=True, info={"tool_calls": 0, "tool_errors": 0})
        results = [f"Error: {e}" for e in errors] + [self._call(c.name, c.arguments) for c in calls]
        failed = sum(r.startswith("Error:") for r in results)
        reward = 0.0
        if calls and not failed and not self.paid:
            reward, self.paid = self.call_reward, True
        return Step("\n".join(results), reward=reward, info={"tool_calls": len(results), "tool_errors": failed})

    def _call(self, name: str, arguments: dict) -> str:
        if name != "calculator":
            return f"Error: unknown tool {name!r}; the only tool is 'calculator'."
        if not isinstance(arguments.get("expression"), (str, int, float)):
            return "Error: calculator needs an 'expression' (a string)."
        try:
            return format_number(evaluate(str(arguments["expression"])))
        except CalcError as e:
            return f"Error: {e}"


# ---------------------------------------------------------------------------------------------------
def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponents must be at most {MAX_EXPONENT} in size")
        if isinstance(node.op, ast.Pow) and isinstance(right, int) and abs(left) > 1 and \
                math.log10(abs(left)) * abs(right) > 100:
            raise CalcError("the result is too large")
        try:
            return _bounded(_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, ValueError, TypeError):  # e.g. (-8) ** 0.5 is complex
            raise CalcError("the result is not a real number of reasonable size") from None
    raise CalcError("only numbers, + - * / ** and parentheses are allowed")


def _bounded(value) -> Number:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalcError("the result is not a real number of reasonable size")
    return value
