"""rollout.mode agent: is its environment usable with this blueprint's data and model? Each problem is one line
naming the field, the file and the fix.

- `agent_problems` (the cheap tier: no torch, transformers or verl import for the built-in environments): the
  environment resolves, is built from rollout.agent.config, its tool schemas are valid JSON Schema, and every
  row of data.train_files and eval.files holds the columns it reads (`Environment.required_columns`).
- `tool_template_problems` (the tokenizer's tier, validate stage): the model's chat template renders the tools
  and a `tool` message, which an agent rollout feeds it.
"""

import inspect
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from verlflow.core.errors import VerlflowError

# A tool and a tool result only a template that renders both shows: the probe of tool support.
PROBE_TOOL = {"type": "function", "function": {
    "name": "verlflow_probe_tool", "description": "A probe of the chat template's tool support.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
PROBE_RESULT = "verlflow-probe-tool-result-31337"
PROBE_CONVERSATION = [
    {"role": "user", "content": "Call the probe tool."},
    {"role": "assistant", "content": "Calling the tool."},  # not naming it: the name must come from `tools`
    {"role": "tool", "content": PROBE_RESULT},
]


def agent_problems(bp) -> list[str]:
    """What an agent rollout would refuse of the blueprint's environment and datasets (empty: single mode)."""
    if bp.rollout.mode != "agent":
        return []
    from verlflow.core.agent.registry import load_environment

    agent = bp.rollout.agent
    try:
        cls = load_environment(agent.environment, agent.module)
    except VerlflowError as e:
        return [str(e)]
    problems = []
    if agent.tool_config and not Path(agent.tool_config).is_file():
        problems.append(f"rollout.agent.tool_config: {agent.tool_config} does not exist; give a verl tool config "
                        "YAML (tools: [{class_name, config, tool_schema}]) or drop the field.")
    else:
        problems += tool_schema_problems(cls, bp)
    for field, files in (("data.train_files", bp.data.train_files), ("eval.files", bp.eval.files)):
        problems += column_problems(cls, files, field)
    return problems


def environment_tools(bp) -> list[dict] | None:
    """The tool schemas the blueprint's environment gives the chat template (None: no tools, or single mode);
    call after agent_problems found none."""
    if bp.rollout.mode != "agent":
        return None
    from verlflow.core.agent.registry import load_environment

    agent = bp.rollout.agent
    with _environment(load_environment(agent.environment, agent.module), bp) as env:
        return env.tools() or None


# ----------------------------------------------------------------------------------------------- tool schemas


def tool_schema_problems(cls, bp) -> list[str]:
    """The environment built as a rollout builds it, and each schema of its tools() checked
    (verlflow.core.agent.toolcalls.check_tool_schema)."""
    from verlflow.core.agent.toolcalls import check_tool_schema

    agent = bp.rollout.agent
    source = (f"rollout.agent.tool_config {agent.tool_config}" if agent.tool_config else
              f"rollout.agent.environment {agent.environment} ({_source_file(cls)})")
    try:
        with _environment(cls, bp) as env:
            tools = env.tools()
    except VerlflowError as e:  # the environment's own refusal names its field
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - whatever it raises, every trajectory of the rollout would raise
        return [f"rollout.agent.config: environment {agent.environment} ({_source_file(cls)}) raised while being "
                f"built from rollout.agent.config={agent.config} or listing its tools: {type(e).__name__}: {e}. "
                "Fix the config (or the environment)."]
    if not isinstance(tools, list):
        return [f"{source}: tools() returned {type(tools).__name__}, not a list of OpenAI function schemas."]
    problems = []
    for i, schema in enumerate(tools):
        try:
            check_tool_schema(schema, f"{source}: tool {i}")
        except VerlflowError as e:
            problems.append(str(e))
    return problems


@contextmanager
def _environment(cls, bp) -> Iterator[Any]:
    """One instance of the environment, as the rollout builds it (scratch: a folder removed afterwards)."""
    from verlflow.core.agent.env import EnvContext

    agent = bp.rollout.agent
    config = dict(agent.config)
    if agent.tool_config:
        config.setdefault("tool_config", agent.tool_config)
    with tempfile.TemporaryDirectory(prefix="verlflow-check-") as scratch:
        env = cls(config, EnvContext(tool_timeout_s=agent.tool_timeout_s, reward_fn=_reward_fn(bp),
                                     scratch=Path(scratch),
                                     tool_config=Path(agent.tool_config) if agent.tool_config else None))
        try:
            yield env
        finally:
            env.close()


def _reward_fn(bp):
    """reward.function, as the rollout hands it to environments (None when unused or unusable: the reward checks
    name why)."""
    from verlflow.core.ml.rewards import load_reward

    if not bp.reward.uses_function:
        return None
    try:
        return load_reward(bp.reward.function, bp.reward.module)
    except VerlflowError:
        return None


def _source_file(cls) -> str:
    try:
        return inspect.getsourcefile(cls) or cls.__module__
    except TypeError:
        return cls.__module__


# ---------------------------------------------------------------------------------------------------- columns


def column_problems(cls, files: list[str], field: str) -> list[str]:
    """Each file of `field` whose rows lack a column of cls.required_columns (dotted: a nested struct field): the
    file, the first row and the column. verl's own columns (the prompt, which the rollout hands the environment as
    `prompt`, data_source, reward_model.ground_truth) and files that are missing or unreadable are the data checks'
    to name (core/ml/data.py)."""
    import pyarrow.parquet as pq

    from verlflow.core.ml.data import REQUIRED

    checked = {"prompt", *REQUIRED, "reward_model.ground_truth"}
    wanted = [c for c in cls.required_columns if c not in checked]
    if not wanted:
        return []
    problems = []
    for i, f in enumerate(files):
        try:
            schema = pq.read_schema(f)
        except Exception:  # noqa: BLE001 - missing_file_problems / load_prompts name it
            continue
        where = f"{field}[{i}]: {f}"
        absent = [c for c in wanted if not _in_schema(schema, c)]
        if absent:
            problems.append(f"{where} has no column {', '.join(absent)}, which rollout.agent.environment "
                            f"{cls.__name__} reads ({cls.__name__}.required_columns = {list(cls.required_columns)}); "
                            "add it to every row.")
            continue
        table = pq.read_table(f, columns=sorted({c.split(".")[0] for c in wanted}))
        for column in wanted:
            empty = [r for r, value in enumerate(_values(table, column)) if value is None]
            if empty:
                problems.append(f"{where} row {empty[0]} has no value in column {column} ({len(empty)} of "
                                f"{table.num_rows} rows), which rollout.agent.environment {cls.__name__} reads; "
                                "fill it in every row or drop those rows.")
    return problems


def _in_schema(schema, dotted: str) -> bool:
    import pyarrow as pa

    head, *rest = dotted.split(".")
    if head not in schema.names:
        return False
    kind = schema.field(head).type
    for part in rest:
        if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
            return False
        kind = kind.field(part).type
    return True


def _values(table, dotted: str) -> list:
    head, *rest = dotted.split(".")
    out = []
    for value in table.column(head).to_pylist():
        for part in rest:
            value = value.get(part) if isinstance(value, dict) else None
        out.append(value)
    return out


# ------------------------------------------------------------------------------------------------- chat template


def tool_template_problems(bp, tok) -> list[str]:
    """model.path's chat template must render a tool's schema and a `tool` message (the agent rollout's prompt and
    observations): a probe conversation with a sentinel tool and result, refused when rendering raises or drops
    either."""
    if bp.rollout.mode != "agent":
        return []
    where = f"model.path: the chat template in {_template_file(Path(bp.model.path))}"
    fix = ("use a model whose template renders `tools` and the `tool` role (e.g. Qwen2.5-Instruct's), or set the "
           "tokenizer's chat_template to one that does")
    try:
        text = tok.apply_chat_template(PROBE_CONVERSATION, tools=[PROBE_TOOL], add_generation_prompt=True,
                                       tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template that raises on tools or the tool role lacks the support
        return [f"{where} raised on a conversation with a tool and a tool message ({type(e).__name__}: {e}); "
                f"rollout.mode=agent needs both: {fix}."]
    dropped = [what for what, sentinel in (("the tools (rendered with tools=[...])", "verlflow_probe_tool"),
                                           ("a tool message (role tool)", PROBE_RESULT)) if sentinel not in text]
    if dropped:
        return [f"{where} does not render {' nor '.join(dropped)}: the model would never see its tools or their "
                f"results in rollout.mode=agent; {fix}."]
    return []


def _template_file(model_dir: Path) -> Path:
    jinja = model_dir / "chat_template.jinja"
    return jinja if jinja.is_file() else model_dir / "tokenizer_config.json"
