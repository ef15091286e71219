"""`verl_tools`: verl's tools and dataset columns, so a verl tool-agent dataset runs unchanged.

It reads verl's tool config file (``rollout.agent.tool_config``, or ``tool_config`` in ``rollout.agent.config``)::

    tools:
      - class_name: mypkg.tools.MyTool        # a verl BaseTool subclass
        config: {type: native, ...}           # handed to the tool's constructor
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

and calls each tool as verl 0.9.1's ``ToolAgentLoop`` does: per call ``create(create_kwargs=...)``, ``execute``,
``release``, with ``create_kwargs`` from the row's ``extra_info.tools_kwargs[tool name]``; ``extra_info.tool_selection``
narrows a row's tools. The tool's text answer is the observation (cut like verl's
``max_tool_response_length``/``tool_response_truncate_side``); calls past ``max_parallel_calls`` are dropped, as in
verl. A turn without a call is the final answer, scored by the blueprint's ``reward.function``
(data_source, answer, reward_model.ground_truth, extra_info); done.

Not carried over: verl's loop never calls ``calc_reward`` and keeps ``execute``'s step rewards out of the score;
so does this (they are summed in the step's info as ``tool_reward``; ``add_tool_rewards: true`` adds them to the
turn's reward). ``execute`` gets no ``agent_data`` (a tool that reads it fails, as a tool error). ``agent_name``
(every row runs the blueprint's environment) and ``interaction_kwargs`` (verl 0.9.1 has no interactions) are
accepted and ignored; ``type`` must be ``native`` (the only type verl 0.9.1 knows); function tools
(``function_tool_path``) are not read; the YAML is read as plain YAML (verl's OmegaConf would also resolve
``${...}`` interpolations).

verl is imported when the first environment is built (it imports torch): a rank has it loaded already. The
tools are built once per config file and shared by every trajectory, their coroutines running on one event loop
on a thread of its own, as verl's loop shares them.
"""

import asyncio
import importlib
import threading
from pathlib import Path
from typing import Any

from verlflow.core.agent.env import Environment, Step, column
from verlflow.core.agent.registry import register_environment
from verlflow.core.agent.toolcalls import check_tool_schema, parse_tool_calls
from verlflow.core.errors import BlueprintError

_LOCK = threading.Lock()
_TOOLS: dict[str, dict[str, Any]] = {}  # tool config path -> {tool name: tool}
_LOOP: list[asyncio.AbstractEventLoop] = []


def load_tools(path: str | Path) -> dict[str, Any]:
    """The tools of a verl tool config file, built once per file; errors name the file and the field."""
    key = str(Path(path).resolve())
    with _LOCK:
        if key not in _TOOLS:
            _TOOLS[key] = _build_tools(Path(path))
        return _TOOLS[key]


def tool_schemas(path: str | Path) -> list[dict]:
    """The OpenAI schemas of a tool config's tools (validate checks them)."""
    return [schema_of(t) for t in load_tools(path).values()]


def schema_of(tool) -> dict:
    return tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)


