"""`verlflow` command line. Errors a user can fix print as one paragraph and exit non-zero."""

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from verlflow.core.errors import VerlflowError

EXAMPLES = ("examples:\n  verlflow make-tiny tiny/qwen2\n  verlflow run blueprints/tiny-cpu.yaml iterations=3\n"
            "  verlflow verify RUN_ID blueprints/tiny-cpu.yaml\n")


def _blueprint(args):
    from verlflow.core.blueprint import load_blueprint

    path, overrides = args.blueprint, list(args.overrides)
    if path and "=" in path and not Path(path).exists():  # `verlflow run iterations=3`: defaults + override
        path, overrides = None, [path] + overrides
    return load_blueprint(path, overrides)


def _add_blueprint(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("blueprint", nargs=None if required else "?", help="blueprint YAML (default: embedded defaults)")
    # default=[]: otherwise argparse lists KEY=VALUE among "the following arguments are required".
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="overrides such as rollout.n=8")


def cmd_schema(args) -> int:
    from verlflow.core.blueprint import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_validate_blueprint(args) -> int:
    from verlflow.core.checks.preflight import check_blueprint

    bp = _blueprint(args)
    space = check_blueprint(bp).refuse()
    print(f"{args.blueprint or '<embedded defaults>'}: ok ({bp.name}, {bp.iterations} iterations, "
          f"{bp.resources.world_size} ranks on {bp.resources.device}, store {bp.storage.uri})")
    if bp.eval.files:
        from verlflow.core.checks.preflight import eval_sources_line
        from verlflow.core.ml.evaluate import load_held_out

        print(eval_sources_line(load_held_out(bp.eval)))
    print(space.summary())
    return 0


def cmd_make_tiny(args) -> int:
    from verlflow.core.testing.tinykit import make_tiny

    info = make_tiny(args.out, arch=args.arch, seed=args.seed, task=args.task)
    print(f"tiny {args.arch} {args.task} kit written to {args.out}: model "
          f"{info.get('model_dir', Path(args.out) / 'model')}")
    return 0


def _preflight(bp, run_id: str):
    from verlflow.core.checks.preflight import check_blueprint
    from verlflow.core.store.artifacts import open_store

    space = check_blueprint(bp, run_id).refuse()  # refused before the probe writes to the store
    open_store(bp.storage).probe()
    return space


def _print_summary(bp, run_id: str, results) -> None:
    from verlflow.core.store.artifacts import open_store

    rows = [(r.manifest["iteration"], r.manifest["metrics"]) for r in results if r.manifest["stage"] == "rollout"]
    print(f"\nrun {run_id}: reward per iteration")
    print(f"{'iter':>5} {'reward_mean':>12} {'reward_std':>11} {'resp_len':>9}")
    for it, m in rows:
        print(f"{it:>5} {m['reward_mean']:>12.4f} {m['reward_std']:>11.4f} {m['response_len_mean']:>9.2f}")
    evals = [(r.manifest["iteration"], r.manifest["metrics"]) for r in results if r.manifest["stage"] == "evaluate"]
    if evals:
        print(f"held-out evaluation (eval.files; iteration 0: before training)\n{'iter':>5} {'reward_mean':>12} "
              f"{'accuracy':>9}")
        for it, m in evals:
            print(f"{it:>5} {m['reward_mean']:>12.4f} {m['accuracy']:>9.4f}")
    _print_promotion(open_store(bp.storage), bp, run_id)


def _print_promotion(store, bp, run_id: str) -> None:
    """What the run's latest pointer names once the run is over (every background commit landed), or why none."""
    from verlflow.core.store.promote import PromotePolicy, promotion_status

    print(promotion_status(store, PromotePolicy.of(bp), run_id))
    if pointer := store.get_pointer(f"runs/{run_id}/latest"):
        print(f"latest policy (HF folder): {pointer['hf_uri']}")


def cmd_run(args) -> int:
    from verlflow.core.orchestrate.pipeline import checked_plan, run_pipeline
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import safe_run_id
    from verlflow.core.store.lease import run_lease

    bp = _blueprint(args)
    # Everything the user typed is checked before the store is touched (the preflight probe writes to it).
    if args.run_id is not None:
        safe_run_id(args.run_id, "rerun RUN" if getattr(args, "run", None) is not None else "--run-id")
    run_id = args.run_id or f"{bp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    steps, _ = checked_plan(bp, run_id, args.from_step)
    space = _preflight(bp, run_id)
    if getattr(args, "prefect", False):  # the same pipeline as a Prefect flow run (tasks, logs, artifacts, lease)
        print(f"[verlflow] {space.summary()}", flush=True)
        return _run_flow(bp, args.run_id, args.from_step)
    store = open_store(bp.storage)
    with run_lease(store, run_id), _ctrl_c_cancels() as cancel:
        print(f"[verlflow] {space.summary()}", flush=True)  # once the run is ours: a refused one prints nothing
        logs = _StageLogs(store, run_id, steps)
        try:
            results = run_pipeline(bp, run_id, on_line=logs, on_step=logs.step_done, force_from=args.from_step,
                                   cancel=cancel)
        except VerlflowError as e:
            e.log_file = logs.path
            if cancel.is_set():
                raise KeyboardInterrupt from e  # the job is gone; exit 130 as for any Ctrl-C
            raise
        finally:
            logs.close()
    _print_summary(bp, run_id, results)
    return 0


