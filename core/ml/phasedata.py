"""The sft and dpo phases' datasets, read with pyarrow and checked row by row: torch-free, so the CLI's preflight
(core/checks/inputs.py missing_inputs) refuses a bad column, type or row with the same rules and words as the phase's
stage, before anything runs. core/ml/sft.py and core/ml/dpo.py encode what these return.
"""

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from verlflow.core.errors import InputError
from verlflow.core.ml import data

# -- sft: conversations -------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant")


@dataclass
class Conversations:
    """Chat messages per row; training starts at message `start[i]` (an assistant turn) and covers every
    assistant turn from there on. `origins` name each row for errors ("<file> row <i>")."""
    messages: list[list[dict]]
    start: list[int]
    origins: list[str]

    def __len__(self) -> int:
        return len(self.messages)

    @classmethod
    def of(cls, messages: list[list[dict]]) -> "Conversations":
        """Plain conversations: training starts at each one's first assistant turn."""
        starts = [next((k for k, m in enumerate(msgs) if m.get("role") == "assistant"), -1) for msgs in messages]
        return cls(list(messages), starts, [f"row {i}" for i in range(len(messages))])


def _message(m, where: str) -> dict:
    """One {role, content} message; parquet structs carry every key any row has, so absent ones (None) go."""
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
        raise InputError(f"{where}: each message must be a {{role, content}} struct of strings (got {m!r}).")
    return {k: v for k, v in m.items() if v is not None}


def _chat(value, where: str) -> list[dict]:
    """A column value as chat messages: a string is one user turn (verl's plain-prompt convention)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not (isinstance(value, list) and value):
        raise InputError(f"{where}: must be a non-empty list of {{role, content}} messages or a string "
                         f"(got {type(value).__name__}).")
    return [_message(m, where) for m in value]


def _row(r: dict, multi_turn: bool, where: str) -> tuple[list[dict], int]:
    """(messages, start) of one parquet row. A `prompt` chat list's own assistant turns (few-shot examples) stay
    context, as in verl's single-turn SFTDataset: only `response` is trained."""
    if multi_turn:
        msgs = _chat(r["messages"], f"{where} `messages`")
        start = next((k for k, m in enumerate(msgs) if m["role"] == "assistant"), -1)
        if start < 0:
            raise InputError(f"{where}: `messages` has no assistant turn (roles {[m['role'] for m in msgs]}); "
                             "SFT trains on assistant turns: add one or drop the row.")
    else:
        resp = r["response"]
        if not isinstance(resp, str) or not resp.strip():
            raise InputError(f"{where}: `response` is empty or not a string ({resp!r}); give the answer text "
                             "or drop the row.")
        msgs = _chat(r["prompt"], f"{where} `prompt`") + [{"role": "assistant", "content": resp}]
        start = len(msgs) - 1
    if start == 0:
        raise InputError(f"{where}: the conversation opens with an assistant turn; it needs a system or user "
                         "turn before it to be the prompt. Add one or drop the row.")
    empty = [k for k, m in enumerate(msgs[start:], start) if m["role"] == "assistant" and not m["content"].strip()]
    if empty:
        raise InputError(f"{where}: assistant message(s) {empty} are empty; give their text or drop the row.")
    return msgs, start


def load_sft_rows(files: list[str], field: str = "phases[0].data.train_files") -> Conversations:
    """The conversations of the parquet `files` (the blueprint's list `field`, which errors name), in verl's SFT
    conventions: a `messages` column (multi-turn, verl's MultiTurnSFTDataset), or `prompt` (string or chat list,
    as verl's RL data stores it) + `response` (string) columns (verl's SFTDataset)."""
    if missing := data.missing_file_problems(files, field):
        raise InputError(" ".join(p.replace("in verl's RL schema", "with SFT rows") for p in missing))
    out = Conversations([], [], [])
    for i, f in enumerate(files):
        try:
            table = pq.read_table(f)
        except Exception as e:
            raise InputError(f"{field}[{i}]: {f} is not a readable parquet file ({e}).") from None
        cols = table.column_names
        multi_turn = "messages" in cols
        if not multi_turn and not {"prompt", "response"} <= set(cols):
            raise InputError(f"{field}[{i}]: {f} has no `messages` column and no `prompt`+`response` columns; "
                             f"columns are {cols}. Give multi-turn chats as `messages` (a list of {{role, content}}) "
                             "or single turns as `prompt` (string or chat list) and `response` (string).")
        if table.num_rows == 0:
            raise InputError(f"{field}[{i}]: {f} has no rows.")
        keep = ["messages"] if multi_turn else ["prompt", "response"]
        for j, r in enumerate(table.select(keep).to_pylist()):
            where = f"{field}[{i}]: {f} row {j}"
            msgs, start = _row(r, multi_turn, where)
            out.messages.append(msgs)
            out.start.append(start)
            out.origins.append(f"{Path(f).name} row {j} ({field}[{i}]: {f})")
    return out


# -- dpo: preference pairs ----------------------------------------------------------------------------------------

COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference: the prompt's chat messages, the preferred and dispreferred assistant replies (text), and
    where it came from (file, 0-based row) for error messages."""
    prompt: list[dict]
    chosen: str
    rejected: str
    file: str
    row: int

    @property
    def where(self) -> str:
        return f"{self.file} row {self.row}"


def missing_file_problems(files: list[str], field: str) -> list[str]:
    """Entries of the list `field` that are not files, each named with its place and the fix."""
    return [f"{field}[{i}]: {f} does not exist; give a parquet file of preference pairs (columns prompt, chosen, "
            "rejected)." for i, f in enumerate(files) if not Path(f).is_file()]


def load_preferences(files: list[str], field: str = "phases[0].data.train_files") -> list[Pair]:
    """The preference pairs of `files`, the blueprint's list `field`, in file then row order.

    Accepted row forms (TRL's preference formats, as verl's and TRL's datasets store them):
      prompt str | chat list, chosen/rejected str        the replies are the assistant's text
      prompt chat list, chosen/rejected [assistant msg]  conversational, explicit prompt
      no prompt (or a str one), chosen/rejected chats    implicit prompt: the conversations' shared leading messages
    """
    if not files:
        raise InputError(f"{field}: no files given; list parquet files of preference pairs (prompt, chosen, rejected).")
    if missing := missing_file_problems(files, field):
        raise InputError(" ".join(missing))
    pairs: list[Pair] = []
    for f in files:
        try:
            table = pq.read_table(f)
        except Exception as e:
            raise InputError(f"{field}: {f} is not a readable parquet file ({e}).") from None
        lacking = [c for c in ("chosen", "rejected") if c not in table.column_names]
        if lacking:
            raise InputError(
                f"{field}: {f} lacks column(s) {lacking} (has {table.column_names}); preference data needs "
                "'chosen' and 'rejected' (assistant replies or full conversations) and, unless the conversations "
                "hold it, 'prompt'. Rename the columns or convert the dataset to that form."
            )
        if table.num_rows == 0:
            raise InputError(f"{field}: {f} has no rows.")
        has_prompt = "prompt" in table.column_names
        for i, r in enumerate(table.select([c for c in COLUMNS if c in table.column_names]).to_pylist()):
            pairs.append(_pair(r.get("prompt") if has_prompt else None, r["chosen"], r["rejected"], f, i, field,
                               has_prompt))
    return pairs


def _pair(prompt, chosen, rejected, f: str, row: int, field: str, has_prompt: bool) -> Pair:
    """One row normalized to (prompt messages, chosen text, rejected text), or an InputError saying what is wrong."""
    where = f"{field}: {f} row {row}"
    for name, v in (("chosen", chosen), ("rejected", rejected)):
        if v is None or not isinstance(v, (str, list)):
            raise InputError(f"{where}: '{name}' must be the assistant's reply (a string) or a list of "
                             f"{{role, content}} messages (got {type(v).__name__}); fix or drop the row.")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise InputError(f"{where}: 'chosen' and 'rejected' must both be strings or both message lists; "
                         "convert one of them.")
    if isinstance(chosen, list):
        chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
        if prompt is None or isinstance(prompt, str):  # TRL's implicit prompt (a str prompt column is then ignored)
            prompt, chosen, rejected = _split_shared_prefix(chosen, rejected, where)
        else:
            prompt = _messages(prompt, where, "prompt")
        chosen, rejected = _reply(chosen, where, "chosen"), _reply(rejected, where, "rejected")
    else:
        if prompt is None:
            how = "is null" if has_prompt else "is missing (no 'prompt' column)"
            raise InputError(f"{where}: the prompt {how}, and string replies cannot carry it; add a 'prompt' column "
                             "or give chosen/rejected as full conversations.")
        prompt = user_turn(prompt) if isinstance(prompt, str) else _messages(prompt, where, "prompt")
    if not any(str(m.get("content") or "").strip() for m in prompt):
        raise InputError(f"{where}: the prompt is empty; fix or drop the row.")
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise InputError(f"{where}: the {name} reply is empty; fix or drop the row.")
    if chosen == rejected:
        raise InputError(f"{where}: chosen and rejected are the same reply, so the pair teaches nothing (its DPO "
                         "gradient is zero); drop the row or fix its labels.")
    return Pair(prompt, chosen, rejected, f, row)


def user_turn(text: str) -> list[dict]:
    """A bare string prompt is one user message, as load_prompts reads it."""
    return [{"role": "user", "content": text}]


def _messages(v, where: str, name: str) -> list[dict]:
    """A chat list as plain {role, content, ...} dicts (pyarrow gives structs as dicts; None fields dropped)."""
    if isinstance(v, str):
        raise InputError(f"{where}: '{name}' is a string where the other columns are messages; give it as a list "
                         "of {role, content} messages.")
    if not (isinstance(v, list) and all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str)
                                        for m in v)):
        raise InputError(f"{where}: '{name}' must be a list of {{role, content}} messages with string content; "
                         "fix or drop the row.")
    return [{k: x for k, x in m.items() if x is not None} for m in v]


def _split_shared_prefix(chosen: list[dict], rejected: list[dict], where: str):
    """TRL's implicit prompt: the messages both conversations start with are the prompt, the rest the replies."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0:
        raise InputError(f"{where}: 'chosen' and 'rejected' share no leading message, so there is no prompt; add a "
                         "'prompt' column or start both conversations with the same prompt messages.")
    if k == len(chosen) and k == len(rejected):
        raise InputError(f"{where}: chosen and rejected are the same conversation, so the pair teaches nothing (its "
                         "DPO gradient is zero); drop the row or fix its labels.")
    return chosen[:k], chosen[k:], rejected[k:]


def _reply(msgs: list[dict], where: str, name: str) -> str:
    """The assistant text of a conversational reply: exactly one assistant message (a multi-turn completion would
    score the user's turns as if the policy wrote them)."""
    if not msgs:
        raise InputError(f"{where}: the {name} reply is empty (the conversation has nothing after the prompt); fix "
                         "or drop the row.")
    if len(msgs) != 1 or msgs[0].get("role") != "assistant":
        roles = [m.get("role") for m in msgs]
        raise InputError(f"{where}: the {name} reply must be one assistant message after the prompt (got roles "
                         f"{roles}); put earlier turns in the prompt and keep only the final assistant reply.")
    return msgs[0]["content"]

