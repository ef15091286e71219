"""run_stage: the one core every orchestrator calls. Key -> skip if committed -> torchrun job -> manifest.

A stage's key hashes the blueprint sections it reads, its inputs' keys, its iteration and its code version (the
sources its worker computes with, verlflow.core.store.keys), so a committed stage with the same key is reused (that is how
reruns resume) and a changed field reruns it.
"""

import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import StoreError
from verlflow.core.job import InputRecord, InputRef, JobSpec, ManifestDraft
from verlflow.core.orchestrate.backends import launcher_for, scratch_root
from verlflow.core.orchestrate.launcher import LaunchSpec
from verlflow.core.orchestrate.pool import Background
from verlflow.core.stages import module_of
from verlflow.core.store.artifacts import ArtifactStore, stage_key

log = logging.getLogger("verlflow.runner")

STAGES = ("validate", "build", "rollout", "update", "checkpoint")

# The blueprint sections each stage's outputs depend on. resources is absent on purpose: a checkpoint
# reshards, so a world-size change reuses what was committed and continues.
SECTIONS = {
    "validate": ("model", "data", "reward", "rollout", "fsdp", "resources", "storage", "algorithm.adv_estimator",
                 "algorithm.ppo_mini_batch_size", "algorithm.ppo_micro_batch_size_per_gpu"),
    # build: optimizer hyperparameters are re-applied from the blueprint on every load, so only the
    # estimator (whether a critic exists) matters here.
    "build": ("model", "fsdp", "algorithm.adv_estimator", "seed", "deterministic"),
    "rollout": ("model", "data", "reward", "rollout", "fsdp.mixed_precision", "seed"),
    "update": ("model", "data", "algorithm", "rollout", "fsdp", "seed", "deterministic"),
    "checkpoint": ("storage",),
    "monolithic": ("model", "data", "reward", "algorithm", "rollout", "fsdp", "seed", "deterministic", "iterations"),
}
SINGLE_PROCESS = {"checkpoint"}  # an export needs no process group beyond one rank


def code_version(stage: str) -> str:
    """The code this stage's outputs depend on (verlflow.core.store.keys): its worker's maths, not the CLI, backends or store."""
    return _code_version()[stage]


_CODE_VERSION = None  # {stage: version}, computed once per process (a child may be given its parent's)


def _code_version() -> dict[str, str]:
    global _CODE_VERSION
    if _CODE_VERSION is None:
        from verlflow.core.store.keys import stage_code_versions

        _CODE_VERSION = stage_code_versions()
    return _CODE_VERSION


def open_store(bp: Blueprint) -> ArtifactStore:
    return ArtifactStore(bp.storage.uri, endpoint_url=bp.storage.endpoint_url, region=bp.storage.region)