@contextlib.contextmanager
def _ctrl_c_cancels():
    """Ctrl-C (SIGINT) sets the run's cancel event instead of raising wherever the main thread happens to be (inside
    a logging handler's lock, a store write): the launcher then stops the job's whole tree and the run ends as
    cancelled. A second Ctrl-C raises at once."""
    cancel = threading.Event()

    def on_sigint(signum, frame):
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield cancel
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)


class _StageLogs:
    """The CLI's on_line: each step's lines go to its stage's log file (verlflow.core.orchestrate.logsink), the terminal shows the INFO
    records (and the run's progress, _Progress); a rank's traceback stays in the file, which a failure's message names.
    Steps end in plan order."""

    def __init__(self, store, run_id: str, steps):
        from verlflow.core.orchestrate.logsink import stage_log_path

        self.paths = [stage_log_path(store, run_id, s.stage, s.iteration) for s in steps]
        self.done = 0
        self.progress = _Progress(steps)
        self.sink = self._open()

    def _open(self):
        from verlflow.core.orchestrate.logsink import LineSink

        return LineSink(self.path, self._show)

    def _show(self, level: int, text: str) -> None:
        if level < logging.ERROR:
            self.progress.say(text)

    @property
    def path(self) -> Path:
        return self.paths[min(self.done, len(self.paths) - 1)]

    def __call__(self, line: str) -> None:
        self.sink(line)

    def step_done(self, step, result) -> None:
        self.done += 1
        if self.done < len(self.paths):
            self.sink.close()
            self.sink = self._open()
        self.progress.step_done(result.skipped)

    def close(self) -> None:
        self.sink.close()
        self.progress.close()


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class _Progress:
    """A run's progress as training loops show it. On a terminal: a rich progress bar under the stage lines (the
    step running, iteration i of N, elapsed, ETA); elsewhere (a pipe, a file) one plain line as each iteration ends.
    An iteration is the steps of one iteration of the plan (in a phased plan: of one label, `sft.1`, `2`..., called
    parts); validate, build and the initial evaluation come before the first. The ETA is the time per iteration so
    far, steps reused from the store not counted, times the iterations left."""

    def __init__(self, steps):
        from rich.console import Console

        self.steps = steps
        self.labels = list(dict.fromkeys(s.iteration for s in steps if s.iteration not in ("init", 0)))
        self.size = {u: sum(s.iteration == u for s in steps) for u in self.labels}  # steps per iteration
        self.noun = "iteration" if all(isinstance(u, int) for u in self.labels) else "part"
        self.done, self.units, self.ran_units = 0, 0.0, 0.0
        self.started = self.last = time.monotonic()
        self.loop_t0 = None  # when the first iteration step that ran (not reused) began
        self.ran_in_unit = False
        console = Console(highlight=False)
        self.bar = None
        if console.is_terminal and not console.is_dumb_terminal:
            self.bar = _progress_bar(console)
            self.task = self.bar.add_task(self._running(), total=max(len(self.labels), 1), where=self._where(),
                                          eta=None)
            self.bar.start()

    def say(self, text: str) -> None:
        """A stage's line: above the bar on a terminal."""
        from rich.text import Text

        if self.bar is not None:
            self.bar.console.print(Text(text), soft_wrap=True)
        else:
            _print_or_drop(text)

    def _running(self) -> str:
        return self.steps[self.done].name if self.done < len(self.steps) else "done"

    def _where(self) -> str:
        n = len(self.labels)
        if self.done == len(self.steps):
            return f"{n}/{n} {self.noun}s"
        label = self.steps[self.done].iteration
        return self._name(label) if label in self.size else f"starting, {n} {self.noun}s to go"

    def _name(self, label) -> str:
        return f"{self.noun} {self.labels.index(label) + 1}/{len(self.labels)}"

    def eta(self) -> float | None:
        if not self.ran_units:
            return None
        return (self.last - self.loop_t0) / self.ran_units * (len(self.labels) - self.units)

    def step_done(self, skipped: bool) -> None:
        if self.done == len(self.steps):  # a display never fails the run
            return
        step, now = self.steps[self.done], time.monotonic()
        weight = 1 / self.size[step.iteration] if step.iteration in self.size else 0.0
        if weight and not skipped:
            self.loop_t0 = self.last if self.loop_t0 is None else self.loop_t0
            self.ran_units += weight
            self.ran_in_unit = True
        self.units += weight
        self.done += 1
        self.last = now
        ends = weight and (self.done == len(self.steps) or self.steps[self.done].iteration != step.iteration)
        if self.bar is not None:
            eta = self.eta()
            self.bar.update(self.task, description=self._running(), completed=round(self.units, 6),
                            where=self._where(), eta=None if eta is None else now + eta)
        elif ends:
            self._plain_line(step.iteration)
        if ends:
            self.ran_in_unit = False

    def _plain_line(self, label) -> None:
        eta, last = self.eta(), label == self.labels[-1]
        how = "done" if self.ran_in_unit else "reused from the store"
        left = f", ETA {_duration(eta)}" if eta is not None and not last else ""
        _print_or_drop(f"[verlflow] {self._name(label)} {how}: elapsed {_duration(self.last - self.started)}{left}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _progress_bar(console):
    """rich's Progress with the run's columns: the step running, the bar, iteration i/N, elapsed, the ETA."""
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.table import Column
    from rich.text import Text

    class Times(ProgressColumn):
        def render(self, task) -> Text:
            eta, elapsed = task.fields["eta"], task.finished_time if task.finished else task.elapsed
            left = f" · ETA {_duration(eta - time.monotonic())}" if eta is not None and not task.finished else ""
            return Text(f"elapsed {_duration(elapsed or 0)}{left}", style="progress.remaining")

    # markup off: a step's name (`build[init]`) would read as a style tag
    return Progress(TextColumn("{task.description}", markup=False, table_column=Column(min_width=15)), BarColumn(),
                    TextColumn("{task.fields[where]}", markup=False), Times(), console=console)


def _print_or_drop(text: str) -> None:
    """print, and once stdout's reader went away (`verlflow run ... | head`) nothing more: the run goes on, each
    stage's lines still go to its log file."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    """Python's recipe for a closed pipe: stdout to /dev/null, so no later write (the exit's flush) fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def cmd_rerun(args) -> int:
    args.run_id = args.run
    return cmd_run(args)


