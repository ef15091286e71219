"""`verlflow` command line. Errors a user can fix print as one paragraph and exit non-zero."""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
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
    from verlflow.core.blueprint import missing_inputs

    bp = _blueprint(args)
    problems = missing_inputs(bp)
    if problems:
        raise VerlflowError("Blueprint refers to inputs that are missing or unusable:\n  " + "\n  ".join(problems))
    space = _space(bp)
    print(f"{args.blueprint or '<embedded defaults>'}: ok ({bp.name}, {bp.iterations} iterations, "
          f"{bp.resources.world_size} ranks on {bp.resources.device}, store {bp.storage.uri})")
    if bp.eval.files:
        from verlflow.core.ml.evaluate import load_held_out
        from verlflow.core.orchestrate.preflight import eval_sources_line

        print(eval_sources_line(load_held_out(bp.eval)))
    print(space.summary())
    return 0


def cmd_make_tiny(args) -> int:
    from verlflow.core.testing.tinykit import make_tiny

    info = make_tiny(args.out, arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} kit written to {args.out}: model {info.get('model_dir', Path(args.out) / 'model')}")
    return 0


def _space(bp, run_id: str | None = None):
    """The store's room for the run's peak footprint; refused before anything is written when it cannot hold it."""
    from verlflow.core.errors import StoreError
    from verlflow.core.orchestrate.preflight import check_space

    space = check_space(bp, run_id)
    if space.problem():
        raise StoreError(space.problem())
    return space


def _preflight(bp, run_id: str):
    from verlflow.core.blueprint import missing_inputs
    from verlflow.core.orchestrate.runner import open_store

    problems = missing_inputs(bp)
    if problems:
        raise VerlflowError("Blueprint refers to inputs that are missing or unusable:\n  " + "\n  ".join(problems))
    space = _space(bp, run_id)  # refused before the probe writes to the store
    open_store(bp).probe()
    return space


def _print_summary(bp, run_id: str, results) -> None:
    from verlflow.core.orchestrate.runner import open_store

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
    pointer = open_store(bp).get_pointer(f"runs/{run_id}/latest")
    if pointer:
        print(f"latest policy (HF folder): {pointer['hf_uri']}")


def cmd_run(args) -> int:
    from verlflow.core.orchestrate.pipeline import checked_plan, run_pipeline
    from verlflow.core.orchestrate.runner import open_store
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
    store = open_store(bp)
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
    records; a rank's traceback stays in the file, which a failure's message names. Steps end in plan order."""

    def __init__(self, store, run_id: str, steps):
        from verlflow.core.orchestrate.logsink import stage_log_path

        self.paths = [stage_log_path(store, run_id, s.stage, s.iteration) for s in steps]
        self.done = 0
        self.sink = self._open()

    def _open(self):
        from verlflow.core.orchestrate.logsink import LineSink

        return LineSink(self.path, self._show)

    @staticmethod
    def _show(level: int, text: str) -> None:
        if level < logging.ERROR:
            print(text, flush=True)

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

    def close(self) -> None:
        self.sink.close()


def cmd_rerun(args) -> int:
    args.run_id = args.run
    return cmd_run(args)


def _stage_order(stage: str) -> int:
    from verlflow.core.orchestrate.runner import STAGES

    return STAGES.index(stage) if stage in STAGES else len(STAGES)


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
    return VerlflowError(f"run {run}: no such run in {store.root_uri} (`verlflow ls` lists the runs).")


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
    from verlflow.core.orchestrate.runner import open_store
    from verlflow.core.store.artifacts import safe_run_id
    from verlflow.core.store.lease import holder_of

    bp = _blueprint(args)
    if args.run is not None:
        safe_run_id(args.run, "--run")  # before anything is printed
    store = open_store(bp)
    sizes = store.sizes("runs")
    if not args.run:
        for run in sorted({k.split("/")[1] for k in sizes if k.count("/") > 1}):
            print(run)
        return 0
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


def cmd_verify(args) -> int:
    from verlflow.core.orchestrate.runner import open_store
    from verlflow.core.store.artifacts import repair_command, safe_run_id

    bp = _blueprint(args)
    safe_run_id(args.run, "verify RUN")
    store = open_store(bp)
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
        fix = repair_command(damaged[0][1], tuple([args.blueprint] if args.blueprint else []) + tuple(args.overrides))
        raise VerlflowError(f"run {args.run}: {len(damaged)} damaged stage(s) in {store.root_uri}: "
                            f"{', '.join(n for n, _ in damaged)}. Repair with `{fix}` (it runs {damaged[0][0]} and "
                            "every later stage again and reuses the ones before it, which verified).")
    print(f"run {args.run}: every committed stage matches its manifest ({files} files checked)")
    return 0


def cmd_show(args) -> int:
    from verlflow.core.orchestrate.runner import open_store

    bp = _blueprint(args)
    m = open_store(bp).read_manifest(args.stage)
    if m is None:
        raise VerlflowError(f"{args.stage}: no committed stage there (try `verlflow ls --run RUN_ID`).")
    print(json.dumps(m, indent=1))
    return 0


def _pointer_store(args):
    """The store of a pointer command: --store, else the blueprint's storage (its file and overrides)."""
    from verlflow.core.orchestrate.runner import open_store

    if args.store:
        args.overrides = list(args.overrides) + [f"storage.uri={args.store}"]
    return open_store(_blueprint(args))


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
    """Runs side by side: a per-iteration table on stdout and a PNG with one panel per metric, one line per run."""
    from verlflow.core.blueprint import load_blueprint
    from verlflow.core.orchestrate.figures import compare_runs, png
    from verlflow.core.orchestrate.runner import open_store
    from verlflow.core.store.artifacts import safe_run_id

    runs = [r for r in args.runs if "=" not in r]
    overrides = [r for r in args.runs if "=" in r] + list(args.overrides)
    if args.store:
        overrides.append(f"storage.uri={args.store}")
    for r in runs:
        safe_run_id(r, "compare RUN")
    store = open_store(load_blueprint(args.blueprint, overrides))
    names = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    result = compare_runs(store, runs, names)
    print(result.table())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(png(result.figure))
    print(f"figure: {args.out} ({len(result.names)} panels, one line per run)")
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
    from verlflow.core.orchestrate.runner import open_store

    store, run_id = open_store(bp), out["run_id"]
    pointer = store.get_pointer(f"runs/{run_id}/latest")
    if pointer:
        print(f"latest policy (HF folder): {pointer['hf_uri']}")
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

    s = sub.add_parser("ls", help="list runs, or one run's stages (--run)")
    _add_blueprint(s)
    s.add_argument("--run", help="run id")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("verify", help="check every committed stage of a run against its manifest's checksums")
    s.add_argument("run", help="run id")
    _add_blueprint(s)
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("promote", help="move a run's and its blueprint's latest pointer to an iteration's export")
    s.add_argument("run", help="run id")
    s.add_argument("iteration", type=int, help="an iteration with a committed checkpoint stage (export)")
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
                   "(default: reward mean, KL and eval accuracy where recorded)")
    s.add_argument("--out", default="compare.png", help="PNG to write (default: compare.png)")
    s.set_defaults(fn=cmd_compare, overrides=[])
    return p


def main(argv: list[str] | None = None) -> int:
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
