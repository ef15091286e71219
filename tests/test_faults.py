"""Faults survived with nothing lost (issue 6): real torchrun jobs on the tiny kit, a real S3 endpoint (moto behind
a proxy that can stop mid-upload), real Prefect (tests/prefect_server.py).

Every fault test ends with `assert_nothing_lost`: each committed stage still verifies against its manifest
(checksums through ArtifactStore.materialize), a stage without a manifest has no files at all (nothing
half-written is visible), there are no temporary files, and the rerun completes. Where the settings are
deterministic the final policy weights are compared with those of one uninterrupted reference run (`ref`).

Time on 2 CPU cores: every stage job spends most of its 8-20 s importing torch/transformers, so the stages a
scenario does not exercise are *cloned* from the session's reference run (tests/reference.py, 2 ranks; copied
into this module's store, then cloned per scenario: same keys, manifests rewritten to the new run id, as if that
run had committed them), and jobs run on 1 rank unless ranks are the point. On the tiny kit an update on 1 rank
and on 2 ranks of the same rollout give bit-identical weights, so the 1-rank reruns are compared with the
reference's 2-rank update.

Fault hooks (core/testing/faults.py, read by the stage workers): VERLFLOW_FAULT=kill_rank<N>_in_update | hang_in_<stage>
| nan_loss, and VERLFLOW_FAULT_ONCE=<marker file> so only the first job fires it.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from reference import clone_stages, promote_clone, rekey
from tinybp import FRESH_JOBS, prompt_rows, tiny_blueprint

from verlflow.core.errors import ChecksumError, StoreError
from verlflow.core.ml import checkpoint, model as M
from verlflow.core.orchestrate.launcher import FailureKind, StageFailure
from verlflow.core.orchestrate.pipeline import plan, run_pipeline
from verlflow.core.orchestrate.runner import RunContext, run_stage
from verlflow.core.store.artifacts import MANIFEST, ArtifactStore, stage_key

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
ALL = [("init", "validate"), ("init", "build"), (1, "rollout"), (1, "update"), (1, "export")]
UP_TO_ROLLOUT, UP_TO_UPDATE = ALL[:3], ALL[:4]


# ------------------------------------------------------------------------------------------------ helpers


class Lines(list):
    """on_line sink: keeps the job output, so a failing assertion can show it."""

    def __call__(self, line: str) -> None:
        self.append(line)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self[-n:])


@dataclass
class Ref:
    """One uninterrupted 1-iteration run `ref` in a store shared by the file:// scenarios."""

    kit: dict
    root: Path
    bp: object  # its blueprint as the scenarios run it: 1 rank
    results: list  # its committed manifests, in plan order

    @property
    def store(self) -> ArtifactStore:
        return ArtifactStore(self.root)

    def variant(self, **overrides):
        """The reference blueprint with changes. Keys do not depend on `name`, so cloned stages are reused."""
        return tiny_blueprint(self.kit, self.root, FRESH_JOBS,
                              **{"resources__nproc_per_node": 1, "name": "faults", **overrides})

    def clone(self, dst: str, steps) -> None:
        clone_stages(self.store, "ref", dst, steps)

    def rerun(self, run_id: str) -> list:
        """run_pipeline of run_id again once its fault is gone, in a warm pool: the fault was a stage job's own and
        the resume is the subject here; one pool starts its rank once, fresh update and export jobs twice (5-9 CPU-s).
        validate is re-keyed for the pool's resources, as a copy of the reference is for fresh jobs."""
        bp = tiny_blueprint(self.kit, self.root, resources__nproc_per_node=1, name="faults")
        assert bp.resources.warm_pool
        rekey(bp, run_id)
        return run_pipeline(bp, run_id, on_line=Lines())


@pytest.fixture(scope="module")
def ref(reference, tmp_path_factory) -> Ref:
    """The session's reference run (tests/reference.py), its first iteration cloned as run `ref` of blueprint
    `faults` and promoted, in a copy of its store: the scenarios add runs and move pointers there."""
    _, root = reference.copy(tmp_path_factory.mktemp("faults"))
    # This file's faults happen to a stage's own torchrun job (test_pool has the warm pool's).
    bp = tiny_blueprint(reference.kit, root, FRESH_JOBS, resources__nproc_per_node=1, name="faults")
    store = ArtifactStore(root)
    clone_stages(store, reference.run_id, "ref", ALL)
    rekey(bp, "ref")  # validate's key holds the resources: 1 rank here
    promote_clone(bp, "ref", 1)
    results = [store.read_manifest(stage_key("ref", it, stage)) for it, stage in ALL]
    assert [m["stage"] for m in results] == ["validate", "build", "rollout", "update", "export"]
    return Ref(reference.kit, root, bp, results)


def assert_nothing_lost(store: ArtifactStore, run_id: str, committed) -> None:
    """Exactly `committed` stages of the run are committed, each verifies file by file and holds no other file;
    uncommitted stages have no files; no temporary or partial file exists anywhere in the store."""
    want = {stage_key(run_id, it, s) for it, s in committed}
    files = store.ls(f"runs/{run_id}")
    by_stage: dict[str, set] = {}
    for f in files:
        parts = f.split("/")
        by_stage.setdefault("/".join(parts[:4]), set()).add("/".join(parts[4:]))
    found = {sk for sk in by_stage if store.read_manifest(sk) is not None}
    assert found == want, f"committed {sorted(found)}, expected {sorted(want)}"
    for sk in want:
        m = store.read_manifest(sk)
        store.materialize(sk)  # every file against its sha256 and size (downloads for s3://)
        assert by_stage[sk] == set(m["files"]) | {MANIFEST}, f"{sk}: files not in its manifest"
        entry = json.loads(store.get_bytes(f"index/{m['key']}.json"))
        assert store.lookup(m["key"])["key"] == m["key"], entry
    half = {sk: sorted(rels) for sk, rels in by_stage.items() if sk not in want}
    assert not half, f"files of uncommitted stages are visible: {half}"
    temp = [f for f in store.ls() if f.endswith((".tmp", ".part"))]
    assert not temp, temp