def _stage_order(stage: str) -> int:
    from verlflow.core.stagespec import RENAMED, SPECS

    order = list(SPECS)
    stage = RENAMED.get(stage, stage)
    return order.index(stage) if stage in order else len(order)


def _run_stages(sizes: dict, run: str, store=None) -> list[tuple[str, str]]:
    """(iteration, stage) of every stage folder of a run with files in it, in pipeline order. A run of phases
    (iterations such as `sft.1`, `rl`) has no order in its keys: its stages after init go in the order they were
    committed (what a stage reads was committed before it), uncommitted ones last."""
    keys = [k.split("/") for k in sizes]  # runs/<run>/<iteration>/<stage>/<file...>
    found = {tuple(k[2:4]) for k in keys if len(k) > 4 and k[1] == run}
    if store is not None and any(not it.isdigit() and it != "init" for it, _ in found):
        manifests = {}
        for it, stage in found:
            try:
                manifests[f"runs/{run}/{it}/{stage}"] = store.read_manifest(f"runs/{run}/{it}/{stage}")
            except VerlflowError:  # damaged: verify names it
                manifests[f"runs/{run}/{it}/{stage}"] = None
        depth: dict[str, int] = {}

        def depth_of(key: str) -> int:  # the longest chain of this run's inputs below the stage
            if key not in depth:
                depth[key] = 0
                ins = [i.get("stage") for i in ((manifests.get(key) or {}).get("inputs") or {}).values()
                       if isinstance(i, dict)]
                depth[key] = 1 + max((depth_of(k) for k in ins if k in manifests), default=-1)
            return depth[key]

        def committed(s):  # older manifests' committed_at has whole seconds: within one, inputs go first
            m = manifests[f"runs/{run}/{s[0]}/{s[1]}"]
            return (s[0] != "init", m is None, (m or {}).get("committed_at", ""),
                    depth_of(f"runs/{run}/{s[0]}/{s[1]}"), _stage_order(s[1]), s[0])
        return sorted(found, key=committed)
    return sorted(found, key=lambda s: (s[0] != "init", int(s[0]) if s[0].isdigit() else 0, _stage_order(s[1])))


def _no_such_run(store, run: str) -> VerlflowError:
    return VerlflowError(f"run {run}: no such run in {store.root_uri} (`verlflow ls --all` lists every run).")


