"""Is this blueprint runnable here? The one entry point of the checks (`check_blueprint`), and the checks that
would otherwise fail only inside a later stage, after earlier ones committed.

Each fact is decided once, in one of two tiers:

- cheap (no torch, transformers or verl import): `check_blueprint`, the inputs (core/checks/inputs.py) and then
  the store's room for the run's peak footprint (core/checks/footprint.py). The CLI (`verlflow validate`, and
  `run` before anything touches the store) and the validate stage (a flow run, from the UI or a schedule, starts
  there) both call it.
- `rollout_problems`, `eval_problems` and `phase_problems`: need the tokenizer (and call the reward function), so
  only the validate stage (a torchrun job that loads both anyway) runs them, before build.

Every problem is one line naming the field or file, what was found and the fix.
"""

import shutil
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path

from verlflow.core.checks.agent import environment_tools, tool_template_problems
from verlflow.core.checks.footprint import Footprint, ModelSize, estimate, human
from verlflow.core.checks.inputs import missing_inputs
from verlflow.core.errors import StoreError, VerlflowError

_REWARD_SAMPLES = 16  # data sources sampled at most (verl_default picks a scorer per source)


def check_blueprint(bp, run_id: str | None = None) -> "Preflight":
    """The cheap tier: the inputs, then (once they are usable: the estimate reads the model folder) the store's
    room for the run (`run_id`: what that run already holds there counts as room)."""
    problems = missing_inputs(bp)
    return Preflight(problems, None if problems else check_space(bp, run_id))


# ----------------------------------------------------------------------------------------------------- rollout


def rollout_problems(bp, tok, prompts) -> list[str]:
    """What the rollout would refuse: a chat template without the tool support agent mode needs, prompts over
    data.max_prompt_length (with the environment's tools in agent mode), a reward that gives no number."""
    if problems := tool_template_problems(bp, tok):
        return problems
    return (prompt_length_problems(tok, prompts, bp.data.max_prompt_length, tools=environment_tools(bp))
            + reward_problems(bp, prompts))


def eval_problems(bp, tok, prompts) -> list[str]:
    """What the evaluate stage would refuse in eval.files' prompts: the same as the rollout, with its reward."""
    function, field = (bp.eval.reward, "eval.reward") if bp.eval.reward else (bp.reward.function, "reward.function")
    return (prompt_length_problems(tok, prompts, bp.data.max_prompt_length, "eval.files",
                                   tools=environment_tools(bp))
            + reward_problems(bp, prompts, function, field))


def eval_sources_line(held) -> str:
    """The data sources of the held-out prompts, and the metric names they give promote.metric."""
    from verlflow.core.ml.evaluate import source_counts

    counts = source_counts(held)
    first = next(iter(counts))
    return (f"eval.files: {len(held)} prompts, data sources " + ", ".join(f"{s} ({n})" for s, n in counts.items())
            + f"; promote.metric can name eval/<source>/<metric> (e.g. eval/{first}/accuracy) or eval/accuracy")


def phase_problems(bp, tok) -> list[str]:
    """What an sft/dpo phase's stage would refuse once its rows meet the tokenizer (the cheap tier read their
    columns, types and count): a row over the phase's algorithm.max_length, a chat template that does not render a
    row's turns as prefixes of the whole. One line per phase, naming its first bad row."""
    from verlflow.core.ml.dpo import encode_pairs
    from verlflow.core.ml.phasedata import load_preferences, load_sft_rows
    from verlflow.core.ml.sft import encode_sft

    problems = []
    for i, ph in enumerate(bp.phases):
        if ph.kind not in ("sft", "dpo"):
            continue
        files, limit = f"phases[{i}].data.train_files", f"phases[{i}].algorithm.max_length"
        read, encode = (load_sft_rows, encode_sft) if ph.kind == "sft" else (load_preferences, encode_pairs)
        try:
            encode(tok, read(ph.data.train_files, files), ph.algorithm.max_length, limit)
        except VerlflowError as e:
            problems.append(str(e))
    return problems


def prompt_length_problems(tok, prompts, limit: int, files: str = "data.train_files",
                           tools: list[dict] | None = None) -> list[str]:
    from verlflow.core.ml.generate import prompt_ids

    # The rollout's own encoding, checked here against the limit for every prompt (the rollout stops at the first).
    rows = list(range(len(prompts)))
    lengths = [len(prompt_ids(tok, msgs, tools)) for msgs in prompts.messages]
    over = [i for i in rows if lengths[i] > limit]
    if not over:
        return []
    longest = max(over, key=lengths.__getitem__)
    template = "the chat template with the environment's tools" if tools else "the chat template"
    return [f"data.max_prompt_length={limit}: {len(over)} of {len(prompts)} prompts in {files} are longer "
            f"after {template}; the longest is {lengths[longest]} tokens (dataset row "
            f"{prompts.rows[longest]}). Raise data.max_prompt_length to {lengths[longest]} or filter the prompts over "
            f"{limit} tokens out of the data."]


def reward_problems(bp, prompts, function: str | None = None, field: str = "reward.function") -> list[str]:
    """The reward (`function`, named by the blueprint's `field`; default reward.function) called as the rollout
    calls it, once per data source (up to a few), on that source's first prompt with its ground truth as the
    response."""
    from verlflow.core.ml.rewards import load_reward

    function = function or bp.reward.function
    reward = load_reward(function, bp.reward.module, field=field)
    first_row: dict[str, int] = {}
    for i, source in enumerate(prompts.data_source):
        if len(first_row) == _REWARD_SAMPLES:
            break
        first_row.setdefault(source, i)
    problems = []
    for source, i in first_row.items():
        truth = prompts.ground_truth[i]
        try:
            reward(source, truth, truth, prompts.extra_info[i])
        except Exception as e:  # noqa: BLE001 - whatever it raises, the rollout would raise too
            what = str(e) if isinstance(e, VerlflowError) else f"{type(e).__name__}: {e}"
            problems.append(f"{field} {function!r}, called on dataset row {prompts.rows[i]} (data_source "
                            f"{source!r}) with its ground truth {truth!r:.40} as the response: {what} Fix the "
                            f"function or pick another {field}.")
    return problems