def policy_weights(store: ArtifactStore, run_id: str, bp, it=1) -> dict:
    meta = store.materialize(stage_key(run_id, "init", "build")) / "hf_meta"
    model = M.build_module(meta, bp.model)
    checkpoint.load_full(store.materialize(stage_key(run_id, it, "update")) / "policy", model)
    return model.state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def skipped(results) -> dict:
    return {f"{r.manifest['stage']}[{r.manifest['iteration']}]": r.skipped for r in results}


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def find_job(root_pid: int, stage: str, still=lambda: True, timeout_s: float = 120) -> list[psutil.Process]:
    """[torchrun, *workers] of the `verlflow.core.stages.<stage>` job below root_pid, once its workers exist."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert still(), f"the process running the pipeline ended before the {stage} job started"
        try:
            kids = psutil.Process(root_pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for p in kids:
            try:
                cmd = p.cmdline()
                if "torch.distributed.run" in cmd and f"verlflow.core.stages.{stage}" in cmd:
                    workers = [w for w in p.children(recursive=True) if _alive(w)]
                    if workers:
                        return [p, *workers]
            except psutil.Error:
                pass
        time.sleep(0.1)
    pytest.fail(f"no {stage} job appeared within {timeout_s:.0f} s")


def live_in_groups(pgids: set[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids and _alive(p):
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def wait_gone(procs, timeout_s: float = 20) -> list:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def own_slot_pool(monkeypatch, slots: int = 4) -> str:
    """Device slots of a pool of this test's own (tasks/slots.py reads these per call): slots that another test
    left held cannot block this one. Spare slots: a hung job's lease may outlive it (see the README section)."""
    pool = f"faults-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("VERLFLOW_SLOT_POOL", pool)
    monkeypatch.setenv("VERLFLOW_SLOTS", str(slots))
    return pool


def code_pin() -> str:
    """Child processes use this process's code version: core/ may be edited by others while the suite runs."""
    from verlflow.core.orchestrate.runner import _code_version

    return f"import verlflow.core.orchestrate.runner as _r; _r._CODE_VERSION = {_code_version()!r}\n"


# ------------------------------------------------------------------------ 1. SIGKILL of one rank in update


def test_sigkill_of_one_rank_in_update(ref, monkeypatch):
    """Rank 1 of a 2-rank update SIGKILLs itself after the first optimizer step. The failure names rank 1 and
    SIGKILL and is retryable; nothing of update is committed; the rerun (run_pipeline, same run id) resumes at
    update, reusing the committed rollout, and ends with the weights of the uninterrupted reference."""
    ref.clone("kill", UP_TO_ROLLOUT)
    bp2 = ref.variant(resources__nproc_per_node=2)
    step = next(s for s in plan(bp2, "kill") if s.name == "update[1]")
    monkeypatch.setenv("VERLFLOW_FAULT", "kill_rank1_in_update")
    lines = Lines()
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(bp2, "kill", on_line=lines), "update", 1, step.inputs)
    err = e.value
    assert (err.kind, err.rank, err.signal, err.retryable) == (FailureKind.KILLED, 1, "SIGKILL", True), lines.tail()
    assert "rank 1 was killed by SIGKILL" in str(err)
    assert any("rank 1: SIGKILL in update" in line for line in lines)  # after the first optimizer step
    assert_nothing_lost(ref.store, "kill", UP_TO_ROLLOUT)

    monkeypatch.delenv("VERLFLOW_FAULT")
    results = ref.rerun("kill")
    assert skipped(results) == {"validate[init]": True, "build[init]": True, "rollout[1]": True,
                                "update[1]": False, "export[1]": False}
    assert_nothing_lost(ref.store, "kill", ALL)
    assert_same_weights(policy_weights(ref.store, "kill", ref.bp), policy_weights(ref.store, "ref", ref.bp))


# --------------------------------------------------------------- 1b. one rank runs out of memory in update