def _stage_state(store, skey: str, sizes: dict | None, checksums: bool) -> tuple[str, list[str]]:
    """A stage's state for ls/verify: ("committed" | "pruned" | "partly pruned" | "NOT committed" | "DAMAGED",
    problems or notes)."""
    from verlflow.core.errors import StoreError

    try:
        m = store.read_manifest(skey)
    except StoreError:
        return "DAMAGED", ["manifest.json is not valid JSON"]
    if m is None:
        return "NOT committed", []
    problems = store.damage(skey, checksums=checksums, sizes=sizes)
    if problems:
        return "DAMAGED", problems
    if not m.get("pruned"):
        return "committed", []
    # retention (verlflow.core.store.retention): a build keeps hf_meta/ and ref/; files a crash left get deleted
    left = [r for r in m["pruned_files"] if sizes is not None and f"{skey}/{r}" in sizes]
    note = [f"{len(left)} pruned file(s) still to delete (an interrupted prune; the next run's retention "
            "deletes them)"] if left else []
    return ("partly pruned" if m["files"] else "pruned"), note


def cmd_ls(args) -> int:
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import safe_run_id
    from verlflow.core.store.lease import holder_of

    bp = _blueprint(args)
    if args.run is not None:
        safe_run_id(args.run, "--run")  # before anything is printed
    store = open_store(bp.storage)
    sizes = store.sizes("runs")
    if not args.run:
        return _list_runs(args, bp, store, sizes)
    stages, holder = _run_stages(sizes, args.run, store), holder_of(store, args.run)
    if not stages and holder is None:
        raise _no_such_run(store, args.run)
    for it, stage in stages:
        skey = f"runs/{args.run}/{it}/{stage}"
        state, problems = _stage_state(store, skey, sizes, checksums=False)  # existence and size only: cheap
        extra = f"  ({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})" if problems else ""
        print(f"  {stage}[{it}]".ljust(20) + f"{state:<14} {store.uri(skey)}{extra}")
    if holder is not None:
        print(f"run {args.run} is being run by {holder.describe()} (its lease)")
    return 0


def _list_runs(args, bp, store, sizes: dict) -> int:
    """`verlflow ls`: the blueprint's runs (--all: every run) as a table that fits the terminal, oldest first.
    A run whose blueprint is not known yet (starting: nothing committed) is shown too."""
    committed: dict[str, set] = {}  # run -> {(iteration, stage)} with a manifest
    for k in sizes:
        parts = k.split("/")  # runs/<run>/<iteration>/<stage>/manifest.json
        if len(parts) == 5 and parts[4] == "manifest.json":
            committed.setdefault(parts[1], set()).add((parts[2], parts[3]))
    leased = {k.split("/")[-1].removesuffix(".json") for k in store.sizes("leases")}
    runs = sorted({k.split("/")[1] for k in sizes if k.count("/") > 1} | leased)
    pointers: dict = {}
    rows = [_RunRow.read(store, bp, run, committed.get(run, set()), pointers) for run in runs]
    shown = sorted((r for r in rows if args.all or r.blueprint in (None, bp.name)), key=lambda r: r.since)
    scope = "" if args.all else f" of blueprint {bp.name}"
    if not shown:
        others = f" ({len(rows)} of other blueprints: `verlflow ls --all`)" if rows else ""
        print(f"no runs{scope} in {store.root_uri}{others}; start one with "
              f"`{shlex.join(['verlflow', 'run', *([args.blueprint] if args.blueprint else []), *args.overrides])}`")
        return 0
    console = _table_console()
    metric = (f"best: the {'highest' if bp.promote.mode == 'max' else 'lowest'} {bp.promote.metric} "
              "(promote.metric)" if bp.promote.metric else "reward: the last rollout's rollout/reward_mean")
    # soft_wrap: the terminal wraps these lines; rich would break the store's URI with newlines (no more a path)
    console.print(f"{len(shown)} run(s){scope} in {store.root_uri}; {metric}", markup=False, soft_wrap=True)
    console.print(_runs_table(bp, shown, every=args.all))
    console.print(f"{'' if args.all else '--all: every blueprint; '}a run's stages: `verlflow ls --run RUN`",
                  markup=False, soft_wrap=True)
    return 0


def _table_console():
    """The terminal's width on a terminal (or $COLUMNS); a pipe or a file gets whole lines, for grep and awk."""
    from rich.console import Console

    fits = sys.stdout.isatty() or os.environ.get("COLUMNS")
    return Console(highlight=False, width=None if fits else 1 << 16)