# ------------------------------------------------------------------------------------------------------- space


@dataclass(frozen=True)
class SpaceCheck:
    """The run's peak footprint (core/checks/footprint.py) against the store's filesystem. `free` is None for an
    object store (s3://), which is not refused."""
    uri: str
    estimate: Footprint
    free: int | None = None
    held: int = 0  # what this run already holds there: a rerun reuses it, so it counts as room
    alternatives: tuple[tuple[str, int], ...] = ()  # (retention fields, estimate with them)

    @property
    def room(self) -> int | None:
        return None if self.free is None else self.free + self.held

    @property
    def fits(self) -> bool:
        return self.room is None or self.estimate.total <= self.room

    def summary(self) -> str:
        line = f"store footprint {self.estimate.describe()}"
        if self.free is None:
            return f"{line}; {self.uri} is an object store: its room is not checked"
        return f"{line}; {self._room_text()}"

    def _room_text(self) -> str:
        held = f" (+ {human(self.held)} this run already holds there)" if self.held else ""
        return f"{human(self.free)} free at {self.uri}{held}"

    def problem(self) -> str | None:
        if self.fits:
            return None
        fit = [f"{fields} (~{human(total)})" for fields, total in self.alternatives if total <= self.room]
        short = [f"{fields} (~{human(total)})" for fields, total in self.alternatives if total > self.room]
        return (f"storage.uri={self.uri}: the run would keep {self.estimate.describe()}, but there is "
                f"{self._room_text()}: {human(self.estimate.total - self.room)} short. "
                + (f"Retention that makes it fit: {'; '.join(fit)}. " if fit else
                   "No retention setting makes it fit. ")
                + (f"Not enough: {'; '.join(short)}. " if short else "")
                + "Or free space there, or use a store on a bigger filesystem (or s3://).")


@dataclass(frozen=True)
class Preflight:
    problems: list[str]  # the inputs' (missing_inputs)
    space: SpaceCheck | None  # None while an input is unusable

    def refuse(self) -> SpaceCheck:
        """The store's room, or the CLI's refusal: every input problem at once, else the store's."""
        if self.problems:
            raise VerlflowError("Blueprint refers to inputs that are missing or unusable:\n  "
                                + "\n  ".join(self.problems))
        if problem := self.space.problem():
            raise StoreError(problem)
        return self.space


# The retention fields that shrink the peak (storage.export_every: _sparser picks its value).
_SMALLER = (("keep_last_checkpoints", 1), ("keep_best_metric", None), ("keep_last", 1))


def check_space(bp, run_id: str | None = None) -> SpaceCheck:
    """The store's room for the run; a file:// store that cannot hold the estimate carries its problem()."""
    from verlflow.core.store.artifacts import open_store

    store = open_store(bp.storage)
    size = ModelSize.of(Path(bp.model.path))
    fp = estimate(bp, size)
    if not store.is_local:
        return SpaceCheck(store.root_uri, fp)
    root = Path(store.root)
    free = shutil.disk_usage(_nearest_existing(root)).free
    held = _folder_bytes(root / "runs" / run_id) if run_id else 0
    check = SpaceCheck(store.root_uri, fp, free, held)
    if check.fits:
        return check
    return replace(check, alternatives=tuple(_alternatives(bp, size, free + held)))


def _alternatives(bp, size: ModelSize, room: int) -> list[tuple[str, int]]:
    """(fields, estimate) of each retention change that shrinks the peak alone, then of the smallest sets of them
    that fit (of all of them when none does)."""
    def total(changes) -> int:
        return estimate(_with(bp, changes), size).total

    changes = [(f, v) for f, v in _SMALLER if getattr(bp.storage, f) != v]
    changes += _sparser(bp, room, total)
    out = [(_fields([c]), total([c])) for c in changes]
    sets = [list(s) for n in range(2, len(changes) + 1) for s in combinations(changes, n)]
    fitting = [s for s in sets if total(s) <= room and not any(total([c]) <= room for c in s)]
    smallest = [s for s in fitting if not any(set(t) < set(s) for t in fitting)]
    if not smallest and len(changes) > 1 and not any(t <= room for _, t in out):
        smallest = [changes]  # nothing fits: what all of them together would need
    return out + [(_fields(s), total(s)) for s in smallest]


def _sparser(bp, room: int, total) -> list[tuple[str, int]]:
    """The densest storage.export_every that fits, else the sparsest (one export, at the last iteration). Only
    fewer exports than storage.keep_last (+ the best, + the one being written) change the peak: one candidate
    per such count."""
    s, n = bp.storage, bp.iterations
    if s.export_every >= n:
        return []
    cap = s.keep_last + bool(s.keep_best_metric) + 1
    candidates = sorted({-(-n // c) for c in range(1, cap + 1)} - {s.export_every})
    fitting = [e for e in candidates if e > s.export_every and total([("export_every", e)]) <= room]
    return [("export_every", fitting[0] if fitting else n)]


def _with(bp, changes):
    out = bp.model_copy(deep=True)
    for field, value in changes:
        setattr(out.storage, field, value)
    return out


def _fields(changes) -> str:
    return ", ".join(f"storage.{f}: {'null' if v is None else v}" for f, v in changes)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