def test_out_of_memory_on_one_rank_runs_the_update_again_at_half(ref, monkeypatch):
    """Rank 1 of a 2-rank update runs out of memory on a micro-batch of 4 samples (VERLFLOW_FAULT=
    oom_rank1_above<T>, T what the batch's 2 longest samples hold). The error names the stage, the micro-batch's
    tokens, the card and the setting (now 4, try 2); the runner runs the update again once (resources.oom_retry, on
    by default), both ranks at 2 samples a micro-batch, which stays under T; it commits, its metrics say so, and
    its weights are the uninterrupted reference's up to the order of the sums."""
    from verlflow.core.ml.rollout import load_batch

    ref.clone("oom", UP_TO_ROLLOUT)
    bp2 = ref.variant(resources__nproc_per_node=2)
    step = next(s for s in plan(bp2, "oom") if s.name == "update[1]")
    batch = load_batch(ref.store.materialize(stage_key("oom", 1, "rollout")))
    tokens = sorted(int(n) for n in batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1))
    above = sum(tokens[-2:])
    assert sum(tokens[:4]) > above  # every micro-batch of 4 samples is above it, none of 2
    monkeypatch.setenv("VERLFLOW_FAULT", f"oom_rank1_above{above}")
    lines = Lines()
    result = run_stage(RunContext(bp2, "oom", on_line=lines), "update", 1, step.inputs)
    said = "\n".join(lines)
    assert "rank 1: out of memory on a micro-batch of" in said  # the fault fired, in the first job only
    assert said.count("[verlflow fault]") == 1, lines.tail()
    assert "update[1] ran out of memory: rank 1 failed (exit code 1): DeviceOutOfMemory: out of memory in " \
           "update[1] on rank 1, cpu (" in said
    assert "while working on micro batch tokens " in said and ", samples 4" in said
    assert "Lower it with algorithm.ppo_micro_batch_size_per_gpu (now 4; try 2)" in said
    assert "update[1]: running it again once with its micro-batches at half (resources.oom_retry)" in said
    m = result.manifest
    assert (m["world_size"], m["metrics"]["oom_retries"], m["metrics"]["ppo_micro_batch_size_per_gpu"]) == (2, 1, 2)
    assert_nothing_lost(ref.store, "oom", UP_TO_UPDATE)
    ours, theirs = policy_weights(ref.store, "oom", ref.bp), policy_weights(ref.store, "ref", ref.bp)
    for k, w in theirs.items():
        torch.testing.assert_close(ours[k], w, atol=3e-5, rtol=0)  # 1 % of an Adam step at lr 3e-3


# ------------------------------------------------------------------ 2. the S3 endpoint stops during an upload


class CuttableEndpoint:
    """A TCP proxy in front of the moto server: the S3 endpoint verlflow talks to. After `cut_at(pattern, n)`,
    the n-th request whose bytes hold `pattern` is never forwarded: the endpoint stops, every open connection
    is reset, and each new connection is accepted and reset at once (its time kept in `attempts`).
    `restore()` brings it back; moto keeps the bucket's state throughout."""

    def __init__(self, target: str):
        host, port = target.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.down, self.pattern, self.n, self.seen = False, b"", 0, 0
        self.attempts: list[float] = []
        self.cut_time: float | None = None
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at(self, pattern: bytes, n: int) -> None:
        with self.lock:
            self.pattern, self.n, self.seen = pattern, n, 0

    def restore(self) -> None:
        with self.lock:
            self.down, self.pattern = False, b""

    @staticmethod
    def _reset(s: socket.socket) -> None:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                if self.down:
                    self.attempts.append(time.monotonic())
                    self._reset(client)
                    continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                self._reset(client)
                continue
            with self.lock:
                self.open |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if watch and self.pattern:
                    with self.lock:
                        self.seen += (tail + data).count(self.pattern)
                        tail = data[-len(self.pattern) + 1:]
                        if self.seen >= self.n and not self.down:
                            self.down, self.cut_time = True, time.monotonic()
                            for s in self.open:
                                self._reset(s)
                            self.open.clear()
                            return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open -= {src, dst}
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass


@pytest.fixture
def own_s3(monkeypatch, tmp_path):
    """A moto server and bucket of this test's own (the environment set as tests/s3server.py's s3_bucket sets
    it): the endpoint tests reset connections in the middle of requests, and whatever that does to a server
    must not reach the session's server that later tests use."""
    import s3fs
    from s3server import REGION, S3Bucket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        for var in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(var, raising=False)
        bucket = S3Bucket(url, f"faults-{uuid.uuid4().hex[:8]}")
        for k, v in {"AWS_ACCESS_KEY_ID": bucket.key_id, "AWS_SECRET_ACCESS_KEY": bucket.secret,
                     "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": url,
                     "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
            monkeypatch.setenv(k, v)
        bucket.client().create_bucket(Bucket=bucket.name)
        s3fs.S3FileSystem.clear_instance_cache()
        yield bucket
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def endpoint(own_s3, monkeypatch):
    proxy = CuttableEndpoint(own_s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # this process, its torchrun jobs and their ranks
    yield proxy
    proxy.server.close()


def test_s3_retries_are_bounded_with_backoff(endpoint, own_s3, monkeypatch):
    """The store's own contract (core/store/artifacts.py): at most 2 x VERLFLOW_S3_MAX_ATTEMPTS requests per call, with
    backoff between them, then a StoreError naming the URI and the endpoint."""
    s3_bucket = own_s3
    store = ArtifactStore(f"{s3_bucket.uri}/p")
    store.put_bytes("a.txt", b"up")
    assert store.fs.retries == 2
    assert store.fs.config_kwargs["retries"] == {"total_max_attempts": 5, "mode": "standard"}  # the default
    monkeypatch.setenv("VERLFLOW_S3_MAX_ATTEMPTS", "3")
    store = ArtifactStore(f"{s3_bucket.uri}/p")
    endpoint.cut_at(b"PUT /", 1)
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        store.put_bytes("b.txt", b"never")
    took = time.monotonic() - t0
    msg = str(e.value)
    assert f"{s3_bucket.uri}/p/b.txt" in msg and "The S3 endpoint cannot be reached" in msg
    n = len(endpoint.attempts)
    print(f"\nendpoint down: {n} reconnects in {took:.2f} s, at "
          f"{[round(t - endpoint.cut_time, 2) for t in endpoint.attempts]}")
    assert 2 <= n <= 2 * 3 + 2, n  # retried, and bounded (aiohttp may reconnect once on its own)
    assert took < 60
    endpoint.restore()
    assert store.get_bytes("a.txt") == b"up"  # nothing was lost while it was down
    with pytest.raises(StoreError, match="VERLFLOW_S3_MAX_ATTEMPTS='0' is refused"):
        monkeypatch.setenv("VERLFLOW_S3_MAX_ATTEMPTS", "0")
        ArtifactStore(f"{s3_bucket.uri}/p")


def test_s3_endpoint_stops_during_an_upload(ref, endpoint, own_s3, tmp_path, monkeypatch):
    """The endpoint stops at the 3rd object the checkpoint stage uploads. The job fails after bounded retries
    with a clear, retryable error naming the object; no manifest, index entry or pointer exists for the two
    objects that did arrive; once the endpoint is back the rerun completes and every stage verifies.
    (The stage is run as run_pipeline runs it; the pipeline's resume logic is the file:// tests' subject, and
    a validate job on S3 would add a job's time.)"""
    s3_bucket = own_s3
    monkeypatch.setenv("VERLFLOW_S3_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"{s3_bucket.uri}/vf"
    store = ArtifactStore(uri)
    clone_stages(ref.store, "ref", "s3", ALL[1:4], dst_store=store)  # build, rollout, update (keys hold no storage)
    bp = tiny_blueprint(ref.kit, uri, resources__nproc_per_node=1, name="faults-s3")
    step = next(s for s in plan(bp, "s3") if s.name == "export[1]")
    endpoint.cut_at(f"PUT /{s3_bucket.name}/vf/runs/s3/1/export/".encode(), 3)
    lines = Lines()
    with pytest.raises(StageFailure) as e:
        run_stage(RunContext(bp, "s3", on_line=lines), "export", 1, step.inputs)
    err = e.value
    assert endpoint.down and endpoint.cut_time is not None, lines.tail()
    assert err.kind is FailureKind.STORE_UNREACHABLE and err.retryable, str(err)
    assert f"{uri}/runs/s3/1/export/hf/" in str(err) and "The S3 endpoint cannot be reached" in str(err)
    assert "Traceback" not in str(err)  # one paragraph; the traceback is in the job's output
    assert any("could not remove the partial output" in line for line in lines)  # and said so, not masked it
    print(f"\nupload cut: {len(endpoint.attempts)} reconnects (job and cleanup), failure "
          f"{time.monotonic() - endpoint.cut_time:.1f} s after the cut")

    # While it is down, look behind the proxy: partial objects, but nothing that commits or points at them.
    s3 = s3_bucket.client()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket.name, Prefix="vf/").get("Contents", [])]
    partial = [k for k in keys if k.startswith("vf/runs/s3/1/export/")]
    assert len(partial) == 2 and not any(k.endswith(MANIFEST) for k in partial), partial
    index = [json.loads(s3.get_object(Bucket=s3_bucket.name, Key=k)["Body"].read()) for k in keys
             if k.startswith("vf/index/")]
    assert not any("/export/" in i["manifest"] for i in index)
    assert not any(k.startswith("vf/pointers/") for k in keys)

    endpoint.restore()
    assert not run_stage(RunContext(bp, "s3", on_line=Lines()), "export", 1, step.inputs).skipped
    assert_nothing_lost(store, "s3", ALL[1:])  # the two stray objects are gone: the rerun cleared the prefix
    assert store.get_pointer("runs/s3/latest")["export"] == "runs/s3/1/export"
    exported = store.read_manifest("runs/s3/1/export")["files"]["hf/model.safetensors"]
    assert exported["sha256"] == ref.store.read_manifest("runs/ref/1/export")["files"]["hf/model.safetensors"][
        "sha256"]


# ------------------------------------------------------------------------------------------- 3. NaN in the loss


@pytest.mark.slow(reason="covered by test_stages::test_nonfinite_loss_commits_nothing")
def test_nan_loss_commits_and_promotes_nothing(ref, monkeypatch):
    """update fails NONFINITE (not retryable): no update or checkpoint is committed, the blueprint's `latest`
    pointer (promoted by the reference run) is byte-for-byte unchanged and the run has none; the rerun without
    the fault completes with the reference weights and promotes."""
    ref.clone("nan", UP_TO_ROLLOUT)
    store, bp = ref.store, ref.variant()
    before = store.get_bytes("pointers/blueprints/faults/latest.json")
    monkeypatch.setenv("VERLFLOW_FAULT", "nan_loss")
    with pytest.raises(StageFailure) as e:
        run_pipeline(bp, "nan", on_line=Lines())
    assert e.value.kind is FailureKind.NONFINITE and not e.value.retryable
    assert "update[1]" in str(e.value) and "nothing was committed" in str(e.value)
    assert store.get_bytes("pointers/blueprints/faults/latest.json") == before
    assert store.get_pointer("runs/nan/latest") is None
    assert_nothing_lost(store, "nan", UP_TO_ROLLOUT)

    monkeypatch.delenv("VERLFLOW_FAULT")
    run_pipeline(bp, "nan", on_line=Lines())
    assert_nothing_lost(store, "nan", ALL)
    assert store.get_pointer("blueprints/faults/latest")["run_id"] == "nan"
    assert_same_weights(policy_weights(store, "nan", bp), policy_weights(store, "ref", bp))


# ---------------------------------------------------------------------- 4. cancellation through the Prefect API


def _flow_run_id(server, name: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.post(f"{server.url}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}}, timeout=30)
        r.raise_for_status()
        if r.json():
            return r.json()[0]["id"]
        time.sleep(0.3)
    pytest.fail(f"no flow run named {name}")


def test_cancel_through_the_prefect_api(prefect_server, ref, tmp_path, monkeypatch):
    """A finetune flow run is cancelled (Cancelling, as the UI's button sends) while its checkpoint job runs:
    no process is left in any process group of that job, the flow run ends Cancelled, nothing is committed or
    promoted, and a later flow run of the same run id completes, reusing everything before checkpoint."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling
    from prefect_server import wait_state

    from verlflow.flows.finetune import finetune

    ref.clone("cancel", UP_TO_UPDATE)
    bp = ref.variant(name="faults-cancel")
    own_slot_pool(monkeypatch)
    monkeypatch.setenv("VERLFLOW_FAULT", "hang_in_checkpoint")
    monkeypatch.setenv("VERLFLOW_FAULT_ONCE", str(tmp_path / "hang-once"))
    result = {}
    t = threading.Thread(target=lambda: result.update(state=finetune(blueprint=bp, run_id="cancel",
                                                                     return_state=True)))
    t.start()
    try:
        job = find_job(os.getpid(), "export", still=t.is_alive)
        groups = {os.getpgid(p.pid) for p in job}
        assert len(groups) == len(job)  # torchrun and each worker lead their own group
        flow_run_id = _flow_run_id(prefect_server, "cancel")
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling())
        deadline = time.monotonic() + 30
        while (left := live_in_groups(groups)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"alive after cancel: {[(p.pid, p.cmdline()[:4]) for p in left]}"
    finally:
        t.join(120)
    assert result["state"].is_cancelled(), result["state"]
    assert wait_state(flow_run_id, timeout_s=60).is_cancelled()
    assert ref.store.get_pointer("runs/cancel/latest") is None
    assert_nothing_lost(ref.store, "cancel", UP_TO_UPDATE)

    monkeypatch.delenv("VERLFLOW_FAULT")
    out = finetune(blueprint=bp, run_id="cancel")
    assert out["iterations"][0]["reused"] == "rollout,update"
    assert_nothing_lost(ref.store, "cancel", ALL)
    assert ref.store.get_pointer("runs/cancel/latest")["iteration"] == 1


# --------------------------------------------------------------------- 5. "reboot": the pipeline process dies


CHILD_PIPELINE = """\
import json, sys
{pin}
from verlflow.core.blueprint import Blueprint
from verlflow.core.orchestrate.pipeline import run_pipeline
bp = Blueprint.model_validate(json.load(open({bp!r})))
run_pipeline(bp, {run!r}, on_line=lambda line: print(line, flush=True))
"""


def test_reboot_mid_run_leaves_no_process_and_resumes(ref, tmp_path):
    """The process running the pipeline is SIGKILLed while the update job runs (nothing can clean up): no
    torchrun or rank process survives it, nothing half-written is visible, and the rerun resumes at update."""
    ref.clone("boot", UP_TO_ROLLOUT)
    bp = ref.variant()
    (tmp_path / "bp.json").write_text(json.dumps(bp.model_dump(mode="json")))
    code = CHILD_PIPELINE.format(pin=code_pin(), bp=str(tmp_path / "bp.json"), run="boot")
    env = {**os.environ, "VERLFLOW_FAULT": "hang_in_update", "VERLFLOW_FAULT_ONCE": str(tmp_path / "hang-once")}
    log = open(tmp_path / "child.log", "w")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        job = find_job(child.pid, "update", still=lambda: child.poll() is None)
        job_file = next(a for a in job[0].cmdline() if a.endswith("job.json"))
        tree = psutil.Process(child.pid).children(recursive=True)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
        log.close()
    alive = wait_gone(tree)
    assert not alive, f"survived the pipeline process: {[(p.pid, p.cmdline()[:4]) for p in alive]}"
    strays = [p for p in psutil.process_iter() if _alive(p) and job_file in " ".join(_cmdline(p))]
    assert not strays, strays
    assert_nothing_lost(ref.store, "boot", UP_TO_ROLLOUT)

    results = ref.rerun("boot")
    assert skipped(results) == {"validate[init]": True, "build[init]": True, "rollout[1]": True,
                                "update[1]": False, "export[1]": False}
    assert_nothing_lost(ref.store, "boot", ALL)
    assert_same_weights(policy_weights(ref.store, "boot", bp), policy_weights(ref.store, "ref", bp))


def _forked_from_torchrun(p: psutil.Process) -> bool:
    try:
        parent = p.parent()
    except psutil.Error:
        return False
    return parent is not None and "torch.distributed.run" in _cmdline(parent)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# ------------------------------------------------------------------------ 6. two runs of one blueprint at once


CHILD_FLOW = """\
import json, sys
{pin}
from verlflow.core.blueprint import Blueprint
from verlflow.flows.finetune import finetune
bp = Blueprint.model_validate(json.load(open({bp!r})))
state = finetune(blueprint=bp, run_id={run!r}, return_state=True)
print("FINAL", state.type.value, flush=True)
sys.exit(0 if state.is_completed() else 1)
"""


def test_two_runs_of_one_blueprint_at_once(prefect_server, ref, tmp_path):
    """Two finetune flow runs of the same blueprint, in two processes, different run ids, one store, one device
    slot between them (VERLFLOW_SLOTS=1 on a pool of their own): never two stage jobs at once, both complete,
    each run's manifests, pointer and report stay under its own prefix, shared index entries resolve, and both
    end with the reference weights. Each runs one job, its export (the same key in both runs): an update job each
    added 20 CPU-s and nothing this story needs (the tests above rerun updates)."""
    runs = ("twinA", "twinB")
    for run in runs:
        ref.clone(run, UP_TO_UPDATE)
    bp = ref.variant(name="faults-twin")
    (tmp_path / "bp.json").write_text(json.dumps(bp.model_dump(mode="json")))
    pool = f"faults-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "VERLFLOW_SLOT_POOL": pool, "VERLFLOW_SLOTS": "1"}
    children, logs = [], []
    try:
        for run in runs:
            logs.append(open(tmp_path / f"{run}.log", "w"))
            code = CHILD_FLOW.format(pin=code_pin(), bp=str(tmp_path / "bp.json"), run=run)
            children.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=logs[-1],
                                             stderr=subprocess.STDOUT))
        jobs_seen, most, at_most = set(), 0, {}
        deadline = time.monotonic() + 400
        while any(c.poll() is None for c in children):
            assert time.monotonic() < deadline, "the two runs did not finish"
            now = {}
            for run, c in zip(runs, children):
                try:
                    for p in psutil.Process(c.pid).children(recursive=True):
                        cmd = _cmdline(p)
                        # A job is a torchrun whose parent is not one: torchrun forking a worker shows, until the
                        # exec, a child with torchrun's command line (seen under CPU load as "2 jobs" of one stage).
                        if "torch.distributed.run" in cmd and _alive(p) and not _forked_from_torchrun(p):
                            now[p.pid] = (run, next((a for a in cmd if a.startswith("verlflow.")), cmd[-2:]))
                except psutil.Error:
                    pass
            jobs_seen |= set(now)
            if len(now) > most:  # which jobs overlapped, should they
                most, at_most = len(now), {**now, "at_s": round(time.monotonic() - deadline + 400, 1)}
            time.sleep(0.1)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
        for f in logs:
            f.close()
    outs = {run: (tmp_path / f"{run}.log").read_text() for run in runs}
    assert [c.returncode for c in children] == [0, 0], {r: o[-3000:] for r, o in outs.items()}
    assert most == 1, f"{most} stage jobs ran at once under a 1-slot limit: {at_most}"
    assert len(jobs_seen) == 2, jobs_seen  # the export of each run
    limit = httpx.get(f"{prefect_server.url}/v2/concurrency_limits/verlflow-{pool}-slots", timeout=30).json()
    assert limit["limit"] == 1 and limit["active_slots"] == 0

    store = ref.store
    for run in runs:
        assert_nothing_lost(store, run, ALL)
        for it, stage in ALL:
            m = store.read_manifest(stage_key(run, it, stage))
            assert m["run_id"] == run and f"/runs/{run}/" in m["stage_uri"]
            assert all(i["stage"].startswith(f"runs/{run}/") for i in m["inputs"].values()), m["inputs"]
            assert store.lookup(m["key"])["key"] == m["key"]  # the shared index still resolves
        pointer = store.get_pointer(f"runs/{run}/latest")
        assert pointer["run_id"] == run and pointer["export"] == f"runs/{run}/1/export"
        assert store.exists(f"reports/{run}/curves.png")
        assert_same_weights(policy_weights(store, run, bp), policy_weights(store, "ref", bp))
    assert store.get_pointer("blueprints/faults-twin/latest")["run_id"] in runs
    a, b = (set(f.split("/", 2)[2] for f in store.ls(f"runs/{run}")) for run in runs)
    assert a == b  # the same layout, under two prefixes


# ------------------------------------------------------------------------ 7. a committed file corrupted


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only the checksum can tell


def _rank0_shard(store, stage_key: str) -> str:
    """One of rank 0's policy shard files (a DCP save writes one per I/O thread: __<rank>_<thread>_0.distcp)."""
    files = store.read_manifest(stage_key)["files"]
    return sorted(f for f in files if f.startswith("policy/dcp/__0_") and f.endswith(".distcp"))[0]


@pytest.mark.slow(reason="covered by test_faults::test_corrupted_object_on_s3_is_named_on_read")
def test_corrupted_file_on_disk_is_named_by_the_next_stage(ref):
    """A byte of the committed build's policy shard flips on disk. The next stage that reads it (rollout) fails
    with a ChecksumError naming that file and the fix; nothing of rollout is committed; following the fix
    (rerun from build) the rollout completes with the reference's exact batch."""
    ref.clone("rot", UP_TO_ROLLOUT[:2])
    store, bp = ref.store, ref.variant()
    bad = f"runs/rot/init/build/{_rank0_shard(store, 'runs/rot/init/build')}"
    _flip_byte(store.local_path(bad))
    with pytest.raises(StageFailure) as e:
        run_pipeline(bp, "rot", on_line=Lines())
    msg = str(e.value)
    assert "ChecksumError" in msg and store.uri(bad) in msg and "verlflow rerun --from build" in msg
    assert e.value.kind is FailureKind.USER_ERROR and not e.value.retryable  # a retry would read it again
    assert store.read_manifest("runs/rot/1/rollout") is None and not store.ls("runs/rot/1")

    steps = {s.name: s for s in plan(bp, "rot")}
    at_ref = ref.variant(resources__nproc_per_node=2)  # the reference's ranks: sampling depends on the world size
    run_stage(RunContext(at_ref, "rot", on_line=Lines()), "build", "init", steps["build[init]"].inputs, force=True)
    run_stage(RunContext(at_ref, "rot", on_line=Lines()), "rollout", 1, steps["rollout[1]"].inputs)
    assert_nothing_lost(store, "rot", UP_TO_ROLLOUT)
    batch = store.read_manifest("runs/rot/1/rollout")["files"]["batch.safetensors"]
    assert batch["sha256"] == store.read_manifest("runs/ref/1/rollout")["files"]["batch.safetensors"]["sha256"]


def test_corrupted_object_on_s3_is_named_on_read(ref, s3_bucket, tmp_path, monkeypatch):
    """The same on S3: an object is overwritten behind verlflow's back. The read that a stage does
    (ArtifactStore.materialize, as StageContext.input calls it) raises ChecksumError naming the s3:// object;
    a stale local cache copy is not trusted either; re-uploading the right bytes heals it."""
    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    store = ArtifactStore(f"{s3_bucket.uri}/vf")
    clone_stages(ref.store, "ref", "rot", [("init", "build")], dst_store=store)
    good = store.materialize("runs/rot/init/build", tmp_path / "inputs")  # a job's cache, filled and verified
    rel = _rank0_shard(store, "runs/rot/init/build")
    data = bytearray((good / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key=f"vf/runs/rot/init/build/{rel}", Body=bytes(data))
    (good / rel).write_bytes(bytes(data))  # the next job's cache holds the corrupt bytes too
    with pytest.raises(ChecksumError) as e:
        store.materialize("runs/rot/init/build", tmp_path / "inputs")
    assert store.uri(f"runs/rot/init/build/{rel}") in str(e.value) and "rerun --from build" in str(e.value)
    store.upload_file(ref.store.local_path(f"runs/ref/init/build/{rel}"), f"runs/rot/init/build/{rel}")
    store.materialize("runs/rot/init/build", tmp_path / "inputs")
    assert_nothing_lost(store, "rot", [("init", "build")])


# ------------------------------------------------------------------------------------ 8. the stage times out


@pytest.mark.slow(
    reason="covered by test_hangs::test_a_pool_stage_hung_in_a_collective_times_out_with_every_ranks_stack")
def test_stage_timeout_is_killed_classified_and_retried(prefect_server, ref, tmp_path, monkeypatch):
    """The checkpoint job hangs once (resources.stage_timeout_s=T): the launcher kills it at T, classifies it
    TIMEOUT (retryable), leaves no process; the stage task (tasks/stages.py, resources.retries=1) retries it and
    the retry commits and promotes."""
    from prefect import flow

    import verlflow.tasks.stages as ts

    limit_s = 60  # the retry must import and export within it on a loaded 2-core machine (first imports compile)
    ref.clone("slow", UP_TO_UPDATE)
    bp = ref.variant(name="faults-timeout", resources__stage_timeout_s=limit_s)
    assert bp.resources.retries == 1
    step = next(s for s in plan(bp, "slow") if s.name == "export[1]")
    own_slot_pool(monkeypatch)
    monkeypatch.setenv("VERLFLOW_FAULT", "hang_in_checkpoint")
    monkeypatch.setenv("VERLFLOW_FAULT_ONCE", str(tmp_path / "hang-once"))
    attempts, real = [], ts.run_stage

    def recorded(*args, **kw):
        t0 = time.monotonic()
        try:
            res = real(*args, **kw)
        except BaseException as exc:
            attempts.append((exc, time.monotonic() - t0))
            raise
        attempts.append((res, time.monotonic() - t0))
        return res

    monkeypatch.setattr(ts, "run_stage", recorded)

    @flow(name="faults-timeout")
    def one_stage():
        task = ts.stage_task("export", 1, bp).with_options(retry_delay_seconds=0)
        return task("export", 1, step.inputs, bp, "slow", False)

    res = one_stage()
    assert len(attempts) == 2, attempts
    (first, took), (second, _) = attempts
    assert isinstance(first, StageFailure), first
    assert first.kind is FailureKind.TIMEOUT and first.retryable and f"timeout of {limit_s} s" in str(first)
    assert limit_s <= took < limit_s + 15, took  # killed at the limit (+ SIGTERM grace), not later
    assert not second.skipped and res.manifest["stage"] == "export"
    assert not [p for p in psutil.Process().children(recursive=True)
                if "verlflow.core.stages.export" in _cmdline(p) and _alive(p)]
    assert_nothing_lost(ref.store, "slow", ALL)
    assert ref.store.get_pointer("runs/slow/latest")["iteration"] == 1


# ------------------------------------------------------------------------------- bad input the CLI table lacks


def _parquet(path: Path, **columns) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({**prompt_rows(), **columns}), path)
    return str(path)


def _model_without_weights(kit, tmp: Path) -> str:
    shutil.copytree(kit["model_dir"], tmp / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    return str(tmp / "m")


def _tokenizer_without_chat_template(kit, tmp: Path) -> str:
    shutil.copytree(kit["model_dir"], tmp / "m", ignore=shutil.ignore_patterns("chat_template.jinja"))
    cfg = json.loads((tmp / "m/tokenizer_config.json").read_text())
    assert "chat_template" not in cfg
    return str(tmp / "m")


def _architecture_without_decoder_layer(kit, tmp: Path) -> str:
    """openai-gpt: a causal LM whose class declares no _no_split_modules (so no block class to wrap)."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    shutil.copytree(kit["model_dir"], tmp / "m", ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                             "generation_config.json"))
    vocab = json.loads((Path(kit["model_dir"]) / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=vocab, n_positions=128, n_embd=32, n_layer=2, n_head=2)
                         ).save_pretrained(tmp / "m")
    return str(tmp / "m")


@dataclass
class Bad:
    id: str
    args: object  # list, or fn(kit, tmp) -> list; "@BP@" / "@TMP@" substituted
    expect: list
    verb: str = "validate-blueprint"
    env: dict | None = None
    job: bool = False  # refused by the validate stage job (a torchrun job) rather than before it
    slow: str = ""  # why `make test` leaves it out: pytest.mark.slow's reason


def _data(setup):
    return lambda kit, tmp: [f"data.train_files=[{setup(tmp)}]"]


DEAD = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused
BAD = [
    # dataset rows of the wrong shape (test_cli covers int prompts, string reward_model, missing columns, empty)
    Bad("prompt-messages-without-content", _data(lambda t: _parquet(t / "d.parquet", prompt=[[{"role": "user"}]] * 3)),
        ["data.train_files", "d.parquet row 0", "list of {role, content} messages"]),
    Bad("prompt-empty-message-list", _data(lambda t: _parquet(t / "d.parquet", prompt=[[], [], []])),
        ["data.train_files", "row 0", "'prompt' must be a list of {role, content}"]),
    Bad("prompt-list-of-strings", _data(lambda t: _parquet(t / "d.parquet", prompt=[["hi"], ["ho"], ["ha"]])),
        ["data.train_files", "row 0", "'prompt' must be a list"]),
    Bad("reward-model-without-ground-truth",
        _data(lambda t: _parquet(t / "d.parquet", reward_model=[{"style": "rule"}] * 3)),
        ["data.train_files", "row 0", "reward_model must be a struct with ground_truth"]),
    Bad("second-train-file-broken",
        lambda kit, tmp: [f"data.train_files=[{kit['train_file']},{_parquet(tmp / 'b.parquet', prompt=[1, 2, 3])}]"],
        ["data.train_files", "b.parquet row 0", "got int"]),
    # storage the CLI table does not reach: an endpoint that does not answer, a bad retry setting
    Bad("s3-endpoint-unreachable", ["storage.uri=s3://bucket/prefix"],
        ["s3://bucket/prefix/_probe/", "The S3 endpoint cannot be reached", "AWS_ENDPOINT_URL"], verb="run",
        env={"AWS_ENDPOINT_URL": DEAD, "VERLFLOW_S3_MAX_ATTEMPTS": "2", "AWS_ACCESS_KEY_ID": "AKIAFAULTS",
             "AWS_SECRET_ACCESS_KEY": "faults-secret-value"}),
    Bad("s3-max-attempts-not-a-number", ["storage.uri=s3://bucket/prefix"],
        ["VERLFLOW_S3_MAX_ATTEMPTS='many' is refused", "integer >= 1"], verb="run",
        env={"VERLFLOW_S3_MAX_ATTEMPTS": "many"}),
    # model folders: refused by the validate stage, which lists every problem (a 1-rank torchrun job each)
    Bad("model-missing-weights", lambda kit, tmp: [f"model.path={_model_without_weights(kit, tmp)}"],
        ["model.path=@TMP@/m", "no weights (*.safetensors)", "save_pretrained"], verb="run", job=True),
    Bad("tokenizer-without-chat-template",
        lambda kit, tmp: [f"model.path={_tokenizer_without_chat_template(kit, tmp)}"],
        ["@TMP@/m", "the tokenizer has no chat_template", "add one to tokenizer_config.json"], verb="run", job=True,
        slow="a validate job; covered by test_bad_input_is_refused_clearly[model-missing-weights]"),
    Bad("architecture-without-decoder-layer-class",
        lambda kit, tmp: [f"model.path={_architecture_without_decoder_layer(kit, tmp)}",
                          "model.attn_implementation=eager"],  # else the first complaint is sdpa support
        ["fsdp.wrap_class", "no decoder-layer class found in OpenAIGPTLMHeadModel",
         "set fsdp.wrap_class to the transformer block class name"], verb="run", job=True,
        slow="a validate job; covered by test_bad_input_is_refused_clearly[model-missing-weights]"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow(reason=c.slow)] if c.slow else [])
                                  for c in BAD])
def test_bad_input_is_refused_clearly(case: Bad, tiny_kit, tmp_path, monkeypatch, capsys):
    """Each: exit code != 0, one `verlflow <verb>: error:` paragraph on stderr naming the field or file and the
    fix, no Python traceback in it, and no file written to the store (a refused job leaves no artifact)."""
    from verlflow.flows.cli import main

    for k, v in (case.env or {}).items():
        monkeypatch.setenv(k, v)
    args = case.args(tiny_kit, tmp_path) if callable(case.args) else list(case.args)
    store = tmp_path / "store"
    base = [f"model.path={tiny_kit['model_dir']}", f"data.train_files=[{tiny_kit['train_file']}]",
            f"storage.uri={store}", "resources.nproc_per_node=1", "data.batch_size=4",
            "algorithm.ppo_mini_batch_size=2", "algorithm.ppo_micro_batch_size_per_gpu=4", "rollout.n=4"]
    argv = [case.verb, *base, *args] + (["--run-id", "bad"] if case.verb == "run" else [])
    capsys.readouterr()
    t0 = time.monotonic()
    rc = main(argv)
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert rc not in (0, None), f"exit code {rc}; stderr:\n{err}"
    assert len([line for line in err.splitlines() if line.startswith("verlflow ")]) == 1, err
    assert err.startswith(f"verlflow {case.verb}: error: "), err
    assert "Traceback" not in err, err
    for s in case.expect:
        assert s.replace("@TMP@", str(tmp_path)) in err, f"{s!r} not in stderr:\n{err}"
    if not case.job:
        assert out == "", out
    files = [p for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert not files, f"the store was written: {files}"
    if case.id == "s3-endpoint-unreachable":
        assert "faults-secret-value" not in err + out
        assert took < 60, took  # bounded retries, not a hang


def test_bad_input_count():
    assert len(BAD) >= 10 and len({c.id for c in BAD}) == len(BAD)
