"""Prompt datasets in verl's RL parquet schema, read with pyarrow; the per-iteration prompt selection."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from verlflow.core.errors import InputError

REQUIRED = ("data_source", "reward_model")


@dataclass
class Prompts:
    """Prompt columns; `rows` are their row numbers in the dataset (a `take` keeps them)."""
    messages: list[list[dict]]
    data_source: list[str]
    ground_truth: list[str]
    extra_info: list[dict]
    rows: list[int]
    columns: list[dict] | None = None  # each row's other top-level columns (verl's agent_name): environments read them

    def __len__(self) -> int:
        return len(self.messages)

    def take(self, idx) -> "Prompts":
        return Prompts(*([col[i] for i in idx] for col in (self.messages, self.data_source, self.ground_truth,
                                                           self.extra_info, self.rows)),
                       columns=None if self.columns is None else [self.columns[i] for i in idx])


def missing_file_problems(files: list[str], field: str = "data.train_files") -> list[str]:
    """Entries of the list `field` (data.train_files, eval.files) that are not files, each named with its place
    and the fix."""
    return [f"{field}[{i}]: {f} does not exist; give a parquet file in verl's RL schema."
            for i, f in enumerate(files) if not Path(f).is_file()]


def load_prompts(files: list[str], prompt_key: str = "prompt", field: str = "data.train_files") -> Prompts:
    """The prompts of `files`, the blueprint's list `field` (its errors name it, and the prompt key of its
    section: data.prompt_key for data.train_files, eval.prompt_key for eval.files)."""
    if missing := missing_file_problems(files, field):
        raise InputError(" ".join(missing))
    key_field = f"{field.split('.', 1)[0]}.prompt_key"
    cols: dict[str, list] = {k: [] for k in (prompt_key, *REQUIRED, "extra_info")}
    others: list[dict] = []
    for f in files:
        try:
            table = pq.read_table(f)
        except Exception as e:
            raise InputError(f"{field}: {f} is not a readable parquet file ({e}).") from None
        missing = [c for c in (prompt_key, *REQUIRED) if c not in table.column_names]
        if missing:
            raise InputError(
                f"{field}: {f} lacks column(s) {missing} (has {table.column_names}); verl's schema needs "
                f"'{prompt_key}' (chat messages), 'data_source' and 'reward_model' {{ground_truth}}. "
                f"Set {key_field} if the prompts are under another name."
            )
        if table.num_rows == 0:
            raise InputError(f"{field}: {f} has no rows.")
        rows = table.to_pylist()
        for i, r in enumerate(rows):
            msgs = r[prompt_key]
            if isinstance(msgs, str):
                msgs = [{"role": "user", "content": msgs}]
            if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs)):
                raise InputError(f"{field}: {f} row {i}: '{prompt_key}' must be a list of "
                                 f"{{role, content}} messages or a string (got {type(msgs).__name__}).")
            rm = r["reward_model"]
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise InputError(f"{field}: {f} row {i}: reward_model must be a struct with ground_truth.")
            cols[prompt_key].append(msgs)
            cols["data_source"].append(str(r["data_source"]))
            cols["reward_model"].append(str(rm["ground_truth"]))
            cols["extra_info"].append(r.get("extra_info") or {})
            others.append({k: v for k, v in r.items() if k not in cols})
    return Prompts(cols[prompt_key], cols["data_source"], cols["reward_model"], cols["extra_info"],
                   list(range(len(cols[prompt_key]))), others)


def select(n_rows: int, cursor: int, batch_size: int, seed: int, shuffle: bool) -> np.ndarray:
    """Indices of the `batch_size` prompts after `cursor` prompts were consumed; epochs reshuffle by seed. The
    cursor runs on across epochs, and across the runs of a recurring chain, which share one seed of this order
    (verlflow.core.store.chain): each epoch visits every prompt once, whichever run reaches it."""
    orders: dict[int, np.ndarray] = {}
    out = []
    for pos in range(cursor, cursor + batch_size):
        epoch, i = divmod(pos, n_rows)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n_rows) if shuffle else np.arange(n_rows)
        out.append(int(orders[epoch][i]))
    return np.asarray(out)
