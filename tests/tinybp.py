"""The one tiny CPU blueprint for tests, pointed at a kit and a store, with overrides.

Overrides come as dotted strings (`"algorithm.lr=0.01"`) or keyword arguments (`algorithm__lr=0.01`); later
ones win. ONE_RANK is the smaller shape the flow, CLI and server tests use: one rank, fewer samples.
"""

import json

# Small sizes so a stage job is seconds on 2 cores.
BASE = {
    "data.batch_size": 4, "data.max_prompt_length": 64, "rollout.n": 4, "rollout.max_new_tokens": 8,
    "algorithm.ppo_mini_batch_size": 2, "algorithm.ppo_micro_batch_size_per_gpu": 4, "algorithm.lr": 3e-3,
    "resources.nproc_per_node": 2, "resources.stage_timeout_s": 300, "iterations": 1,
    "tracking.backends": [],  # the tracking tests turn it on: an MLflow store per run costs seconds
    # One torchrun job per pipeline: a fresh job per stage costs ~5 s of imports per rank (torch, DTensor's sympy,
    # transformers, verl; ~10 s where the venv is not byte-compiled), more than the tiny pipeline's own work. Tests of a stage job's life (kills, hangs, timeouts,
    # process trees) ask for FRESH_JOBS; backends other than one local node get it by themselves.
    "resources.warm_workers": True,
}
FRESH_JOBS = "resources.warm_workers=false"
# One rank unless ranks are the point (tests of orchestration, not of the maths).
ONE_RANK = ("resources.nproc_per_node=1", "rollout.n=2", "rollout.max_new_tokens=4",
            "algorithm.ppo_micro_batch_size_per_gpu=2")


def tiny_blueprint(kit: dict, store, *overrides: str, **fields):
    """`algorithm__lr=0.01` -> algorithm.lr=0.01; string overrides (`"name=x"`) apply after the keywords."""
    from verlflow.core.blueprint import load_blueprint

    return load_blueprint(None, tiny_overrides(kit, store, *overrides, **fields))


def tiny_overrides(kit: dict, store, *overrides: str, **fields) -> list[str]:
    """The tiny blueprint as `a.b=value` overrides of the defaults (what `verlflow run` takes on its command line)."""
    base = {"model.path": kit["model_dir"], "data.train_files": [kit["train_file"]], "storage.uri": str(store),
            **BASE}
    base.update({k.replace("__", "."): v for k, v in fields.items()})
    out = [f"{k}={_yaml(v)}" for k, v in base.items()] + list(overrides)
    return out + ([FRESH_JOBS] if _pool_refused(out) else [])


def _pool_refused(overrides: list[str]) -> bool:
    """Whether the overrides leave the run on something other than one local node (warm pools are refused there)."""
    last = dict(o.split("=", 1) for o in overrides)
    return last.get("resources.backend", "local") != "local" or int(last.get("resources.nnodes", 1)) > 1


def _yaml(v) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else str(v)


def prompt_rows(n: int = 3) -> dict:
    """Columns of an n-row RL parquet in verl's schema (the tiny task), for tests that write their own data."""
    return {
        "prompt": [[{"role": "user", "content": f"Write the digit {i} twice."}] for i in range(n)],
        "data_source": ["tiny_digits"] * n,
        "reward_model": [{"style": "rule", "ground_truth": f"{i}{i}"} for i in range(n)],
        "extra_info": [{"split": "train", "index": i} for i in range(n)],
    }
