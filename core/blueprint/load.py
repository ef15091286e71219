"""Loading a blueprint: YAML (bounded before anything expands it) -> `a.b=value` overrides -> validation -> paths
resolved against the file's folder; errors name the YAML line or the override."""

import difflib
import json
import posixpath
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import SkipJsonSchema

from verlflow.core.blueprint.blueprint import Blueprint, _plain
from verlflow.core.errors import BlueprintError
from verlflow.core.uris import carries_credentials


def _line_map(root: yaml.Node | None, duplicates: list | None = None) -> dict[tuple, int]:
    """Maps a YAML path (tuple of keys/indices) to its 1-based line, from the composed document (`_parse_yaml`,
    which bounds its expansion). Keys repeated in one mapping (which YAML silently collapses to the last) are
    appended to `duplicates` as (path, first, again)."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for k, v in node.value:
                if duplicates is not None and isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        duplicates.append((path + (k.value,), seen[k.value], k.start_mark.line + 1))
                    seen.setdefault(k.value, k.start_mark.line + 1)
                lines[path + (k.value,)] = k.start_mark.line + 1
                walk(v, path + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


# What a blueprint may be: a YAML file of a few KB holds a few hundred values. Bounded before anything expands it
# (the line map, json.dumps, pydantic): a few KB of nested aliases (a "billion laughs") would otherwise expand to
# billions of values. A big prompt or dataset belongs in a file the blueprint names.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 20_000


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that stops composing once the document has MAX_YAML_VALUES nodes (the parser reads events
    lazily: a long list is not read to its end)."""

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self.source, self.nodes = source, 0

    def compose_node(self, parent, index):
        self.nodes += 1
        if self.nodes > MAX_YAML_VALUES:
            raise BlueprintError(f"{self.source}:{self.peek_event().start_mark.line + 1}: the YAML holds more than "
                                 f"{MAX_YAML_VALUES:,} values (no more are read); a blueprint holds a few hundred. "
                                 "Keep long lists in the files the blueprint names (data.train_files, eval.files).")
        return super().compose_node(parent, index)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """(data, root node) of one YAML document with yaml.safe_load's rules (yaml.YAMLError as it raises them),
    refusing (BlueprintError) a text over MAX_YAML_BYTES or one that expands to over MAX_YAML_VALUES values, aliases
    counted each time they are used, before anything is built from it."""
    if len(text) > MAX_YAML_BYTES:  # characters: at least as many bytes
        raise BlueprintError(f"{source}: {len(text):,} characters of YAML; a blueprint is a few KB and at most "
                             f"{MAX_YAML_BYTES:,} are read. Keep prompts and data in the files it names "
                             "(data.train_files, eval.files).")
    loader = _BoundedLoader(text, source)
    try:
        try:
            root = loader.get_single_node()  # aliases are shared nodes here: nothing is expanded yet
        except RecursionError:
            raise BlueprintError(f"{source}: the YAML is nested too deeply to read; a blueprint nests a few "
                                 "levels (section: field: value).") from None
        _refuse_expansion(root, source)
        return (None if root is None else loader.construct_document(root)), root
    finally:
        loader.dispose()


