"""verlflow.core.store.artifacts against a local folder and a real S3 HTTP endpoint (moto server in a subprocess)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from verlflow.core.errors import ChecksumError, StoreError, UnsafeKeyError
from verlflow.core.store.artifacts import ArtifactStore, safe_key, stage_key
from verlflow.core.store.digests import digest_files, file_digest

pytestmark = pytest.mark.system
# Fixtures s3_endpoint / s3_bucket. The helper is a top-level module: pytest puts tests/ on sys.path (there is
# no tests/__init__.py), and the name `tests` is taken by a package that verl installs into site-packages.

STAGE = stage_key("run1", 0, "rollout")


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return ArtifactStore(f"{bucket.uri}/prefix")


def write_stage(store: ArtifactStore, tmp_path: Path, stage: str = STAGE, key: str = "k" * 64) -> dict:
    """What a stage worker does: write files locally, upload them, then commit the manifest."""
    out = tmp_path / f"out-{stage.replace('/', '_')}"
    (out / "sub").mkdir(parents=True)
    (out / "batch.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    (out / "sub" / "stats.json").write_text('{"reward": 0.5}')
    names = store.upload_dir(out, stage)
    assert names == ["batch.bin", "sub/stats.json"]
    files = {rel: file_digest(out / rel) for rel in names}
    return store.commit(stage, {"key": key, "stage": stage.rsplit("/", 1)[-1], "metrics": {"loss": 1.0}}, files)


def test_commit_round_trip(store, tmp_path):
    committed = write_stage(store, tmp_path)
    manifest = store.read_manifest(STAGE)
    assert manifest == committed
    assert manifest["format"] == 1 and manifest["key"] == "k" * 64
    assert manifest["stage_uri"] == f"{store.root_uri}/{STAGE}"
    assert manifest["committed_at"].endswith("+00:00")
    assert set(manifest["files"]) == {"batch.bin", "sub/stats.json"}
    assert store.lookup("k" * 64) == manifest
    assert store.lookup("other") is None
    assert json.loads(store.get_bytes("index/" + "k" * 64 + ".json")) == {"manifest": f"{STAGE}/manifest.json"}
    assert store.ls(STAGE) == [f"{STAGE}/batch.bin", f"{STAGE}/manifest.json", f"{STAGE}/sub/stats.json"]
    assert store.read_verified(STAGE, "sub/stats.json") == b'{"reward": 0.5}'

    folder = store.materialize(STAGE, tmp_path / "cache")
    if store.is_local:
        assert folder == Path(store.root) / STAGE  # no copy for file:// stores
    else:
        assert folder == tmp_path / "cache"
    for rel, d in manifest["files"].items():
        assert file_digest(folder / rel) == d
    assert store.materialize(STAGE, tmp_path / "cache") == folder  # second call: cache hit, still verified


def test_materialize_default_cache_dir(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("VERLFLOW_CACHE_DIR", str(tmp_path / "vcache"))
    store = ArtifactStore(s3_bucket.uri)
    write_stage(store, tmp_path)
    folder = store.materialize(STAGE)
    assert folder == tmp_path / "vcache" / s3_bucket.name / STAGE
    assert (folder / "sub" / "stats.json").read_text() == '{"reward": 0.5}'


def test_local_uri_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ArtifactStore("rel/store").root_uri == f"file://{tmp_path}/rel/store"
    assert ArtifactStore(f"file://{tmp_path}/abs/").root_uri == f"file://{tmp_path}/abs"
    s = ArtifactStore(tmp_path / "p")
    assert repr(s) == f"ArtifactStore('file://{tmp_path}/p')"
    s.put_bytes("a/b.txt", b"x")
    assert s.get_bytes("a/b.txt") == b"x" and (tmp_path / "p" / "a" / "b.txt").read_bytes() == b"x"


def test_uncommitted_stage_is_invisible(store, tmp_path):
    # Killed after uploading data, before writing the manifest: nothing may see it.
    out = tmp_path / "partial"
    out.mkdir()
    (out / "batch.bin").write_bytes(b"half")
    store.upload_dir(out, STAGE)
    assert store.exists(f"{STAGE}/batch.bin")
    assert store.read_manifest(STAGE) is None
    assert store.lookup("k" * 64) is None
    with pytest.raises(StoreError, match="not committed"):
        store.materialize(STAGE, tmp_path / "cache")
    with pytest.raises(StoreError, match="not committed"):
        store.read_verified(STAGE, "batch.bin")
    # An index entry whose manifest is gone (or carries another key) is ignored too.
    store.put_bytes("index/kk.json", json.dumps({"manifest": f"{STAGE}/manifest.json"}).encode())
    assert store.lookup("kk") is None


def test_lookup_requires_matching_key(store, tmp_path):
    write_stage(store, tmp_path, key="aaa")
    store.put_bytes("index/bbb.json", json.dumps({"manifest": f"{STAGE}/manifest.json"}).encode())
    assert store.lookup("bbb") is None
    assert store.lookup("aaa")["key"] == "aaa"


def test_commit_refuses_missing_or_short_files(store, tmp_path):
    store.put_bytes(f"{STAGE}/a.bin", b"abc")
    with pytest.raises(StoreError, match=r"b\.bin is missing"):
        store.commit(STAGE, {"key": "x1"}, {"a.bin": {"sha256": "0" * 64, "size": 3},
                                            "b.bin": {"sha256": "0" * 64, "size": 1}})
    with pytest.raises(StoreError, match="has 3 bytes but 4 were recorded"):
        store.commit(STAGE, {"key": "x1"}, {"a.bin": {"sha256": "0" * 64, "size": 4}})
    with pytest.raises(StoreError, match="no string 'key'"):
        store.commit(STAGE, {}, {})
    assert store.read_manifest(STAGE) is None and store.lookup("x1") is None


def test_corruption_is_detected(store, tmp_path, request):
    manifest = write_stage(store, tmp_path)
    good = store.materialize(STAGE, tmp_path / "cache")
    rel = "sub/stats.json"
    bad = b'{"reward": 9.5}'  # same size, different bytes
    if store.is_local:
        (Path(store.root) / STAGE / rel).write_bytes(bad)
    else:
        bucket, key = store._path(f"{STAGE}/{rel}").split("/", 1)
        request.getfixturevalue("s3_bucket").client().put_object(Bucket=bucket, Key=key, Body=bad)
    with pytest.raises(ChecksumError) as err:
        store.read_verified(STAGE, rel)
    msg = str(err.value)
    assert store.uri(f"{STAGE}/{rel}") in msg and "verlflow rerun --from rollout" in msg
    assert manifest["files"][rel]["sha256"] in msg and hashlib.sha256(bad).hexdigest() in msg
    if not store.is_local:
        (good / rel).unlink()  # force a fresh download into the cache
    with pytest.raises(ChecksumError, match=r"sub/stats\.json"):
        store.materialize(STAGE, tmp_path / "cache")


def test_deleted_file_is_detected(store, tmp_path):
    write_stage(store, tmp_path)
    store.rm(f"{STAGE}/sub/stats.json")
    with pytest.raises(ChecksumError, match=r"sub/stats\.json is listed in the manifest but missing.*rerun --from"):
        store.materialize(STAGE, tmp_path / "cache")


def test_a_reader_racing_retention_skips_what_was_pruned_under_it(store, tmp_path, monkeypatch):
    """Retention commits the pruned manifest, then deletes the files; a stage that read the manifest just before
    (another stage of a warm pool reading the build's hf_meta/ while its policy/ goes) finds files missing. Those
    retention pruned are skipped; any other missing file is still damage."""
    write_stage(store, tmp_path)
    stale = store.read_manifest(STAGE)
    reads = []

    def read_once_stale(key):  # the first read happens before the prune, later ones after it
        reads.append(key)
        return stale if len(reads) == 1 else ArtifactStore.read_manifest(store, key)

    store.mark_pruned(STAGE, ("sub/",))
    store.rm(f"{STAGE}/sub/stats.json")
    monkeypatch.setattr(store, "read_manifest", read_once_stale)
    folder = store.materialize(STAGE, tmp_path / "cache")
    assert (folder / "batch.bin").is_file() and not (folder / "sub/stats.json").exists()

    reads.clear()
    store.rm(f"{STAGE}/batch.bin")  # not pruned: damage
    with pytest.raises(ChecksumError, match=r"batch\.bin is listed in the manifest but missing"):
        store.materialize(STAGE, tmp_path / "cache2")


def test_corrupt_cache_file_is_redownloaded(s3_bucket, tmp_path):
    store = ArtifactStore(s3_bucket.uri)
    write_stage(store, tmp_path)
    folder = store.materialize(STAGE, tmp_path / "cache")
    (folder / "batch.bin").write_bytes(b"damaged locally")
    assert store.materialize(STAGE, tmp_path / "cache") == folder
    assert file_digest(folder / "batch.bin") == store.read_manifest(STAGE)["files"]["batch.bin"]


BAD_KEYS = ["../x", "/abs", "a//b", "a\\b", "runs/../../etc", "", "a/./b", "a/", "a\x00b", "a\nb"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_unsafe_keys_are_refused(tmp_path, key):
    store = ArtifactStore(tmp_path / "store")
    calls = [
        lambda: store.put_bytes(key, b"x"), lambda: store.get_bytes(key), lambda: store.exists(key),
        lambda: store.rm(key), lambda: store.upload_file(__file__, key),
        lambda: store.download_file(key, tmp_path / "d"), lambda: store.read_manifest(key),
        lambda: store.commit(STAGE, {"key": "k"}, {key: {"sha256": "0", "size": 1}}),
        lambda: store.read_verified(key, "x"), lambda: store.uncommit(key), lambda: store.set_pointer(key, {}),
        lambda: store.materialize(key),
    ]
    if key:  # ls("") lists the whole store
        calls.append(lambda: store.ls(key))
    for call in calls:
        with pytest.raises(UnsafeKeyError) as err:
            call()
        assert f"Artifact key {key!r}" in str(err.value) and "allowed is" in str(err.value)
    assert not any(tmp_path.rglob("x")) and not (tmp_path / "store").exists()


def _key_args(store: ArtifactStore, tmp_path: Path, bad: str) -> dict:
    """A value for every parameter name of the store's methods, the key-like ones `bad`."""
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src/f.bin").write_bytes(b"x")
    return {"key": bad, "stage_key": bad, "prefix": bad, "name": bad, "key_prefix": bad, "keys": [bad],
            "data": b"x", "version": "v", "local": tmp_path / "src/f.bin", "local_dir": tmp_path / "src",
            "manifest": {"key": "k"}, "files": {}, "checksums": False, "sizes": None, "folders": None, "value": {},
            "change": lambda current: {"x": 1}, "rel": "f.bin", "rels": ["f.bin"]}


KEYED = ("key", "stage_key", "prefix", "name", "key_prefix", "keys")


def test_every_store_method_that_takes_a_key_refuses_one_that_escapes(tmp_path):
    """Each public method of ArtifactStore that takes a key, a stage key, a prefix or a pointer name (found by
    inspection, so a new one is covered) refuses `..` before touching the store."""
    import inspect

    store = ArtifactStore(tmp_path / "a/store")
    checked = []
    for name, fn in inspect.getmembers(ArtifactStore, inspect.isfunction):
        params = list(inspect.signature(fn).parameters)[1:]
        if name.startswith("_") or not set(params) & set(KEYED):
            continue
        for bad in ("../../outside", "runs/../../../outside"):
            args = _key_args(store, tmp_path, bad)
            with pytest.raises(UnsafeKeyError, match="is refused"):
                getattr(store, name)(**{p: args[p] for p in params if p in args})
        checked.append(name)
    assert {"put_bytes", "update_pointer", "delete_if", "rm_files", "sizes", "upload_dir", "damage"} <= set(checked)
    assert not (tmp_path / "a").exists() and not (tmp_path / "outside").exists()


@pytest.mark.parametrize("tail", ["team-a/../../team-b", "team-a/./x", "team-a//x"])
def test_a_store_root_that_climbs_out_of_its_prefix_is_refused(s3_bucket, tmp_path, tail):
    """The root is the prefix of every key: refused with '..', '.' or '//' for s3:// and file:// alike (before:
    s3://bucket/team-a/../../team-b/_probe/... was written). A plain folder path is the folder it names."""
    for uri in (f"{s3_bucket.uri}/{tail}", f"file://{tmp_path}/{tail}"):
        with pytest.raises(UnsafeKeyError, match=r"Store URI .* is refused: it has .* segments"):
            ArtifactStore(uri).probe()
    assert s3_bucket.client().list_objects_v2(Bucket=s3_bucket.name).get("KeyCount", 0) == 0
    assert not any(tmp_path.iterdir())
    (tmp_path / "team-a").mkdir()
    plain = ArtifactStore(f"{tmp_path}/team-a/../team-b")
    plain.put_bytes("x.txt", b"x")
    assert (tmp_path / "team-b/x.txt").read_bytes() == b"x"


def test_safe_names():
    assert safe_key("runs/r1/0/build/model.safetensors") == "runs/r1/0/build/model.safetensors"
    assert stage_key("r-1.a_b", 3, "update") == "runs/r-1.a_b/3/update"
    assert stage_key("r1", "init", "build") == "runs/r1/init/build"
    for bad in [("../r", 0, "s"), ("r", -1, "s"), ("r", "..", "s"), ("r", 0, "a/b"), ("", 0, "s"), (".r", 0, "s"),
                ("r", True, "s")]:
        with pytest.raises(UnsafeKeyError, match="allowed"):
            stage_key(*bad)


def test_uncommit_makes_stage_invisible(store, tmp_path):
    write_stage(store, tmp_path, key="same")
    other = stage_key("run1", 1, "rollout")
    write_stage(store, tmp_path, stage=other, key="same")  # index now points at `other`
    store.uncommit(STAGE)
    assert store.read_manifest(STAGE) is None and store.ls(STAGE) == []
    assert store.lookup("same")["stage_uri"] == store.uri(other)  # the other stage's index entry survives
    store.uncommit(other)
    assert store.lookup("same") is None and not store.exists("index/same.json")
    assert store.ls() == []
    store.uncommit(other)  # idempotent


def test_rm_prefix_does_not_touch_siblings(store):
    store.put_bytes("runs/r/0/roll/a", b"1")
    store.put_bytes("runs/r/0/rollout/a", b"2")
    store.rm("runs/r/0/roll")
    assert store.ls("runs") == ["runs/r/0/rollout/a"]
    store.rm("runs/r/0/missing")  # fine


def test_pointers(store):
    assert store.get_pointer("latest") is None
    store.set_pointer("latest", {"run_id": "run1", "iteration": 2})
    store.set_pointer("latest", {"run_id": "run1", "iteration": 3})
    assert store.get_pointer("latest") == {"run_id": "run1", "iteration": 3}
    assert store.ls("pointers") == ["pointers/latest.json"]  # no temp files left behind


def test_file_digest_streams(tmp_path):
    data = os.urandom(2 * 1024 * 1024 + 5)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f") == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_big_files_get_a_parallel_chunked_digest_that_still_catches_a_flipped_byte(store, tmp_path, monkeypatch,
                                                                                    request):
    """Above TREE_MIN (shrunk here) a file's digest is sha256 over its pieces' sha256s; a manifest written with
    plain sha256 (before chunking existed) still verifies."""
    import verlflow.core.store.digests as S

    monkeypatch.setattr(S, "TREE_MIN", 1 << 20)
    monkeypatch.setattr(S, "TREE_PIECE", 256 * 1024)
    data = os.urandom(3 * 1024 * 1024 + 7)  # 13 pieces, the last one short
    (tmp_path / "f").write_bytes(data)
    d = file_digest(tmp_path / "f")
    pieces = b"".join(hashlib.sha256(data[i:i + 256 * 1024]).digest() for i in range(0, len(data), 256 * 1024))
    assert d == {"sha256_64m": hashlib.sha256(pieces).hexdigest(), "size": len(data)}
    assert file_digest(tmp_path / "f", "sha256") == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    manifest = write_stage(store, tmp_path)  # batch.bin is 3 MiB + 7: chunked
    assert set(manifest["files"]["batch.bin"]) >= {"sha256_64m", "size"} and "sha256" not in manifest["files"]["batch.bin"]
    assert "sha256" in manifest["files"]["sub/stats.json"]
    assert store.read_verified(STAGE, "batch.bin") == store.get_bytes(f"{STAGE}/batch.bin")
    store.put_bytes("runs/r/0/old/f", data)  # an older manifest: plain sha256 for a big file
    store.commit("runs/r/0/old", {"key": "old"}, {"f": file_digest(tmp_path / "f", "sha256")})
    store.materialize("runs/r/0/old", tmp_path / "cache-old")
    assert store.read_verified("runs/r/0/old", "f") == data

    bad = bytearray(store.get_bytes(f"{STAGE}/batch.bin"))
    bad[len(bad) // 2] ^= 1  # one bit in the middle piece
    if store.is_local:
        (Path(store.root) / STAGE / "batch.bin").write_bytes(bytes(bad))
        os.utime(Path(store.root) / STAGE / "batch.bin", ns=(0, 0))  # no quick-check pass on mtime
    else:
        bucket, key = store._path(f"{STAGE}/batch.bin").split("/", 1)
        request.getfixturevalue("s3_bucket").client().put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    with pytest.raises(ChecksumError, match=r"batch\.bin does not match its manifest: expected sha256_64m"):
        store.read_verified(STAGE, "batch.bin")
    with pytest.raises(ChecksumError, match=r"batch\.bin"):
        store.materialize(STAGE, tmp_path / "cache")


def test_upload_into_own_stage_folder_is_a_no_op(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    folder = Path(store.root) / STAGE
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(b"weights")
    assert store.upload_dir(folder, STAGE) == ["w.bin"]
    store.commit(STAGE, {"key": "direct"}, {"w.bin": file_digest(folder / "w.bin")})
    assert store.materialize(STAGE) == folder


# ---------- probe and secrets

def test_probe_succeeds(store):
    store.probe()
    assert store.ls("_probe") == []


def test_probe_missing_bucket(s3_bucket):
    store = ArtifactStore("s3://no-such-bucket-verlflow/p")
    with pytest.raises(StoreError) as err:
        store.probe()
    msg = str(err.value)
    assert "s3://no-such-bucket-verlflow/p" in msg and "bucket does not exist" in msg
    assert "aws s3 mb s3://no-such-bucket-verlflow" in msg
    assert s3_bucket.secret not in msg and s3_bucket.secret not in repr(err.value.__cause__)


def test_probe_without_credentials(s3_bucket, monkeypatch):
    import s3fs

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()  # cached filesystems keep the credentials they started with
    with pytest.raises(StoreError, match="No S3 credentials were found") as err:
        ArtifactStore(s3_bucket.uri).probe()
    assert s3_bucket.uri in str(err.value)


def test_probe_unwritable_local_dir(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):  # root ignores permission bits: use a path below a regular file instead
            (tmp_path / "plain-file").write_text("")
            root = tmp_path / "plain-file" / "store"
        store = ArtifactStore(root)
        with pytest.raises(StoreError) as err:
            store.probe()
        msg = str(err.value)
        assert f"file://{root}" in msg
        assert "not writable" in msg or "regular file, not a folder" in msg
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_secret_never_leaks(s3_bucket, tmp_path):
    secret = s3_bucket.secret
    store = ArtifactStore(s3_bucket.uri, storage_options={"secret": secret, "key": s3_bucket.key_id})
    assert secret not in repr(store) and secret not in store.root_uri
    write_stage(store, tmp_path)
    raw = store.get_bytes(f"{STAGE}/manifest.json") + store.get_bytes("index/" + "k" * 64 + ".json")
    assert secret.encode() not in raw
    with pytest.raises(StoreError, match="contains a credential value") as err:
        store.commit(STAGE, {"key": "k2", "env": {"AWS_SECRET_ACCESS_KEY": secret}}, {})
    assert secret not in str(err.value)
    assert store.lookup("k2") is None
    bad = ArtifactStore("s3://no-such-bucket-verlflow", storage_options={"secret": secret})
    with pytest.raises(StoreError) as err:
        bad.probe()
    assert secret not in str(err.value) and secret not in repr(bad)


def test_credentials_in_uri_are_refused():
    with pytest.raises(StoreError, match="must not carry credentials"):
        ArtifactStore(f"s3://AKIA:{'wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY'}@bucket/p")


def test_explicit_endpoint_and_region(s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    store = ArtifactStore(s3_bucket.uri, endpoint_url=s3_bucket.endpoint, region="us-east-1")
    store.probe()
    store.put_bytes("a.txt", b"x")
    assert store.ls() == ["a.txt"]


def test_local_quick_check_skips_untouched_files_and_catches_changed_ones(tmp_path, monkeypatch):
    """A local stage's files are hashed once, at commit (in parallel threads); a later read re-hashes only files
    whose size or mtime changed, or every file under VERLFLOW_VERIFY=full."""
    import verlflow.core.store.artifacts as S

    store = ArtifactStore(tmp_path / "store")
    folder = store.local_path(STAGE)
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"w{i}.bin").write_bytes(os.urandom(1 << 20))
    files = digest_files(folder, ["w0.bin", "w1.bin", "w2.bin"], stamp=True)
    assert files["w1.bin"]["sha256"] == hashlib.sha256((folder / "w1.bin").read_bytes()).hexdigest()
    store.commit(STAGE, {"key": "quick"}, files)
    assert "mtime_ns" in store.read_manifest(STAGE)["files"]["w0.bin"]

    hashed = []
    real = S.file_digest
    monkeypatch.setattr(S, "file_digest", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    store.materialize(STAGE)
    assert hashed == []  # untouched since commit
    monkeypatch.setenv("VERLFLOW_VERIFY", "full")
    store.materialize(STAGE)
    assert sorted(hashed) == ["w0.bin", "w1.bin", "w2.bin"]
    monkeypatch.delenv("VERLFLOW_VERIFY")
    data = bytearray((folder / "w2.bin").read_bytes())
    data[5] ^= 1
    (folder / "w2.bin").write_bytes(bytes(data))  # same size, new mtime
    os.utime(folder / "w2.bin", ns=(0, files["w2.bin"]["mtime_ns"] + 1))
    with pytest.raises(ChecksumError, match="w2.bin"):
        store.materialize(STAGE)


def test_damage_checks_both_digests_without_a_local_copy(store, tmp_path, monkeypatch, request):
    """verlflow verify's check: a chunked digest (TREE_MIN shrunk) streamed from the store, and a plain one; a file of
    the right size with one flipped bit is named, a deleted one too, and the listing check sees only the latter."""
    import io

    import verlflow.core.store.digests as S

    monkeypatch.setattr(S, "TREE_MIN", 1 << 20)
    monkeypatch.setattr(S, "TREE_PIECE", 256 * 1024)
    for n in (0, 1, 256 * 1024 - 1, 256 * 1024, 256 * 1024 + 1, 3 * 256 * 1024):
        data = os.urandom(n)
        assert S.stream_digest(io.BytesIO(data), "sha256_64m") == S.bytes_digest(data, "sha256_64m"), n
        assert S.stream_digest(io.BytesIO(data)) == S.bytes_digest(data), n
    write_stage(store, tmp_path)  # batch.bin (3 MiB + 7: chunked) and sub/stats.json (plain sha256)
    assert store.damage(STAGE, checksums=True) == []
    bad = bytearray(store.get_bytes(f"{STAGE}/batch.bin"))
    bad[len(bad) // 2] ^= 1
    store.put_bytes(f"{STAGE}/batch.bin", bytes(bad))
    store.rm(f"{STAGE}/sub/stats.json")
    assert store.damage(STAGE, checksums=False, sizes=store.sizes("runs")) == ["sub/stats.json is missing"]
    assert store.damage(STAGE, checksums=True) == ["batch.bin does not match its sha256_64m in the manifest",
                                                   "sub/stats.json is missing"]


def test_a_stage_with_a_truncated_manifest_can_be_uncommitted(store, tmp_path):
    write_stage(store, tmp_path)
    text = store.get_bytes(f"{STAGE}/manifest.json")
    store.put_bytes(f"{STAGE}/manifest.json", text[:40])
    with pytest.raises(StoreError, match=r"not valid JSON.*verlflow rerun run1 BLUEPRINT --from 'rollout\[0\]'"):
        store.read_manifest(STAGE)
    store.uncommit(STAGE)  # what a forced rerun does first
    assert store.read_manifest(STAGE) is None and store.ls(STAGE) == []
