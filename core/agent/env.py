"""The environment API that an agent rollout calls on a rank: one `Environment` per trajectory.

A rollout in agent mode (``rollout.mode: agent``) builds ``cls(config, context)`` for every trajectory, with
``config`` the blueprint's ``rollout.agent.config`` and ``context`` an `EnvContext`. It then calls ``reset(row)``
once (the prompt's chat messages), ``tools()`` (the OpenAI function schemas the chat template renders), then
``step(model_text)`` after each model turn until a `Step` says ``done`` (or the loop's turn/token budget ends the
trajectory), and ``close()`` last. Each call runs on a thread of its own, one call at a time per environment.

This module imports nothing heavy: environments run on a rank but must not cost torch's import.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional


@dataclass
class Step:
    """What one model turn led to."""

    observation: str | list[dict] | None  # str: one {"role": "tool"} message; list: messages; None: nothing
    reward: float = 0.0  # this turn's reward (placed on the turn's last model token)
    done: bool = False
    # this turn's counts: tool_calls (attempted, malformed ones included), tool_errors (those that failed),
    # tool_timeouts; other keys are kept
    info: dict = field(default_factory=dict)


@dataclass
class EnvContext:
    """What the rollout hands every environment besides its config."""

    tool_timeout_s: float  # one step's wall clock: past it the loop marks the call timed out
    reward_fn: Optional[Callable[..., float]]  # the blueprint's reward.function, loaded (None when unset)
    scratch: Path  # a per-rank folder the environment (and its sandbox) may write in
    tool_config: Optional[Path] = None  # rollout.agent.tool_config: a verl tool config YAML (verl_tools reads it)


class Environment:
    """Base class. Subclasses set `required_columns` and override `tools` and `step` (`reset` and `close` when
    they need more than the defaults)."""

    # The dataset columns reset() reads (validate refuses rows without them); dotted names are nested fields.
    required_columns: ClassVar[tuple[str, ...]] = ("prompt",)

    def __init__(self, config: dict, context: EnvContext):
        self.config = dict(config or {})
        self.context = context

    def tools(self) -> list[dict]:
        """OpenAI function schemas: [{"type": "function", "function": {name, description, parameters}}]."""
        return []

    def reset(self, row: dict) -> list[dict]:
        """The prompt's chat messages (default: the row's ``prompt`` column)."""
        return [dict(m) for m in row["prompt"]]

    def step(self, model_text: str) -> Step:
        """One assistant turn's text (special tokens removed) -> what follows it."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> None:
        """Release what the environment holds; called once, after the last step."""


def column(row: dict, dotted: str) -> Any:
    """The value of a dotted column name (``extra_info.tools_kwargs``) in `row`; KeyError names what is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"dataset row has no column {dotted!r}")
        value = value[part]
    return value