def compute_key(stage: str, bp: Blueprint, iteration, input_keys: dict[str, str], extra: dict | None = None) -> str:
    payload = {"stage": stage, "iteration": iteration, "sections": bp.section_hash(*SECTIONS[stage]),
               "inputs": dict(sorted(input_keys.items())), "code": code_version(stage), "extra": extra or {}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class StageResult:
    manifest: dict
    skipped: bool
    seconds: float

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def pending(self) -> bool:
        """Its commit is still running in a warm pool's background (resources.async_checkpoint)."""
        return bool(self.manifest.get("pending"))


def stage_status(stage: str, bp: Blueprint, run_id: str, iteration, inputs: dict[str, str], *,
                 store: ArtifactStore | None = None, extra_key: dict | None = None, read_output: bool = True):
    """Read-only: (key, output stage path, committed manifest there or None, input manifests). The stage is
    reusable when the committed manifest's key equals `key`. read_output=False: the output's manifest is not read
    (a forced stage replaces it, even a damaged one)."""
    from verlflow.core.orchestrate.pool import pending_manifest

    store = store or open_store(bp)
    manifests = {}
    for name, skey in inputs.items():
        m = store.read_manifest(skey)
        if m is None and (in_pool := pending_manifest(skey)) is not None:
            m = in_pool[1]  # committing in a warm pool's background: its key and metrics are known
        if m is None:
            raise StoreError(f"{stage}[{iteration}]: input '{name}' ({store.uri(skey)}) is not committed; "
                             "run the earlier stages first (verlflow rerun resumes at the first missing one).")
        manifests[name] = m
    key = compute_key(stage, bp, iteration, {n: m["key"] for n, m in manifests.items()}, extra_key)
    out = stage_key(run_id, iteration, stage)
    return key, out, store.read_manifest(out) if read_output else None, manifests


def run_stage(stage: str, bp: Blueprint, run_id: str, iteration, inputs: dict[str, str], *,
              on_line: Callable[[str], None] = print, cancel: threading.Event | None = None, force: bool = False,
              store: ArtifactStore | None = None, extra_key: dict | None = None, env: dict | None = None) -> StageResult:
    """Run `stage` for `iteration` unless a committed manifest with the same key exists. `inputs` maps an input
    name to the stage key (store path) of a committed stage."""
    t0 = time.time()
    store = store or open_store(bp)
    key, out, existing, manifests = stage_status(stage, bp, run_id, iteration, inputs, store=store,
                                                 extra_key=extra_key, read_output=not force)
    if existing is not None and existing.get("key") == key and not force:
        on_line(f"[verlflow] {stage}[{iteration}] is committed with the same key: reusing {store.uri(out)}")
        return StageResult(existing, True, time.time() - t0)
    res = bp.resources
    single = stage in SINGLE_PROCESS
    # Static multi-node local: every node's agent runs this same call; node 0 leads (clears the output, runs
    # the single-process stages), the others join the torchrun job and leave the store to it.
    multi_local = res.backend == "local" and res.nnodes > 1
    follower = multi_local and res.node_rank > 0
    if follower and single:
        return _await_commit(stage, iteration, store, out, key, res.stage_timeout_s, on_line, cancel, t0)
    if (existing is not None or force) and not follower:
        store.uncommit(out)  # invisible first, then replaced
    if not follower:
        store.rm(out)

    scratch = Path(tempfile.mkdtemp(prefix=f"verlflow-{stage}-", dir=scratch_root(res)))
    job = JobSpec(
        stage=stage, run_id=run_id, iteration=iteration, output=out, scratch=str(scratch), blueprint=bp,
        inputs=inputs, input_manifests={n: InputRecord(key=m["key"], metrics=m.get("metrics", {}),
                                                        lineage=m.get("lineage", [])) for n, m in manifests.items()},
        manifest=ManifestDraft(
            stage=stage, run_id=run_id, iteration=iteration, key=key,
            inputs={n: InputRef(stage=inputs[n], key=m["key"]) for n, m in manifests.items()},
            blueprint_hash=bp.hash(), blueprint_name=bp.name, code_version=code_version(stage),
            lineage=_lineage(manifests, inputs)),
        launched_at=time.time())
    # A job with its own environment needs its own processes: a pool's environment was fixed at its start.
    pool = _warm_pool(res, on_line) if res.warm_pool and not env else None
    pending = sorted(n for n, m in manifests.items() if m.get("pending"))
    if pending:
        # Only the pool that commits an input can wait for it inside the job; any other job starts after it landed.
        _await_inputs(pool, {n: inputs[n] for n in pending}, store, cancel, on_line)
        job.pending_inputs = [n for n in pending if store.read_manifest(inputs[n]) is None]
    job_file = job.write(scratch / "job.json")
    nproc = res.nproc_per_node if pool else 1 if single else res.nproc_per_node
    multi = multi_local and not single
    spec = LaunchSpec(module=module_of(stage), args=[str(job_file)], job_arg=0, nproc_per_node=nproc,
                      nnodes=1 if single else res.nnodes, timeout_s=res.stage_timeout_s,
                      node_rank=res.node_rank if multi else 0, rdzv_endpoint=res.rdzv_endpoint if multi else None,
                      rdzv_id=f"vf-{key[:20]}" if multi else None,  # the same on every node's agent
                      env={**_worker_env(nproc), **(env or {})}, log_dir=str(scratch / "logs"))
    where = f", node {res.node_rank} of {res.nnodes}" if multi else ""
    on_line(f"[verlflow] {stage}[{iteration}] -> {store.uri(out)} ({nproc} x {spec.nnodes} ranks, "
            f"{res.backend}{where}{', warm pool' if pool else ''})")
    background = False
    try:
        if pool is not None:
            try:
                done = pool.run(stage, job_file, on_line=on_line, cancel=cancel, timeout_s=res.stage_timeout_s)
            finally:
                pool.busy.release()
            if done.get("pending"):
                background = True
                manifest = {**done["manifest"], "pending": True}
                pool.pending[out] = Background(manifest, f"{stage}[{iteration}]", on_line,
                                               *_landed_and_discard(store, out, key, scratch))
                on_line(f"[verlflow] {stage}[{iteration}] done; its commit runs in the warm pool's background")
                return StageResult(manifest, False, time.time() - t0)
        else:
            with _gpus(res, nproc, spec, on_line):
                launcher_for(res)(spec, on_line=on_line, cancel=cancel)
    except BaseException:
        try:
            if not follower and store.read_manifest(out) is None:
                store.rm(out)  # a failed stage leaves nothing behind, not even invisible partial data
        except Exception as exc:  # e.g. the S3 endpoint is down: keep the job's own error, not this one
            on_line(f"[verlflow] {stage}[{iteration}]: could not remove the partial output at {store.uri(out)} "
                    f"({type(exc).__name__}); it has no manifest, so nothing reads it, and the rerun replaces it")
        raise
    finally:
        if not background:  # else the pool removes it after the commit (a remote store's output is in it)
            shutil.rmtree(scratch, ignore_errors=True)
    manifest = store.read_manifest(out)
    if manifest is None or manifest.get("key") != key:
        raise StoreError(f"{stage}[{iteration}]: the job exited cleanly but committed no manifest at {store.uri(out)}")
    return StageResult(manifest, False, time.time() - t0)


def _landed_and_discard(store: ArtifactStore, out: str, key: str, scratch: Path):
    """For a stage committing in a pool's background: whether its commit landed, and the clean-up after the pool."""

    def landed() -> bool:
        return (store.read_manifest(out) or {}).get("key") == key

    def discard() -> None:
        shutil.rmtree(scratch, ignore_errors=True)  # a remote store's output was staged there
        if not landed():
            try:
                store.rm(out)  # a failed stage leaves nothing behind (a full disk: its partial files)
            except Exception:  # noqa: BLE001 - e.g. S3 down: it has no manifest, nothing reads it, a rerun replaces it
                pass

    return landed, discard


def _await_inputs(pool, inputs: dict[str, str], store: ArtifactStore, cancel, on_line) -> None:
    """Wait until inputs that a warm pool commits in its background have landed, unless this job runs in that
    same pool (which waits inside the job, and only if the stage reads the files)."""
    from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
    from verlflow.core.orchestrate.pool import pending_manifest

    for name, skey in inputs.items():
        owner = pending_manifest(skey)
        if owner is None or owner[0] is pool:
            continue
        on_line(f"[verlflow] waiting for {store.uri(skey)} ({name}) to be committed by the warm pool")
        while store.read_manifest(skey) is None:
            if not owner[0].alive:
                raise StageFailure(FailureKind.UNKNOWN, f"input '{name}' ({store.uri(skey)}) was never committed: "
                                   f"the warm worker pool committing it exited ({owner[0].error})")
            if cancel is not None and cancel.is_set():
                raise StageFailure(FailureKind.CANCELLED, f"cancelled while waiting for {store.uri(skey)}")
            time.sleep(0.2)


def _await_commit(stage, iteration, store, out, key, timeout_s, on_line, cancel, t0) -> StageResult:
    """A follower node (node_rank > 0) of a static multi-node run: node 0 runs a single-process stage alone."""
    from verlflow.core.orchestrate.launcher import FailureKind, StageFailure

    on_line(f"[verlflow] {stage}[{iteration}] runs on node 0 only: waiting for its commit at {store.uri(out)}")
    deadline = time.monotonic() + timeout_s
    while True:
        m = store.read_manifest(out)
        if m is not None and m.get("key") == key:
            return StageResult(m, False, time.time() - t0)
        if cancel is not None and cancel.is_set():
            raise StageFailure(FailureKind.CANCELLED, f"{stage}[{iteration}]: cancelled while waiting for node 0")
        if time.monotonic() > deadline:
            raise StageFailure(FailureKind.TIMEOUT, f"{stage}[{iteration}]: node 0 did not commit it within "
                               f"{timeout_s} s (resources.stage_timeout_s)")
        time.sleep(0.5)


def _warm_pool(res, on_line):
    """This node's warm pool for these resources (verlflow.core.orchestrate.pool), or None (outside warm_pools(), or busy)."""
    from verlflow.core.orchestrate import pool as P

    nproc = res.nproc_per_node

    def make() -> "P.WarmPool":
        pool = P.WarmPool(nproc, _worker_env(nproc), scratch_root(res), on_line)
        pool.commit_timeout_s = res.stage_timeout_s
        if res.device == "cuda":
            from verlflow.core.orchestrate import devices

            ids = pool.resources.enter_context(devices.claim(nproc, devices.visible_devices(), on_wait=on_line))
            pool.spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        return pool

    return P.acquire((nproc, res.device, str(scratch_root(res))), make)


@contextmanager
def _gpus(res, nproc: int, spec: LaunchSpec, on_line):
    """Local CUDA jobs get distinct GPUs of this host (held while the job runs) via CUDA_VISIBLE_DEVICES."""
    if res.backend != "local" or res.device != "cuda":
        yield
        return
    from verlflow.core.orchestrate import devices

    with devices.claim(nproc, devices.visible_devices(), on_wait=on_line) as ids:
        spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        yield


def _worker_env(nproc: int) -> dict:
    """Quiet, offline workers; threads split between the ranks of this node (torchrun would pick 1)."""
    import os

    cache = Path(os.environ.get("VERLFLOW_CACHE_DIR") or Path.home() / ".cache" / "verlflow")
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           # fsdp.compile's kernels survive the job (and /tmp cleaning): the next stage job loads them
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    return {k: v for k, v in env.items() if k not in os.environ}


def _lineage(manifests: dict, inputs: dict) -> list:
    """Warm-start ancestry: carried forward from inputs so every manifest knows where its weights came from."""
    if "warm_start" in manifests:
        m = manifests["warm_start"]
        return m.get("lineage", []) + [{"run_id": m.get("run_id"), "iteration": m.get("iteration"),
                                        "stage": inputs["warm_start"], "key": m["key"]}]
    for name in ("policy", "build", "update"):
        if name in manifests and manifests[name].get("lineage"):
            return manifests[name]["lineage"]
    return []
