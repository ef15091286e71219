"""Shared fixtures. verl installs its own top-level `tests` package, so helpers here are plain modules."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

pytest_plugins = ["s3server", "kits", "prefect_server", "reference"]


# -- tiers: each test file says which with `pytestmark = pytest.mark.<tier>` (pyproject.toml registers the marks) --
# unit: no torchrun job, no server (`make test-unit`, about a minute); stages: the tiny kit under torchrun; system:
# Prefect, S3, Slurm, Kubernetes, PostgreSQL, Chromium, MLflow. The fixtures below put a test in at least that tier.
TIERS = ("unit", "stages", "system")
NEEDS = {"reference": "stages",
         **dict.fromkeys(("prefect_server", "serve", "tiny_flow_run", "s3_endpoint", "s3_bucket"), "system")}


def _tier(module) -> str | None:
    marks = getattr(module, "pytestmark", [])
    tiers = [m.name for m in (marks if isinstance(marks, list) else [marks]) if m.name in TIERS]
    return tiers[0] if len(tiers) == 1 else None


def _problems(module, tests) -> list[str]:
    """What a test file gets wrong about its tier or its slow tests."""
    tier = _tier(module)
    if tier is None:
        return ["declare exactly one tier: `pytestmark = pytest.mark.unit` (or stages, system; tests/conftest.py)"]
    found = []
    for test in tests:
        for fixture in test.fixturenames:
            need = NEEDS.get(fixture)
            if need and TIERS.index(need) > TIERS.index(tier):
                found.append(f"{test.name} uses `{fixture}`: mark the file `pytest.mark.{need}`, not {tier}")
        if any("test_" not in m.kwargs.get("reason", "") for m in test.iter_markers("slow")):
            found.append(f'{test.name}: name the test in `make test` that covers its story, '
                         f'@pytest.mark.slow(reason="covered by test_...")')
    return found


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A file that breaks a rule above fails to collect, naming itself and the rule (under xdist too)."""
    report = yield
    if isinstance(collector, pytest.Module) and report.passed:
        problems = _problems(collector.obj, [t for t in report.result if isinstance(t, pytest.Function)])
        if problems:
            report.outcome, report.longrepr = "failed", "\n".join(f"{collector.nodeid}: {p}" for p in problems)
    return report


# -- the order files reach the two xdist workers (`--dist loadfile --no-loadscope-reorder`) ----------------------
# Longest first, so that the last file to finish is a short one, and the tier tells the length: system, then stages,
# then unit. Before them the file that builds the session's reference run (tests/reference.py): the one with the
# most tests that read it. While it builds (minutes), the other worker takes the files of each tier that neither wait
# for it nor load the CPU on purpose (`cpu_hog`: beside the build, test_hangs once took 404 s).
def _file_order(items) -> dict:
    files = {}
    for item in items:
        f = files.setdefault(item.path, {"tier": TIERS.index(_tier(item.module)), "reads": 0, "waits": False})
        f["reads"] += "reference" in item.fixturenames
        f["waits"] |= bool({"reference", "cpu_hog"} & set(item.fixturenames))
    builder = max(files, key=lambda p: files[p]["reads"])
    return {p: (p != builder, -f["tier"], f["waits"]) for p, f in files.items()}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    if not items:
        return
    order = _file_order(items)
    items.sort(key=lambda item: order[item.path])  # stable: tests keep their order in a file


# What the order above gave: each xdist worker's seconds in tests and the files it ran last (a worker that ends
# long before the other idles a core), on the controller at the end of `make test`.
_WORKERS: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set by xdist on the controller
    if node is not None:
        files = _WORKERS.setdefault(node.gateway.id, {})
        file = report.nodeid.split("::")[0]
        files[file] = files.pop(file, 0.0) + report.duration  # insertion order: the order it ran them


def pytest_terminal_summary(terminalreporter):
    if len(_WORKERS) > 1:
        terminalreporter.write_sep("-", "xdist workers: seconds in tests, the last three files")
        for worker, files in sorted(_WORKERS.items()):
            last = ", ".join(f"{f.removeprefix('tests/')} {s:.0f} s" for f, s in list(files.items())[-3:])
            terminalreporter.write_line(f"{worker}: {sum(files.values()):.0f} s in {len(files)} files; last: {last}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of tiny-shape tests (more threads only spin, and CI runs two workers on two
    cores); a module asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