def _runs_table(bp, rows: list, every: bool):
    from rich.table import Table
    from rich.text import Text

    metric = "best" if bp.promote.metric else "reward"  # the line above the table says what it is
    heads = ["run", *(["blueprint"] if every else []), "state", "started", "iterations", metric, "promoted"]
    table = Table(box=None, header_style="bold", pad_edge=False)
    for head in heads:  # a run id folds (it stays whole to copy); the short cells keep to one line
        table.add_column(head, overflow="fold", no_wrap=head not in ("run", "blueprint"))
    colour = {"committed": "green", "running": "yellow", "incomplete": "red"}
    for r in rows:
        table.add_row(r.run, *([r.blueprint or "?"] if every else []), Text(r.state, style=colour.get(r.state, "")),
                      _local_time(r.since), r.iterations, r.metric, r.promoted)
    return table


def _local_time(iso: str) -> str:
    import datetime as dt

    return dt.datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M") if iso else ""


@dataclass
class _RunRow:
    """One run of `verlflow ls`, from the store: its recorded plan (core/orchestrate/pipeline.record_plan), its
    validate manifest, its lease, the manifests of the blueprint's promote.metric and its blueprint's pointer."""
    run: str
    blueprint: str | None  # None: not known (nothing committed yet)
    state: str  # running (a live lease) | committed (every planned step) | incomplete | unknown (no plan recorded)
    since: str  # ISO time of its first commit (its lease's, while it starts)
    iterations: str  # done/planned
    metric: str
    promoted: str  # the iteration its blueprint's latest pointer names, if this run's

    @classmethod
    def read(cls, store, bp, run: str, committed: set, pointers: dict) -> "_RunRow":
        import datetime as dt

        from verlflow.core.orchestrate.pipeline import recorded_plan
        from verlflow.core.store.lease import Holder, holder_of
        from verlflow.core.store.promote import blueprint_pointer

        plan, validate = recorded_plan(store, run), _manifest(store, run, "init", "validate", committed)
        name = (plan or validate or {}).get("blueprint_name")
        steps = None if plan is None else {(str(it), stage) for stage, it in plan["steps"]}
        holder = holder_of(store, run)
        if holder is not None and holder.gone_because(Holder.me(None)) is None:
            state = "running"
        else:
            state = "unknown" if steps is None else "committed" if steps <= committed else "incomplete"
        since = (validate or {}).get("committed_at") or (
            dt.datetime.fromtimestamp(holder.since, dt.timezone.utc).isoformat() if holder else "")
        if name is not None and name not in pointers:
            pointers[name] = store.get_pointer(blueprint_pointer(name))
        pointer = pointers.get(name) or {}
        promoted = f"yes, it {pointer['iteration']}" if pointer.get("run_id") == run else ""
        return cls(run, name, state, since, _iterations(steps, committed), _metric_cell(store, bp, run, committed),
                   promoted)


def _manifest(store, run: str, iteration, stage: str, committed: set) -> dict | None:
    """A committed stage's manifest; None if it has none, or an unreadable one (`verlflow verify` names it)."""
    if (str(iteration), stage) not in committed:
        return None
    try:
        return store.read_manifest(f"runs/{run}/{iteration}/{stage}")
    except VerlflowError:
        return None


def _iterations(steps: set | None, committed: set) -> str:
    """Iterations done of those planned (_Progress's iterations: a phased plan's parts); without a recorded plan,
    the iterations with a committed update."""
    if steps is None:
        return f"{sum(s == 'update' and it.isdigit() and it != '0' for it, s in committed)}/?"
    parts: dict[str, set] = {}
    for it, stage in steps:
        if it not in ("init", "0"):
            parts.setdefault(it, set()).add((it, stage))
    done = sum(p <= committed for p in parts.values())
    return f"{done}/{len(parts)}" + ("" if all(it.isdigit() for it in parts) else " parts")


def _metric_cell(store, bp, run: str, committed: set) -> str:
    """The best value of promote.metric over the run's iterations (promote.mode), or its last rollout's reward."""
    from verlflow.core.metrics import PREFIX, flat

    name = bp.promote.metric or "rollout/reward_mean"
    stage = next((s for s, prefix in PREFIX.items() if name.startswith(f"{prefix}/")), None)
    its = sorted(int(it) for it, s in committed if s == stage and it.isdigit() and it != "0")
    values = []
    for it in its if bp.promote.metric else its[-1:]:
        value = flat(stage, (_manifest(store, run, it, stage, committed) or {}).get("metrics", {})).get(name)
        if value is not None:
            values.append((value, it))
    if not values:
        return ""
    value, it = (max if bp.promote.mode == "max" else min)(values, key=lambda v: v[0])
    return f"{value:.4g} (it {it})"