def _refuse_expansion(root: yaml.Node | None, source: str) -> None:
    """BlueprintError when the document would hold over MAX_YAML_VALUES values with its aliases expanded, or an
    alias inside the value it names (a cycle). Each node's expanded size is computed once, so a bomb costs what
    its text does."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # the nodes whose values are being counted: the path from the root
    aliased = 0
    stack = [(root, False)] if root is not None else []
    while stack:  # depth first, without recursion
        node, counted = stack.pop()
        if counted:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(k)] for k in _children(node))
        elif id(node) in open_:
            raise BlueprintError(f"{source}:{node.start_mark.line + 1}: an alias (*name) inside the value it names "
                                 "makes a value that holds itself; a blueprint is a tree: write the value out.")
        elif id(node) in sizes:
            aliased += 1  # reached again: an alias repeats it
        else:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node))
    total = sizes.get(id(root), 0)
    if total <= MAX_YAML_VALUES:
        return
    raise BlueprintError(f"{source}: the YAML would expand to {total:,} values (at most {MAX_YAML_VALUES:,} are read): "
                         f"its aliases (*name) repeat anchored (&name) values {aliased:,} times, nested into one "
                         "another. A blueprint holds a few hundred values: write out what an alias stands for, or "
                         "nest fewer aliases.")


def _allowed(loc: tuple) -> str:
    """What keys are allowed at the model that holds `loc`."""
    model: Any = Blueprint
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    names = [n for n, f in model.model_fields.items() if not any(isinstance(m, SkipJsonSchema) for m in f.metadata)]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Allowed keys here: {', '.join(names)}."


def _yaml_kind(value: Any) -> str:
    kinds = {dict: "a YAML mapping", list: "a YAML list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "an empty value"}
    return kinds.get(type(value), type(value).__name__)


def _path_in(message: str) -> tuple:
    """`phases[1].init_from: ...` -> ("phases", 1, "init_from"): the field a cross-field message starts with."""
    m = re.match(r"([A-Za-z_]+(?:\[\d+\])?(?:\.[A-Za-z_]+(?:\[\d+\])?)*)", message)
    if not m:
        return ()
    return tuple(int(p) if p.isdigit() else p for p in re.findall(r"[A-Za-z_]+|\d+", m.group(1)))


def _line_of(loc: tuple, lines: dict[tuple, int]) -> int | None:
    return next((lines[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in lines), None)


def format_validation_error(err: ValidationError, source: str, lines: dict[tuple, int],
                            overridden: dict[tuple, str] | None = None) -> str:
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:  # a cross-field rule: its message names the fields itself (the first one gives the line)
            for part in msg.split("\n"):  # one problem a line (a validator may join several)
                # a phase's problem names its field first (phases[1].init_from): that line; other rules weigh
                # several fields, where one line would mislead
                line = _line_of(_path_in(part), lines) if part.startswith("phases[") else None
                out.append(f"{source}:{line}: {part}" if line else f"{source}: {part}")
            continue
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        line = next((lines[loc[:i]] for i in range(len(loc), -1, -1) if loc[:i] in lines), None)
        where = f"{source}:{line}" if line else source
        # A value that came from a command-line override is reported as that override, not as a file line.
        hit = [p for p in (overridden or {}) if loc[:len(p)] == p or p[:len(loc)] == loc]
        if hit:
            where = f"override '{overridden[max(hit, key=len)]}'"
        if e["type"] == "extra_forbidden":
            msg = f"unknown key '{loc[-1]}'.{_allowed(loc)}"
        elif e["type"] == "model_type":
            msg = f"must be a mapping of fields (key: value lines), not {_yaml_kind(e.get('input'))}." \
                  f"{_allowed(loc + ('',))}"
        elif isinstance(e.get("input"), (dict, list)):
            if e["type"].endswith("_type"):
                quote = "; quote the value if it is text, e.g. 'a: b'" if e["type"] == "string_type" else ""
                msg = f"{msg} (got {_yaml_kind(e['input'])}{quote})"
        elif "input" in e and e["type"] not in ("missing",):
            msg = f"{msg} (got {e['input']!r})"
        out.append(f"{where}: {field}: {msg}")
    return "Blueprint is not valid:\n  " + "\n  ".join(out)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text or text.startswith("="):
        raise BlueprintError(f"override '{text}' must look like section.field=value, e.g. rollout.n=8")
    key, raw = text.split("=", 1)
    if any(not part.strip() for part in key.split(".")):
        raise BlueprintError(f"override '{text}': the key '{key}' has an empty part; write section.field=value, "
                             "e.g. rollout.n=8")
    try:
        value = _parse_yaml(raw, f"override '{text}'")[0] if raw != "" else ""
    except yaml.YAMLError as e:
        raise BlueprintError(f"override '{text}': value is not valid YAML ({getattr(e, 'problem', e)}); quote "
                             "strings with special characters, e.g. model.path='/a b/c'") from None
    return [part.strip() for part in key.split(".")], value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise BlueprintError(f"override '{text}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def resolve_paths(bp: Blueprint, base: Path | str) -> Blueprint:
    """Relative paths in a blueprint file are relative to the file's folder: a local folder, or for a blueprint
    read from a URI (s3://bucket/exp/bp.yaml) that URI's folder (model.path: m -> s3://bucket/exp/m)."""

    def fix(p: str) -> str:
        if "://" in p or Path(p).is_absolute():
            return p
        if isinstance(base, str):
            scheme, folder = base.split("://", 1)
            return f"{scheme}://{posixpath.normpath(posixpath.join(folder, p))}"
        return str((base / p).resolve())

    bp.model.path = fix(bp.model.path)
    bp.data.train_files = [fix(p) for p in bp.data.train_files]
    bp.eval.files = [fix(p) for p in bp.eval.files]
    bp.storage.uri = fix(bp.storage.uri)
    if bp.reward.model is not None:
        bp.reward.model.path = fix(bp.reward.model.path)
    if bp.rollout.agent is not None and bp.rollout.agent.tool_config:
        bp.rollout.agent.tool_config = fix(bp.rollout.agent.tool_config)
    for ph in bp.phases:
        if ph.data is not None:
            ph.data.train_files = [fix(p) for p in ph.data.train_files]
    return bp


def _blueprint_text(path: str | Path) -> tuple[str, Path | str]:
    """A blueprint file's text and the folder its relative paths are relative to. `path` is a local file,
    `file://...`, or any other fsspec URI such as s3://bucket/exp/bp.yaml (read in memory: no temp file)."""
    path = str(path).removeprefix("file://")
    if "://" in path:
        if carries_credentials(path):  # the URI itself is not repeated: it holds a secret
            raise BlueprintError("the blueprint URI must not carry credentials (s3://key:secret@bucket/bp.yaml); use "
                                 "s3://bucket/bp.yaml and set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the "
                                 "environment (or a Prefect Secret).")
        return _remote_text(path), path.rsplit("/", 1)[0]
    p = Path(path)
    if not p.is_file():
        raise BlueprintError(f"{path}: no such blueprint file. Pass a YAML file, e.g. blueprints/tiny-cpu.yaml.")
    return _decode(path, p.read_bytes()), p.resolve().parent


def _remote_text(uri: str) -> str:
    import fsspec

    try:
        with fsspec.open(uri, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise BlueprintError(f"{uri}: no such blueprint file; check the bucket and key.") from None
    except Exception as e:  # credentials, endpoint, unknown scheme: the library's own words
        raise BlueprintError(f"{uri}: cannot read the blueprint ({type(e).__name__}: {e}); check the URI, and the "
                             "store's credentials and endpoint in the environment (AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).") from None
    return _decode(uri, raw)


def _decode(source: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BlueprintError(f"{source}: not a UTF-8 text file; a blueprint is a YAML file "
                             "(e.g. blueprints/tiny-cpu.yaml).") from None


def load_blueprint(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> Blueprint:
    """Blueprint from a YAML file (a path or an fsspec URI such as s3://bucket/bp.yaml) or a dict, with `a.b=value`
    overrides applied."""
    lines: dict[tuple, int] = {}
    source = "<blueprint>"
    base = Path.cwd()
    if path is not None:
        source = str(path)
        text, base = _blueprint_text(path)
        try:
            data, root = _parse_yaml(text, source)
        except yaml.YAMLError as e:
            mark, cmark = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            what = getattr(e, "problem", None) or str(e)
            context = getattr(e, "context", None)
            if context:  # e.g. "while parsing a flow sequence (line 5), expected ',' or ']', but got ..."
                at = f" (line {cmark.line + 1})" if cmark and (not mark or cmark.line != mark.line) else ""
                what = f"{context}{at}, {what}"
            raise BlueprintError(
                f"{where}: not valid YAML: {what}. Only plain YAML is accepted "
                "(no !!python tags); check indentation and quoting."
            ) from None
        duplicates: list = []
        lines = _line_map(root, duplicates)
        if duplicates:
            raise BlueprintError("\n  ".join(
                f"{source}:{again}: {'.'.join(map(str, key))}: duplicate key (first given on line {first}); "
                "YAML would silently keep only the last one: keep one of them." for key, first, again in duplicates))
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise BlueprintError(f"{source}: the top level must be a mapping of sections (model:, data:, ...).")
    # default=str: YAML dates, sets and binary become strings that fail validation with a clear message.
    data = apply_overrides(json.loads(json.dumps(data, default=str)), list(overrides))
    overridden = {}
    for text in overrides:
        overridden[tuple(parse_override(text)[0])] = text
    try:
        bp = Blueprint.model_validate(data)
    except ValidationError as e:
        raise BlueprintError(format_validation_error(e, source, lines, overridden)) from None
    try:
        return resolve_paths(bp, base)
    except ValidationError as e:  # e.g. storage.uri: ../../x relative to s3://bucket/bp.yaml climbs above the bucket
        raise BlueprintError(f"{source}: a path relative to the blueprint's folder ({base}) is not usable once "
                             f"resolved: {_plain(e)}.") from None


def json_schema() -> dict:
    return Blueprint.model_json_schema()