@register_environment("verl_tools")
class VerlTools(Environment):
    required_columns = ("prompt", "data_source", "reward_model.ground_truth")

    def __init__(self, config: dict, context):
        super().__init__(config, context)
        path = self.config.get("tool_config") or context.tool_config
        if not path:
            raise BlueprintError("rollout.agent.tool_config: environment verl_tools needs verl's tool config file "
                                 "(a YAML with a `tools:` list); set rollout.agent.tool_config: path/to/tools.yaml.")
        if context.reward_fn is None:
            raise BlueprintError("reward.function: environment verl_tools scores the final answer with the "
                                 "blueprint's reward function; set reward.function.")
        self.all_tools = load_tools(path)
        self.active = dict(self.all_tools)
        self.max_parallel = int(self.config.get("max_parallel_calls", 1))
        self.max_chars = int(self.config.get("max_tool_response_length", 256))
        self.side = str(self.config.get("tool_response_truncate_side", "middle"))
        self.add_tool_rewards = bool(self.config.get("add_tool_rewards", False))
        self.row: dict = {}
        self.tools_kwargs: dict = {}

    def tools(self) -> list[dict]:
        return [schema_of(t) for t in self.active.values()]

    def reset(self, row: dict) -> list[dict]:
        self.row = row
        extra = row.get("extra_info") or {}
        self.tools_kwargs = dict(extra.get("tools_kwargs") or {})
        selection = extra.get("tool_selection")
        if selection is not None and len(selection):
            self.active = {n: t for n, t in self.all_tools.items() if n in set(selection)}
        return super().reset(row)

    def step(self, model_text: str) -> Step:
        calls, errors = parse_tool_calls(model_text)
        if not calls and not errors:
            score = self.context.reward_fn(self.row["data_source"], model_text,
                                           column(self.row, "reward_model.ground_truth"), self.row.get("extra_info"))
            return Step(None, reward=float(score), done=True, info={"tool_calls": 0, "tool_errors": 0})
        answers = [(f"Error: {e}", 0.0, True) for e in errors]
        answers += [self._call(c.name, c.arguments) for c in calls[: self.max_parallel]]
        tool_reward = sum(r for _, r, _ in answers)
        return Step([{"role": "tool", "content": text} for text, _, _ in answers],
                    reward=tool_reward if self.add_tool_rewards else 0.0,
                    info={"tool_calls": len(answers), "tool_errors": sum(e for _, _, e in answers),
                          "tool_reward": tool_reward})

    def _call(self, name: str, arguments: dict) -> tuple[str, float, bool]:
        """(the answer's text, the tool's step reward, whether it failed)."""
        tool = self.active.get(name)
        if tool is None:
            return f"Unknown function '{name}'. Available tools: {list(self.active)}", 0.0, True
        create_kwargs = (self.tools_kwargs.get(name) or {}).get("create_kwargs", {})
        try:
            text, reward = asyncio.run_coroutine_threadsafe(_execute(tool, arguments, create_kwargs), _loop()).result()
        except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation, as in verl
            return f"Error executing tool '{name}': {e}", 0.0, True
        return self._cut(text or ""), float(reward or 0.0), False

    def _cut(self, text: str) -> str:
        n = self.max_chars
        if len(text) <= n:
            return text
        if self.side == "left":
            return "(truncated)..." + text[-n:]
        if self.side == "right":
            return text[:n] + "...(truncated)"
        return text[: n // 2] + "...(truncated)..." + text[-(n // 2):]


async def _execute(tool, arguments: dict, create_kwargs: dict) -> tuple[str, float]:
    instance_id, _ = await tool.create(create_kwargs=create_kwargs)
    try:
        response, reward, _metrics = await tool.execute(instance_id, arguments)
    finally:
        await tool.release(instance_id)
    return getattr(response, "text", None) or "", reward


def _loop() -> asyncio.AbstractEventLoop:
    with _LOCK:
        if not _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="verl-tools-loop").start()
            _LOOP.append(loop)
        return _LOOP[0]


def _build_tools(path: Path) -> dict[str, Any]:
    where = f"rollout.agent.tool_config ({path})"
    if not path.is_file():
        raise BlueprintError(f"{where}: no such file. Point rollout.agent.tool_config at verl's tool config YAML.")
    import yaml

    from verl.tools.schemas import OpenAIFunctionToolSchema  # lazy: `import verl` imports torch

    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise BlueprintError(f"{where}: not valid YAML: {e}") from None
    entries = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BlueprintError(f"{where}: expected a `tools:` list of {{class_name, config, tool_schema}}.")
    tools: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        tool = _build_tool(entry, f"{where}: tools[{i}]", OpenAIFunctionToolSchema)
        if tool.name in tools:
            raise BlueprintError(f"{where}: tools[{i}]: a second tool named {tool.name!r}; tool names must differ.")
        tools[tool.name] = tool
    return tools


def _build_tool(entry: Any, where: str, schema_type) -> Any:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str) or "." not in entry["class_name"]:
        raise BlueprintError(f"{where}: needs class_name: package.module.ToolClass, got {entry!r:.200}")
    config = dict(entry.get("config") or {})
    if config.get("type", "native") != "native":
        raise BlueprintError(f"{where}.config.type: {config.get('type')!r}; verl 0.9.1 knows only 'native' tools.")
    schema = entry.get("tool_schema")
    if schema is not None:
        check_tool_schema(schema, f"{where}.tool_schema")
        schema = schema_type.model_validate(schema)
    module, _, name = entry["class_name"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise BlueprintError(f"{where}.class_name: cannot import {entry['class_name']!r}: {e}") from e
    tool = cls(config=config, tool_schema=schema)
    check_tool_schema(schema_of(tool), f"{where}: the schema of {entry['class_name']}")
    return tool