def cmd_verify(args) -> int:
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import safe_run_id

    bp = _blueprint(args)
    safe_run_id(args.run, "verify RUN")
    store = open_store(bp.storage)
    stages = _run_stages(store.sizes("runs"), args.run, store)
    if not stages:
        raise _no_such_run(store, args.run)
    damaged, files = [], 0  # (name, stage key) in pipeline order
    for it, stage in stages:
        skey, name = f"runs/{args.run}/{it}/{stage}", f"{stage}[{it}]"
        state, problems = _stage_state(store, skey, None, checksums=True)
        if state in ("committed", "partly pruned"):
            files += len(store.read_manifest(skey)["files"])
        if state == "DAMAGED":
            damaged.append((name, skey))
        print(f"  {name}".ljust(20) + f"{'ok' if state == 'committed' else state:<14}" + "; ".join(problems))
    if damaged:
        raise VerlflowError(f"run {args.run}: {len(damaged)} damaged stage(s) in {store.root_uri}: "
                            f"{', '.join(n for n, _ in damaged)}. {_repair(store, args, stages, damaged)}")
    print(f"run {args.run}: every committed stage matches its manifest ({files} files checked)")
    return 0


def _repair(store, args, stages: list, damaged: list) -> str:
    """The rerun that repairs the first damaged stage under the run's retention: from it, or from the nearest
    earlier step whose inputs the store still holds (core/store/retention.py repair_from), or why none can."""
    from verlflow.core.store.artifacts import repair_command
    from verlflow.core.store.retention import repair_from

    def inputs(skey: str) -> dict:
        try:
            m = store.read_manifest(skey) or {}
        except VerlflowError:  # a damaged manifest: what it read is unknown
            m = {}
        return {n: i["stage"] for n, i in (m.get("inputs") or {}).items() if isinstance(i, dict) and "stage" in i}

    steps = [(k, inputs(k)) for k in (f"runs/{args.run}/{it}/{stage}" for it, stage in stages)]
    first = [k for k, _ in steps].index(damaged[0][1])
    j, blocked = repair_from(store, steps, first, [k for _, k in damaged])
    if j is None:
        return (f"No rerun of this run can repair {damaged[0][0]}: {'; '.join(blocked)}. Start a new run (another "
                "run id).")
    skey = steps[j][0]
    name = f"{skey.split('/')[3]}[{skey.split('/')[2]}]"
    fix = repair_command(skey, tuple([args.blueprint] if args.blueprint else []) + tuple(args.overrides))
    why = "" if j == first else (f"{damaged[0][0]} cannot be recomputed from what the store holds ({'; '.join(blocked)}"
                                 f"); {name} is the nearest step a rerun can start from under the run's retention. ")
    return f"{why}Repair with `{fix}` (it runs {name} and every later stage again and reuses the ones before it, " \
           "which verified)."


def cmd_show(args) -> int:
    from verlflow.core.store.artifacts import open_store

    bp = _blueprint(args)
    m = open_store(bp.storage).read_manifest(args.stage)
    if m is None:
        raise VerlflowError(f"{args.stage}: no committed stage there (try `verlflow ls --run RUN_ID`).")
    print(json.dumps(m, indent=1))
    return 0


def _pointer_store(args):
    """The store of a pointer command: --store, else the blueprint's storage (its file and overrides)."""
    from verlflow.core.store.artifacts import open_store

    if args.store:
        args.overrides = list(args.overrides) + [f"storage.uri={args.store}"]
    return open_store(_blueprint(args).storage)


def _said(pointer: dict | None) -> str:
    if pointer is None:
        return "(none)"
    value = f", {pointer['metric']}={pointer['value']}" if pointer.get("metric") else ""
    return f"{pointer['run_id']} iteration {pointer['iteration']}{value} ({pointer['hf_uri']})"


def cmd_promote(args) -> int:
    from verlflow.core.store.artifacts import safe_run_id
    from verlflow.core.store.promote import promote_by_hand

    safe_run_id(args.run, "promote RUN")
    for name, before, after in promote_by_hand(_pointer_store(args), args.run, args.iteration):
        print(f"{name}: {_said(before)} -> {_said(after)}")
    return 0


def cmd_rollback(args) -> int:
    from verlflow.core.store.artifacts import safe_name
    from verlflow.core.store.promote import blueprint_pointer, rollback

    safe_name(args.name, "rollback NAME")
    before, after = rollback(_pointer_store(args), args.name)
    print(f"{blueprint_pointer(args.name)}: {_said(before)} -> {_said(after)}")
    return 0


