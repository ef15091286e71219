"""verlflow installs one import namespace, `verlflow`: the folders core/, tasks/ and flows/ at the repository root
are `verlflow.core`, `verlflow.tasks` and `verlflow.flows`. A user's own top-level `core`, `flows` or `tasks`
package (a Prefect project's usual folders) shadows nothing, not even in the torchrun jobs started in its folder;
every module path the code, the infra files and the deployments spell exists."""

import importlib
import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from tinybp import tiny_blueprint

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
VERLFLOW = str(Path(sys.executable).parent / "verlflow")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_is_the_folders_holding_an_init():
    cfg = _pyproject()
    folders = set()
    for package, folder in cfg["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            folders.add(".".join((package, *rel)))
    assert sorted(cfg["packages"]) == sorted(folders)
    assert {p.split(".")[0] for p in cfg["packages"]} == {"verlflow"}


def test_a_wheel_installs_only_verlflow_and_runs_from_its_own_files(tmp_path):
    """`pip install .` of the wheel into a fresh venv: its site-packages gains `verlflow` and its dist-info only;
    every module imports from the installed files (none is left out of the wheel) and the console script runs."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("verlflow-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"verlflow"}, tops

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    site = next(venv.glob("lib/python*/site-packages"))
    added = {p.name for p in site.iterdir()} - {"_virtualenv.py", "_virtualenv.pth", "__pycache__"}
    assert {a for a in added if not a.endswith(".dist-info")} == {"verlflow"}, added
    # Dependencies from this environment (a path line, so its editable finder of the checkout is not loaded).
    (site / "deps.pth").write_text(str(next(Path(sys.prefix).glob("lib/python*/site-packages"))) + "\n")
    code = ("import importlib, pkgutil, verlflow, verlflow.core\n"
            "names = [m.name for m in pkgutil.walk_packages(verlflow.core.__path__, 'verlflow.core.')]\n"
            "names += ['verlflow.tasks.stages', 'verlflow.flows.finetune', 'verlflow.flows.deploy']\n"
            "for n in names: importlib.import_module(n)\n"
            "import verlflow.core.orchestrate.runner as r; print(len(names), r.__file__)")
    p = subprocess.run([str(venv / "bin/python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    count, where = p.stdout.split()
    assert int(count) > 40 and where.startswith(str(site)), p.stdout
    p = subprocess.run([str(venv / "bin/verlflow"), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "rerun" in p.stdout, p.stderr[-2000:]


@pytest.fixture
def shadowing_dir(tmp_path):
    """A user's project folder with its own core/, flows/ and tasks/ packages, each refusing to be imported."""
    project = tmp_path / "project"
    for name in ("core", "flows", "tasks"):
        (project / name / "stages").mkdir(parents=True)
        for init in (project / name / "__init__.py", project / name / "stages" / "__init__.py"):
            init.write_text(f"raise ImportError('the user project\\'s own {name} package was imported')\n")
    return project


def _blueprint_file(kit, tmp_path, **overrides) -> Path:
    bp = tiny_blueprint(kit, tmp_path / "store", **overrides)
    f = tmp_path / "bp.yaml"
    f.write_text(yaml.safe_dump(bp.model_dump(mode="json")))
    return f


def _committed(tmp_path, run_id: str) -> bool:
    from verlflow.core.store.artifacts import ArtifactStore, stage_key

    return ArtifactStore(str(tmp_path / "store")).read_manifest(stage_key(run_id, 1, "export")) is not None


def test_a_project_with_its_own_core_flows_and_tasks_runs_the_cli(tiny_kit, tmp_path, shadowing_dir):
    """The stage jobs (a warm pool: `python -m verlflow.core.stages.pool`, the same `-m` start as a fresh stage
    job) run with the project folder first on sys.path."""
    bp = _blueprint_file(tiny_kit, tmp_path, resources__warm_workers=True)
    p = subprocess.run([VERLFLOW, "run", str(bp), "--run-id", "shadow"], cwd=shadowing_dir, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "export[1]" in p.stdout + p.stderr and _committed(tmp_path, "shadow")


@pytest.mark.slow(reason="covered by test_packaging::test_a_project_with_its_own_core_flows_and_tasks_runs_the_cli")
def test_a_project_with_its_own_core_flows_and_tasks_runs_the_flow(tiny_kit, tmp_path, shadowing_dir,
                                                                    prefect_server):
    """The Prefect flow run, against a real server, from the same folder."""
    bp = _blueprint_file(tiny_kit, tmp_path, resources__warm_workers=True)
    p = subprocess.run([VERLFLOW, "run", str(bp), "--run-id", "shadow-flow", "--prefect"], cwd=shadowing_dir,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert _committed(tmp_path, "shadow-flow")


_MODULE_PATH = re.compile(r"\bverlflow\.(?:core|tasks|flows)(?:\.\w+)+")


def _resolves(path: str) -> bool:
    """A module, or an attribute of one (`verlflow.flows.finetune.finetune`, `...cli:main`)."""
    path = path.replace(":", ".")
    module, _, attr = path.rpartition(".")
    return _is_module(path) or (_is_module(module) and hasattr(importlib.import_module(module), attr))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False


def test_every_module_path_named_in_code_infra_and_docs_exists():
    files = [*REPO.glob("core/**/*.py"), *REPO.glob("tasks/**/*.py"), *REPO.glob("flows/**/*.py"),
             *REPO.glob("infra/**/*"), REPO / "README.md", REPO / "pyproject.toml",
             *REPO.glob("blueprints/*.yaml")]
    named = {}
    for f in files:
        if f.is_file() and f.suffix not in (".json", ".png"):
            for m in _MODULE_PATH.finditer(f.read_text(errors="replace")):
                named.setdefault(m.group(0).rstrip("."), f.relative_to(REPO))
    assert len(named) > 40
    missing = {path: str(f) for path, f in named.items() if not _resolves(path)}
    assert not missing, missing


def test_each_stage_s_module_is_the_one_torchrun_runs():
    from verlflow.core.stagespec import POOL, SPECS

    for name in [*(s.module for s in SPECS.values()), POOL]:
        module = importlib.import_module(name)
        assert module.__name__ == name and callable(module.main), name


def test_every_third_party_import_is_a_declared_dependency():
    """What core/, tasks/ and flows/ import (at any depth, lazily too) comes from a distribution pyproject names."""
    import ast
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name.lower() for r in project["dependencies"]}
    declared |= {Requirement(r).name.lower() for extra in project["optional-dependencies"].values() for r in extra}
    imported = set()
    for f in [*REPO.glob("core/**/*.py"), *REPO.glob("tasks/**/*.py"), *REPO.glob("flows/**/*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    imported -= set(sys.stdlib_module_names) | {"verlflow"}
    imported.discard("triton")  # optional: comes with CUDA builds of torch; fastgen's kernels check for it
    dists = packages_distributions()
    undeclared = {m: dists.get(m) for m in imported if not {d.lower() for d in dists.get(m, [])} & declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
