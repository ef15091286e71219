"""Prefect's own overhead per stage task and per flow run, against the server in PREFECT_API_URL.

    PREFECT_API_URL=http://127.0.0.1:4200/api python infra/bench/prefect_overhead.py [--real] [--tasks 20]

1. no-op stages: the stage task with run_stage replaced by a no-op (device slots, the cancel watcher, log lines,
   the markdown artifact and the task run's states stay) against the same calls without Prefect;
2. an empty flow run (in-process), start to finish;
3. --real: the tiny pipeline (1 iteration, 1 rank) once plainly (verlflow.core.orchestrate.pipeline.run_pipeline) and once as a flow
   run: flow wall time against the time spent inside run_stage.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

for k, v in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false"}.items():
    os.environ.setdefault(k, v)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefect import flow  # noqa: E402

from verlflow.core.blueprint import load_blueprint  # noqa: E402
from verlflow.core.orchestrate.runner import RunContext, StageResult, run_stage  # noqa: E402
import verlflow.tasks.stages as ts  # noqa: E402

TINY = ["iterations=1", "data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "algorithm.ppo_mini_batch_size=2", "algorithm.ppo_micro_batch_size_per_gpu=2", "resources.nproc_per_node=1"]


def stats(xs):
    return f"mean {statistics.mean(xs):.3f} s, median {statistics.median(xs):.3f} s, max {max(xs):.3f} s"


def noop_stages(bp, n: int) -> None:
    manifest = {"key": "k", "metrics": {"reward_mean": 0.1}, "timings": {"stage_s": 0.0}, "stage_uri": "file:///x"}

    def fake(ctx, stage, iteration, inputs, **kw):
        for i in range(20):  # a stage's worth of output lines
            ctx.on_line(f"[rank0] line {i}")
        return StageResult(dict(manifest, stage=stage, iteration=iteration), False, 0.0)

    ts.run_stage, ts.is_committed = fake, (lambda *a, **k: False)

    @flow
    def bench() -> list[float]:
        out = []
        for i in range(n):
            t = time.perf_counter()
            ts.stage_task("rollout", i, bp)("rollout", i, {}, bp, "bench", False)
            out.append(time.perf_counter() - t)
        return out

    t = time.perf_counter()
    for i in range(n):
        fake(RunContext(bp, "bench", on_line=lambda line: None), "rollout", i, {})
    plain = (time.perf_counter() - t) / n
    t = time.perf_counter()
    per_task = bench()
    total = time.perf_counter() - t
    print(f"no-op stage task x{n}: {stats(per_task)} (plain call {plain * 1e3:.2f} ms); flow run {total:.2f} s")
    ts.run_stage = run_stage


def empty_flow(k: int = 5) -> None:
    @flow
    def empty() -> None:
        pass

    xs = []
    for _ in range(k):
        t = time.perf_counter()
        empty()
        xs.append(time.perf_counter() - t)
    print(f"empty flow run x{k}: {stats(xs)}")


def real(kit_bp: str) -> None:
    from verlflow.core.orchestrate.pipeline import run_pipeline
    from verlflow.flows.finetune import finetune

    store = tempfile.mkdtemp(prefix="verlflow-bench-")
    bp = load_blueprint(kit_bp, [f"storage.uri={store}", *TINY])
    t = time.perf_counter()
    res = run_pipeline(bp, "plain", on_line=lambda line: None)
    plain, plain_stages = time.perf_counter() - t, sum(r.seconds for r in res)
    inside = []

    def timed(*a, **kw):
        r = run_stage(*a, **kw)
        inside.append(r.seconds)
        return r

    ts.run_stage = timed
    t = time.perf_counter()
    finetune(blueprint=bp, run_id="flow")
    wall = time.perf_counter() - t
    print(f"tiny pipeline plain: {plain:.1f} s (stages {plain_stages:.1f} s)")
    print(f"tiny pipeline as a flow run: {wall:.1f} s, inside run_stage {sum(inside):.1f} s -> Prefect "
          f"{wall - sum(inside):.1f} s for 1 flow run + {len(inside)} tasks")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, default=20)
    p.add_argument("--real", action="store_true")
    p.add_argument("--blueprint", default=str(Path(__file__).resolve().parents[2] / "blueprints/tiny-cpu.yaml"))
    a = p.parse_args()
    bp = load_blueprint(a.blueprint, ["storage.uri=" + tempfile.mkdtemp(), *TINY])
    empty_flow()
    noop_stages(bp, a.tasks)
    if a.real:
        real(a.blueprint)