def cmd_compare(args) -> int:
    """Runs side by side: a per-iteration table on stdout (the terminal's width) and a PNG with one panel per metric,
    one line per run; a chain of recurring runs end to end."""
    import shutil

    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.orchestrate.figures import compare_runs, png
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import safe_run_id

    runs = [r for r in args.runs if "=" not in r]
    overrides = [r for r in args.runs if "=" in r] + list(args.overrides)
    if args.store:
        overrides.append(f"storage.uri={args.store}")
    for r in runs:
        safe_run_id(r, "compare RUN")
    bp = load_blueprint(args.blueprint, overrides)
    names = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    result = compare_runs(open_store(bp.storage), runs, names, promote=bp.promote.metric, axis=args.axis)
    print(result.table(width=shutil.get_terminal_size().columns))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(png(result.figure))
    laid = f", the runs of {result.chain}'s chain end to end" if result.chain else ""
    print(f"figure: {args.out} ({len(result.names)} panels, one line per run{laid})")
    return 0


def _run_flow(bp, run_id, from_step) -> int:
    from verlflow.flows.finetune import finetune

    state = finetune(blueprint=bp, run_id=run_id, from_step=from_step, return_state=True)
    if not state.is_completed():
        raise VerlflowError(f"flow run {state.name}: {state.message}")
    out = state.result()
    print(f"\nrun {out['run_id']}: {len(out['iterations'])} iterations")
    for row in out["iterations"]:
        print(f"  {row['iteration']:>3} reward_mean={row['reward_mean']} kl={row['kl']} reused={row['reused'] or '-'}")
    from verlflow.core.store.artifacts import open_store

    store, run_id = open_store(bp.storage), out["run_id"]
    _print_promotion(store, bp, run_id)
    print(f"artifacts: {store.uri(f'runs/{run_id}')}")
    if not os.environ.get("PREFECT_API_URL"):
        print("Flow run, logs and artifacts are in Prefect's database: `prefect server start`, then open "
              "http://127.0.0.1:4200/runs")
    return 0


def cmd_deploy(args) -> int:
    from verlflow.flows.deploy import deploy

    bp = _blueprint(args)
    dep_id = deploy(bp, name=args.name, cron=args.cron, pool=args.pool)
    print(f"deployment finetune/{args.name or bp.name} ({dep_id}) on work pool '{args.pool}'"
          f"{f', cron {args.cron or bp.schedule.cron!r}' if args.cron or bp.schedule.cron else ''}.\n"
          f"Start a worker: prefect worker start --pool {args.pool}\n"
          f"Run it now:     prefect deployment run 'finetune/{args.name or bp.name}'")
    return 0


def cmd_serve(args) -> int:
    from verlflow.core.blueprint import load_blueprint
    from verlflow.flows.deploy import serve

    files = [b for b in args.blueprints if "=" not in b or Path(b).exists()]
    overrides = [b for b in args.blueprints if b not in files]
    bps = [load_blueprint(f, overrides) for f in files] or [load_blueprint(None, overrides)]
    serve(bps, cron=args.cron, limit=args.limit)
    return 0


