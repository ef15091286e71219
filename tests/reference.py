"""The tiny pipeline's one reference run, shared by the stage, fault and flow tests (a pytest plugin, listed in
tests/conftest.py's `pytest_plugins`).

Fixture:
  reference (session) -> Reference: two GRPO iterations of the tiny blueprint (2 ranks), run `eq`, every stage in
                         one warm pool (the default; test_stages reruns its second iteration as fresh torchrun jobs
                         and compares, and compares it with one monolithic process). Its store is read-only for tests: a test that writes to a store (runs a stage there,
                         adds a run, moves a pointer) works on `reference.copy(tmp_path)`. Under pytest-xdist it runs
                         once for all workers (kits.built_once), so every worker's tests read the same store.

Helpers: copy_store(bp, dst) (any local store), rekey(bp, run_id), clone_stages(src_store, src, dst, steps),
promote_clone(bp, run_id, iteration).
"""

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from kits import built_once
from tinybp import tiny_blueprint

# The stages whose keys hash storage.uri (validate also the resources): in another store they must be re-keyed.
STORE_KEYED = ("validate", "export")


@dataclass(frozen=True)
class Reference:
    kit: dict
    root: Path  # the store's folder
    bp: object  # its Blueprint (storage.uri = root)
    run_id: str
    results: list  # run_pipeline's StageResults, in plan order

    def copy(self, dst: Path):
        """(blueprint, store folder) of a private copy of the store under `dst`, for a test that writes to it."""
        bp, root = copy_store(self.bp, dst)
        rekey(bp, self.run_id)  # every stage reused there, as here
        return bp, root


def copy_store(bp, dst: Path):
    """(blueprint, store folder): a copy of bp's local store under `dst`. Its validate and checkpoint stages
    then rerun, as in any moved store (their keys hold storage.uri), unless rekey'd."""
    root = Path(dst) / "store"
    shutil.copytree(bp.storage.uri.removeprefix("file://"), root)
    bp = bp.model_copy(deep=True)
    bp.storage.uri = str(root)
    return bp, root


def rekey(bp, run_id: str) -> None:
    """Re-commit run_id's validate and checkpoint manifests in bp's store under the keys `bp` computes (inputs and
    files unchanged), as if `bp` had run them there: a copied or cloned run is then reused as a rerun reuses it."""
    from verlflow.core.orchestrate.runner import compute_key
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.artifacts import MANIFEST

    store = open_store(bp.storage)
    for path in store.ls(f"runs/{run_id}"):
        parts = path.split("/")  # runs/<run>/<iteration>/<stage>/manifest.json
        if len(parts) != 5 or parts[3] not in STORE_KEYED or parts[4] != MANIFEST:
            continue
        stage_dir, m = "/".join(parts[:4]), store.read_manifest("/".join(parts[:4]))
        iteration = int(parts[2]) if parts[2].isdigit() else parts[2]
        key = compute_key(parts[3], bp, iteration, {n: i["key"] for n, i in m["inputs"].items()})
        kept = {k: v for k, v in m.items() if k not in ("files", "format", "stage_uri", "committed_at")}
        store.commit(stage_dir, {**kept, "key": key}, m["files"])


def _reference_bp(kit: dict, root: Path):
    # Tests start stages from any of its checkpoints, the build's initial policy too: retention keeps all three.
    # A warm pool (one spawn, ~40 s on 2 loaded cores; fresh jobs took ~250 s): tests that need a stage job's own
    # life (test_faults, test_stages' fresh-jobs equality) ask for FRESH_JOBS on their copies.
    return tiny_blueprint(kit, root, iterations=2, storage__keep_last_checkpoints=3)


@pytest.fixture(scope="session")
def reference(tiny_kit, tmp_path_factory) -> Reference:
    """Run once per session, whatever the number of xdist workers (kits.built_once): tests only read its store."""
    from verlflow.core.orchestrate.runner import StageResult

    def build(folder: Path) -> dict:
        from verlflow.core.orchestrate.pipeline import run_pipeline

        root, lines = folder / "store", []
        results = run_pipeline(_reference_bp(tiny_kit, root), "eq", on_line=lines.append)
        assert len(results) == 2 + 3 * 2, "\n".join(lines[-60:])
        return {"root": str(root), "results": [dataclasses.asdict(r) for r in results]}

    built = built_once(tmp_path_factory, "reference", build)
    root = Path(built["root"])
    return Reference(tiny_kit, root, _reference_bp(tiny_kit, root), "eq",
                     [StageResult(**r) for r in built["results"]])


def clone_stages(src_store, src: str, dst: str, steps, dst_store=None) -> None:
    """Commit copies of committed stages of run `src` as run `dst` (upload every file, then the manifest); steps
    are (iteration, stage) pairs. Keys stay: in another store or for other resources, rekey validate/checkpoint."""
    from verlflow.core.store.artifacts import MANIFEST, stage_key

    dst_store = dst_store or src_store
    for it, stage in steps:
        a, b = stage_key(src, it, stage), stage_key(dst, it, stage)
        m = src_store.read_manifest(a)
        assert m is not None, f"{a} is not committed"
        folder = src_store.materialize(a)
        if dst_store.is_local:
            shutil.copytree(folder, dst_store.local_path(b), ignore=shutil.ignore_patterns(MANIFEST))
        else:
            for rel in m["files"]:
                dst_store.upload_file(folder / rel, f"{b}/{rel}")
        dst_store.commit(b, _rewrite(m, src, dst), m["files"])


def _rewrite(manifest: dict, src: str, dst: str) -> dict:
    kept = {k: v for k, v in manifest.items() if k not in ("files", "format", "stage_uri", "committed_at")}
    kept = json.loads(json.dumps(kept).replace(f"runs/{src}/", f"runs/{dst}/"))
    kept["run_id"] = dst
    return kept


def promote_clone(bp, run_id: str, iteration: int) -> None:
    """Promote a cloned run's checkpoint as its checkpoint stage would have (the run's and bp.name's `latest`)."""
    from verlflow.core.job import JobSpec
    from verlflow.core.orchestrate.pipeline import plan
    from verlflow.core.store.artifacts import open_store
    from verlflow.core.store.promote import PromotePolicy, promote

    step = next(s for s in plan(bp, run_id) if s.stage == "export" and s.iteration == iteration)
    store = open_store(bp.storage)
    out = f"runs/{run_id}/{iteration}/export"
    job = JobSpec.model_construct(run_id=run_id, iteration=iteration, output=out, inputs=step.inputs)
    promote(store, PromotePolicy.of(bp), job, store.read_manifest(out))