SCHEDULES_HELP = ("Registering a deployment sets its parameters (the whole blueprint) and its one blueprint "
                  "schedule (--cron, else schedule.cron; none: the old one is removed). Schedules added in the UI "
                  "or through the API are kept, and so is a pause of the blueprint schedule. Each flow run gets its "
                  "own run id, <name>-<scheduled start, UTC>-<8 hex of the flow run id>; a UI Retry keeps it. With "
                  "schedule.init_from: previous, a deployment's runs go in the order they were scheduled, each "
                  "warm-starting from the previous one's promoted policy.")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verlflow", description="Declarative PPO/GRPO post-training pipelines.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)

    s = sub.add_parser("schema", help="print the blueprint's JSON Schema")
    s.set_defaults(fn=cmd_schema)

    s = sub.add_parser("validate-blueprint", help="check a blueprint (types, ranges, files) without running")
    _add_blueprint(s)
    s.set_defaults(fn=cmd_validate_blueprint)

    s = sub.add_parser("make-tiny", help="write a tiny random-init HF model, tokenizer and prompt dataset")
    s.add_argument("out", help="output folder, e.g. tiny/qwen2")
    s.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--task", choices=["digits", "calculator"], default="digits",
                   help="digits: the demo's task; calculator: tool calls for rollout.mode agent")
    s.set_defaults(fn=cmd_make_tiny)

    s = sub.add_parser("run", help="run the pipeline (validate, build, rollout/update/checkpoint x iterations)")
    _add_blueprint(s)
    s.add_argument("--run-id", help="reuse a run id to resume it (default: <name>-<timestamp>)")
    s.add_argument("--from", dest="from_step", metavar="STAGE[ITER]", help="force a restart at this step")
    s.add_argument("--prefect", action="store_true", help="run it as a Prefect flow run (README: Prefect)")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("rerun", help="resume a run: committed stages with the same key are reused")
    s.add_argument("run", help="run id")
    _add_blueprint(s)
    s.add_argument("--from", dest="from_step", metavar="STAGE[ITER]", help="force a restart at this step")
    s.add_argument("--prefect", action="store_true", help="run it as a Prefect flow run (README: Prefect)")
    s.set_defaults(fn=cmd_rerun)

    s = sub.add_parser("deploy", help="create a Prefect deployment of a blueprint on a process work pool",
                       description=SCHEDULES_HELP)
    _add_blueprint(s, required=True)
    s.add_argument("--cron", help="cron schedule (default: the blueprint's schedule.cron)")
    s.add_argument("--name", help="deployment name (default: the blueprint's name)")
    s.add_argument("--pool", default="verlflow", help="process work pool, created if missing (default: verlflow)")
    s.set_defaults(fn=cmd_deploy)

    s = sub.add_parser("serve", help="serve finetune/validate deployments of blueprints from this process",
                       description="Register finetune/<name> and validate/<name> for each blueprint and run their "
                       "flow runs (scheduled, or started from the UI's Run form) in this process until Ctrl-C. "
                       + SCHEDULES_HELP)
    s.add_argument("blueprints", nargs="*", metavar="BLUEPRINT|KEY=VALUE", help="blueprint files and overrides")
    s.add_argument("--cron", help="cron schedule for every blueprint (default: each blueprint's schedule.cron)")
    s.add_argument("--limit", type=int, help="most flow runs executed at once")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("ls", help="list the blueprint's runs (state, iterations, metric), or one run's stages (--run)")
    _add_blueprint(s)
    s.add_argument("--run", help="run id")
    s.add_argument("--all", action="store_true", help="every run in the store, of any blueprint")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("verify", help="check every committed stage of a run against its manifest's checksums")
    s.add_argument("run", help="run id")
    _add_blueprint(s)
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("promote", help="move a run's and its blueprint's latest pointer to an iteration's export")
    s.add_argument("run", help="run id")
    s.add_argument("iteration", type=int, help="an iteration with a committed export stage (export)")
    s.add_argument("--store", help="artifact root (default: the blueprint's storage.uri)")
    _add_blueprint(s)
    s.set_defaults(fn=cmd_promote)

    s = sub.add_parser("rollback", help="move a blueprint's latest pointer back to the previous one of its history")
    s.add_argument("name", help="blueprint name")
    s.add_argument("--store", help="artifact root (default: the blueprint's storage.uri)")
    _add_blueprint(s)
    s.set_defaults(fn=cmd_rollback)

    s = sub.add_parser("show", help="print a committed stage's manifest")
    s.add_argument("stage", help="stage path, e.g. runs/<run>/1/rollout")
    _add_blueprint(s)
    s.set_defaults(fn=cmd_show)

    s = sub.add_parser("compare", help="runs side by side: a per-iteration table and a PNG (one panel per metric)")
    s.add_argument("runs", nargs="+", metavar="RUN", help="run ids (KEY=VALUE overrides may follow)")
    s.add_argument("--blueprint", help="blueprint YAML naming the store (default: embedded defaults)")
    s.add_argument("--store", help="artifact store URI (instead of the blueprint's storage.uri)")
    s.add_argument("--metrics", help="comma-separated metric names, e.g. rollout/reward_mean,eval/accuracy "
                   "(default: reward mean, KL and eval accuracy where recorded, and promote.metric)")
    s.add_argument("--axis", choices=("auto", "run", "chain"), default="auto",
                   help="run: each run from its iteration 1; chain: one blueprint's recurring runs "
                   "(schedule.init_from previous) end to end, iterations counted across the chain; auto (default): "
                   "chain when the runs are one chain's")
    s.add_argument("--out", default="compare.png", help="PNG to write (default: compare.png)")
    s.set_defaults(fn=cmd_compare, overrides=[])
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at the interpreter's exit: a reader gone away shows as the error below
    except BrokenPipeError:  # `verlflow ... | head`: the reader has all it wanted
        _stdout_to_devnull()
        return 141  # 128 + SIGPIPE, as a shell reports a command whose reader went away


def _main(argv: list[str] | None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = parser()
    args, extra = p.parse_known_args(argv)
    # KEY=VALUE overrides may follow options too (`run bp.yaml --run-id r iterations=3`).
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.fn(args)
    except VerlflowError as e:
        print(f"verlflow {args.verb}: error: {e}", file=sys.stderr)
        if getattr(e, "log_file", None):
            print(f"The stage's whole output, every rank's traceback included: {e.log_file}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("verlflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
