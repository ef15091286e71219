"""The artifact store: files of every stage under one root (file:// or s3://), committed by a manifest.

Layout under the root:
    runs/<run_id>/<iteration>/<stage>/...            data files, then manifest.json (written LAST)
    index/<key>.json                                 {"manifest": "<stage_key>/manifest.json"}
    pointers/<name>.json                             e.g. the promoted `latest` iteration
    leases/<run_id>.json                             who is running the run now (core/store/lease.py)
    _probe/                                          scratch objects of probe()

A stage is *committed* once its manifest.json exists; readers trust manifests only and check every file's
sha256 (above 256 MiB: sha256 of its 64 MiB pieces) and size against it. Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, ... read by s3fs/botocore) or from `storage_options` in code; they never reach a manifest,
repr() or an error message.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import fsspec

from verlflow.core.cachedir import cache_root
from verlflow.core.errors import ChecksumError, PrunedError, StoreError, UnsafeKeyError, VerlflowError
from verlflow.core.store.digests import (DIGESTS, TREE_PIECE, algorithm_of, bytes_digest, file_digest, same_digest,
                                         stream_digest, untouched)
from verlflow.core.uris import carries_credentials, root_problem

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MANIFEST = "manifest.json"
_SECRET_OPTIONS = ("secret", "token", "key", "password", "aws_secret_access_key", "aws_session_token")


def safe_key(key: str) -> str:
    """Return `key` if it is a relative '/'-separated key that stays under the store root, else raise."""
    allowed = ("a relative key of '/'-separated segments, e.g. 'runs/r1/0/rollout/batch.pt': no leading '/', "
               "no '.', '..' or empty segments, no backslashes or control characters")
    problem = None
    if not isinstance(key, str) or not key:
        problem = "it is empty or not a string"
    elif key.startswith("/"):
        problem = "it is absolute"
    elif "\\" in key:
        problem = "it contains a backslash"
    elif any(ord(c) < 32 or ord(c) == 127 for c in key):
        problem = "it contains a NUL or control character"
    elif any(seg in ("", ".", "..") for seg in key.split("/")):
        problem = "it has an empty, '.' or '..' segment"
    if problem:
        raise UnsafeKeyError(f"Artifact key {key!r} is refused because {problem}; allowed is {allowed}.")
    return key


def safe_name(name: str, what: str = "name") -> str:
    """Run ids, stage and pointer names: one segment matching [A-Za-z0-9][A-Za-z0-9._-]*."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise UnsafeKeyError(f"{what} {name!r} is refused; allowed is [A-Za-z0-9][A-Za-z0-9._-]* "
                             "(a letter or digit, then letters, digits, '.', '_' or '-').")
    return name


# The longest file name the store builds from a run id is the lease's temporary file, `.<run_id>.json.<8 hex>.tmp`
# (run id + 19 characters), against the 255 bytes most filesystems allow; 128 also keeps a run's S3 keys and its
# local cache paths far from S3's 1,024-byte key limit and PATH_MAX.
RUN_ID_MAX = 128


def safe_run_id(run_id: str, what: str = "run_id") -> str:
    """A run id: one safe name of at most RUN_ID_MAX characters (the CLI and the flow refuse others up front)."""
    safe_name(run_id, what)
    if len(run_id) > RUN_ID_MAX:
        raise UnsafeKeyError(f"{what} {run_id[:24]}... is refused: it has {len(run_id)} characters, at most "
                             f"{RUN_ID_MAX} are allowed (letters, digits, '.', '_' or '-', starting with a letter "
                             "or digit); choose a shorter run id.")
    return run_id


def open_store(storage) -> "ArtifactStore":
    """The store a blueprint's `storage` section names (its uri, S3 endpoint and region)."""
    return ArtifactStore(storage.uri, endpoint_url=storage.endpoint_url, region=storage.region)


def stage_key(run_id: str, iteration: int | str, stage: str) -> str:
    """`runs/<run_id>/<iteration>/<stage>`; iteration is an int >= 0 or a name such as "init"."""
    if isinstance(iteration, bool) or not isinstance(iteration, (int, str)) or \
            (isinstance(iteration, int) and iteration < 0):
        raise UnsafeKeyError(f"iteration {iteration!r} is refused; allowed is an int >= 0 or a name like 'init'.")
    it = str(iteration) if isinstance(iteration, int) else safe_name(iteration, "iteration")
    return f"runs/{safe_run_id(run_id)}/{it}/{safe_name(stage, 'stage')}"


def _secret_values(opts: dict) -> set[str]:
    """Credential values passed in storage_options (also inside client_kwargs), to keep out of text we write."""
    found = set()
    for k, v in opts.items():
        if isinstance(v, dict):
            found |= _secret_values(v)
        elif k.lower() in _SECRET_OPTIONS and v:
            found.add(str(v))
    return found


def s3_max_attempts() -> int:
    """Requests per S3 call before giving up: $VERLFLOW_S3_MAX_ATTEMPTS (default 5; 1 means no retry)."""
    raw = os.environ.get("VERLFLOW_S3_MAX_ATTEMPTS", "5")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise StoreError(f"VERLFLOW_S3_MAX_ATTEMPTS={raw!r} is refused; allowed is an integer >= 1 (default 5).")
    return n


def _now() -> str:
    # microseconds: `ls` orders a run of phases by commit time, and a tiny stage commits within a second of the last
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def _index_key(key: str) -> str:
    return f"index/{safe_key(key)}.json"


def repair_command(stage_key: str, blueprint: tuple[str, ...] = ("BLUEPRINT",)) -> str:
    """The rerun that rewrites the stage at `runs/<run>/<iteration>/<stage>` (and every later one), ready to paste
    into a shell; `blueprint` is the blueprint file and overrides."""
    import shlex

    _, run, it, stage = stage_key.split("/")[:4]
    return shlex.join(["verlflow", "rerun", run, *blueprint, "--from", f"{stage}[{it}]"])


def _is_stage_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) >= 4 and parts[0] == "runs"


def _precondition_failed(exc: BaseException) -> bool:
    """An S3 conditional request lost: 412 PreconditionFailed, or 409 when another conditional write is in flight."""
    response = getattr(exc.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")


def _read_raced(exc: BaseException) -> bool:
    """A read of an S3 object another writer replaced meanwhile (If-Match lost, or s3fs's FileExpired)."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    return any(type(e).__name__ == "FileExpired" or _precondition_failed(e) for e in chain)


class ArtifactStore:
    def __init__(self, uri: str | os.PathLike, *, endpoint_url: str | None = None, region: str | None = None,
                 storage_options: dict | None = None):
        uri = str(uri)
        self.protocol = uri.split("://", 1)[0] if "://" in uri else "file"
        opts = dict(storage_options or {})
        self._secrets = _secret_values(opts)
        if self.protocol == "file":
            opts["auto_mkdir"] = True
        elif self.protocol == "s3":
            if carries_credentials(uri):
                raise StoreError("The store URI must not carry credentials (s3://key:secret@bucket); set "
                                 "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment instead.")
            if endpoint_url:
                opts["endpoint_url"] = endpoint_url
            if region:
                opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "region_name": region}
            # Bounded retries with backoff: botocore's "standard" mode retries throttling, 5xx and connection
            # errors with exponential backoff and jitter, up to S3_MAX_ATTEMPTS requests; s3fs's own loop (which
            # also covers a body that breaks off while being read) runs at most twice, with no backoff of its own
            # between its rounds: at most 2 x S3_MAX_ATTEMPTS requests, then a StoreError.
            opts["config_kwargs"] = {"retries": {"total_max_attempts": s3_max_attempts(), "mode": "standard"},
                                     **opts.get("config_kwargs", {})}
        else:
            raise StoreError(f"Store URI {uri!r} uses the unsupported protocol {self.protocol!r}; "
                             "use a local path, file:///abs/path or s3://bucket/prefix.")
        if problem := root_problem(uri):
            raise UnsafeKeyError(f"Store URI {uri!r} is refused: {problem}.")
        self.fs, root = fsspec.core.url_to_fs(uri, **opts)
        if self.protocol == "s3":
            self.fs.retries = 2  # s3fs's own rounds (a class attribute, default 5), see above
        self.root = root.rstrip("/") or "/"
        self.root_uri = f"{self.protocol}://{self.root}"
        self.is_local = self.protocol == "file"

    stage_key = staticmethod(stage_key)
    file_digest = staticmethod(file_digest)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root_uri!r})"

    # ---------- paths and errors
    def _path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{safe_key(key)}"

    def uri(self, key: str) -> str:
        """Full URI of a key, e.g. s3://bucket/prefix/runs/r1/0/rollout/batch.pt."""
        return f"{self.protocol}://{self._path(key)}"

    def local_path(self, key: str) -> Path | None:
        """The folder/file of a key on this machine's disk for file:// stores (workers write there); else None."""
        return Path(self._path(key)) if self.is_local else None

    def _redact(self, text: str) -> str:
        secrets = self._secrets | {os.environ.get(v, "") for v in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")}
        for s in secrets:
            if len(s) >= 4:
                text = text.replace(s, "***")
        return text

    @contextmanager
    def _wrap(self, action: str, key: str = "") -> Iterator[None]:
        """Turn fsspec/botocore/OS errors into one StoreError paragraph naming the URI and a fix."""
        try:
            yield
        except VerlflowError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error becomes a StoreError
            where = self.uri(key) if key else self.root_uri
            reason = self._redact(f"{type(exc).__name__}: {exc}")
            raise StoreError(f"Artifact store could not {action} {where}: {reason}. {self._hint(exc)}") from exc

    def _hint(self, exc: Exception) -> str:
        names = {c.__name__ for c in type(exc).__mro__} | {type(exc.__cause__).__name__}
        text = str(exc).lower()
        if "NoCredentialsError" in names or "PartialCredentialsError" in names:
            return ("No S3 credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the "
                    "environment (or load them from a Prefect Secret), or pass storage_options in code.")
        if "NoSuchBucket" in names or "bucket does not exist" in text:
            bucket = self.root.split("/")[0]
            return f"The bucket does not exist: create it (e.g. `aws s3 mb s3://{bucket}`) or fix storage.uri."
        if {"EndpointConnectionError", "ConnectionError", "ClientConnectorError"} & names:
            return "The S3 endpoint cannot be reached: check AWS_ENDPOINT_URL / endpoint_url and the network."
        if isinstance(exc, PermissionError):
            if self.is_local:
                return "The folder is not writable by this user: fix its permissions or choose another storage.uri."
            return ("Access was denied: check that the credentials are valid and may read and write this "
                    "bucket and prefix (and that AWS_ENDPOINT_URL / region are right).")
        if isinstance(exc, (NotADirectoryError, FileExistsError)):
            return "A part of the path is a regular file, not a folder: choose another storage.uri."
        return "Check storage.uri and the store's credentials, then retry."

    def _fresh(self) -> None:
        self.fs.invalidate_cache()  # s3fs caches listings; other ranks/processes may have written since

    # ---------- basic IO
    def put_bytes(self, key: str, data: bytes) -> None:
        with self._wrap("write", key):
            self.fs.pipe_file(self._path(key), data)

    def get_bytes(self, key: str) -> bytes:
        with self._wrap("read", key):
            return self.fs.cat_file(self._path(key))

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError as exc:
            if type(exc.__cause__).__name__ == "NoSuchBucket":
                with self._wrap("read", key):
                    raise
            return None
        except (IsADirectoryError, NotADirectoryError):
            return None
        except Exception:
            with self._wrap("read", key):
                raise

    def exists(self, key: str) -> bool:
        with self._wrap("check", key):
            self._fresh()
            return self.fs.exists(self._path(key))

    def ls(self, prefix: str = "") -> list[str]:
        """Every file key under `prefix` (the whole store if empty), relative to the store root, sorted."""
        base = self._path(prefix) if prefix else self.root
        with self._wrap("list", prefix):
            self._fresh()
            found = self.fs.find(base)
        cut = len(self.root.rstrip("/")) + 1
        return sorted(p[cut:] for p in found)

    def rm(self, prefix: str) -> None:
        """Delete one key or everything under `prefix` (missing is fine)."""
        with self._wrap("delete", prefix):
            self._fresh()
            try:
                self.fs.rm(self._path(prefix), recursive=True)
            except FileNotFoundError as exc:
                if type(exc.__cause__).__name__ == "NoSuchBucket":
                    raise

    def upload_file(self, local: str | os.PathLike, key: str) -> None:
        path = self._path(key)
        if self.is_local and os.path.exists(path) and os.path.samefile(local, path):
            return  # the worker wrote straight into the stage folder
        with self._wrap("upload to", key):
            self.fs.put_file(os.fspath(local), path)

    def download_file(self, key: str, local: str | os.PathLike) -> None:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.part")
        with self._wrap("download", key):
            try:
                self.fs.get_file(self._path(key), str(part))
                os.replace(part, local)
            finally:
                part.unlink(missing_ok=True)

    def upload_dir(self, local_dir: str | os.PathLike, key_prefix: str) -> list[str]:
        """Upload every file below local_dir to <key_prefix>/<rel>; return the rel names (sorted, '/'-separated)."""
        local_dir, key_prefix = Path(local_dir), safe_key(key_prefix)
        names = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
        for rel in names:
            self.upload_file(local_dir / rel, f"{key_prefix}/{safe_key(rel)}")
        return names

    def _write_atomic(self, key: str, data: bytes) -> None:
        """Readers see the old object or the new one, never half of it."""
        path = self._path(key)
        with self._wrap("write", key):
            if not self.is_local:
                self.fs.pipe_file(path, data)  # a single S3 PUT is atomic
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(tmp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    def _read_json(self, key: str) -> dict | None:
        raw = self._get_or_none(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            fix = (f"the stage is damaged: rerun it with `{repair_command(key)}`" if _is_stage_key(key)
                   else "delete it, or rerun the stage that wrote it")
            raise StoreError(f"{self.uri(key)} is not valid JSON ({exc}); {fix}.") from exc

    # ---------- conditional writes (a run's lease): atomic on a local folder (flock) and on S3 (If-None-Match,
    # If-Match). A version is what replace_if/delete_if compare: the sha256 of the bytes here, the ETag on S3.
    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and its version, or None if it does not exist."""
        path = self._path(key)
        with self._wrap("read", key):
            if self.is_local:
                try:
                    data = Path(path).read_bytes()
                except FileNotFoundError:
                    return None
                return data, hashlib.sha256(data).hexdigest()
            for attempt in (1, 2):  # the object may change between the HEAD and the read (then If-Match fails)
                self._fresh()
                try:
                    with self.fs.open(path, "rb") as f:
                        return f.read(), f.details["ETag"]
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    if attempt == 2 or not _precondition_failed(exc):
                        raise

    def create_exclusive(self, key: str, data: bytes) -> str | None:
        """Write the object only if it does not exist (of two writers exactly one wins); its version, or None."""
        if not self.is_local:
            done = self._s3_conditional("put_object", key, Body=data, IfNoneMatch="*")
            return done and done["ETag"]
        with self._locked(key):
            if os.path.exists(self._path(key)):
                return None
            self._write_atomic(key, data)
        return hashlib.sha256(data).hexdigest()

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Replace the object only if it is still at `version`; the new version, or None (it changed or went)."""
        if not self.is_local:
            done = self._s3_conditional("put_object", key, Body=data, IfMatch=version)
            return done and done["ETag"]
        with self._locked(key):
            current = self.read_versioned(key)
            if current is None or current[1] != version:
                return None
            self._write_atomic(key, data)
        return hashlib.sha256(data).hexdigest()

    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object only if it is still at `version`."""
        if not self.is_local:
            return self._s3_conditional("delete_object", key, IfMatch=version) is not None
        with self._locked(key):
            current = self.read_versioned(key)
            if current is None or current[1] != version:
                return False
            with self._wrap("delete", key):
                os.unlink(self._path(key))
        return True

    def _s3_conditional(self, method: str, key: str, **kwargs) -> dict | None:
        bucket, obj, _ = self.fs.split_path(self._path(key))
        with self._wrap("write" if method == "put_object" else "delete", key):
            try:
                out = self.fs.call_s3(method, Bucket=bucket, Key=obj, **kwargs)
            except (FileExistsError, FileNotFoundError) as exc:  # If-None-Match lost / the object is gone
                if type(exc.__cause__).__name__ == "NoSuchBucket":
                    raise
                return None
            except OSError as exc:
                if _precondition_failed(exc):
                    return None
                raise
            finally:
                self.fs.invalidate_cache(self._path(key))
        return out

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Serialises the conditional writes to one folder between this machine's processes: flock on the folder."""
        import fcntl

        folder = os.path.dirname(self._path(key))
        with self._wrap("lock", key):
            os.makedirs(folder, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # ---------- commit protocol
    def commit(self, stage_key: str, manifest: dict, files: dict[str, dict], *,
               committed_at: str | None = None) -> dict:
        """Write <stage_key>/manifest.json (after checking every listed file is there), then the index entry.
        `committed_at`: keep an earlier commit's time (retention re-commits a stage it prunes)."""
        safe_key(stage_key)
        if not isinstance(manifest.get("key"), str):
            raise StoreError(f"The manifest for {self.uri(stage_key)} has no string 'key'; "
                             "every stage manifest needs one.")
        index_key = _index_key(manifest["key"])
        with self._wrap("check files of", stage_key):
            self._fresh()
            for rel, d in files.items():
                if rel == MANIFEST:
                    raise StoreError(f"{self.uri(stage_key)}: a data file may not be called {MANIFEST}.")
                key = f"{stage_key}/{safe_key(rel)}"
                try:
                    size = self.fs.size(self._path(key))
                except FileNotFoundError:
                    raise StoreError(f"Cannot commit {self.uri(stage_key)}: the listed file {self.uri(key)} is missing "
                                     "from the store; upload every data file before committing.") from None
                if size != d["size"]:
                    raise StoreError(f"Cannot commit {self.uri(stage_key)}: {self.uri(key)} has {size} bytes but "
                                     f"{d['size']} were recorded; upload it again before committing.")
        listed = {rel: {k: d[k] for k in (*DIGESTS, "size", "mtime_ns") if k in d} for rel, d in sorted(files.items())}
        stored = {**manifest, "files": listed, "format": 1, "stage_uri": self.uri(stage_key),
                  "committed_at": committed_at or _now()}
        text = json.dumps(stored, indent=2, sort_keys=True, default=str)
        if self._redact(text) != text:
            raise StoreError(f"Refusing to commit {self.uri(stage_key)}: the manifest contains a credential value; "
                             "remove secrets (e.g. environment dumps) from the manifest.")
        self._write_atomic(f"{stage_key}/{MANIFEST}", text.encode())
        self._write_atomic(index_key, json.dumps({"manifest": f"{stage_key}/{MANIFEST}"}).encode())
        return stored

    def read_manifest(self, stage_key: str) -> dict | None:
        """The committed manifest of a stage, or None if it never committed."""
        return self._read_json(f"{safe_key(stage_key)}/{MANIFEST}")

    def lookup(self, key: str) -> dict | None:
        """The committed manifest whose "key" is `key`, or None (index missing, stale, or stage uncommitted)."""
        entry = self._read_json(_index_key(key))
        target = entry.get("manifest") if isinstance(entry, dict) else None
        if not isinstance(target, str) or not target.endswith(f"/{MANIFEST}"):
            return None
        manifest = self._read_json(target)
        return manifest if manifest and manifest.get("key") == key else None

    def uncommit(self, stage_key: str) -> None:
        """Make a stage invisible (manifest first), then drop its index entry and its data."""
        manifest_key = f"{safe_key(stage_key)}/{MANIFEST}"
        try:
            manifest = self.read_manifest(stage_key)
        except StoreError:  # a damaged manifest: its index entry cannot be known, and lookup() ignores a stale one
            manifest = None
        self.rm(manifest_key)
        if manifest and isinstance(manifest.get("key"), str):
            index_key = _index_key(manifest["key"])
            entry = self._read_json(index_key)
            if isinstance(entry, dict) and entry.get("manifest") == manifest_key:
                self.rm(index_key)
        self.rm(stage_key)

    def mark_pruned(self, stage_key: str, folders: tuple[str, ...] | None = None) -> dict:
        """Retention (verlflow.core.store.retention): commit the stage's manifest again, marked pruned and listing
        only the files outside `folders` (all of them: None) and the pruned ones under `pruned_files`. The stage
        stays committed, so reruns skip it; the caller deletes the pruned files after this returns."""
        manifest = self._committed(stage_key)
        files = manifest["files"]
        gone = {r for r in files if folders is None or r.startswith(folders)}
        kept = {k: v for k, v in manifest.items() if k not in ("files", "format", "stage_uri", "committed_at")}
        kept.update(pruned=True, pruned_files=sorted(gone | set(manifest.get("pruned_files", []))), pruned_at=_now())
        return self.commit(stage_key, kept, {r: d for r, d in files.items() if r not in gone},
                           committed_at=manifest["committed_at"])

    def rm_files(self, keys: list[str]) -> None:
        """Delete these file keys (missing ones are fine), in as few requests as the filesystem allows."""
        if not keys:
            return
        with self._wrap("delete", keys[0]):
            self._fresh()
            paths = [self._path(k) for k in keys]
            try:
                self.fs.rm(paths)
            except FileNotFoundError as exc:
                if type(exc.__cause__).__name__ == "NoSuchBucket":
                    raise
                for p in paths:  # one was gone already: the others one by one
                    if self.fs.exists(p):
                        self.fs.rm_file(p)

    def pruned_error(self, stage_key: str, rels: list[str]) -> PrunedError:
        shown = ", ".join(rels[:3]) + (", ..." if len(rels) > 3 else "")
        return PrunedError(
            f"{self.uri(stage_key)}: {shown} {'was' if len(rels) == 1 else 'were'} pruned by retention "
            "(storage.keep_last_checkpoints, keep_last, keep_best_metric); the stage stays committed but its files "
            "are gone. `verlflow rerun` of this run names the nearest step it can resume from.")

    # ---------- verified reads
    def _committed(self, stage_key: str) -> dict:
        manifest = self.read_manifest(stage_key)
        if manifest is None:
            raise StoreError(f"Stage {self.uri(stage_key)} is not committed (no {MANIFEST}); run it first, or "
                             f"rerun it with `verlflow rerun --from {stage_key.rsplit('/', 1)[-1]}`.")
        return manifest

    def _check(self, stage_key: str, rel: str, expected: dict, actual: dict) -> None:
        if not same_digest(actual, expected):
            a = algorithm_of(expected)
            raise ChecksumError(
                f"{self.uri(f'{stage_key}/{rel}')} does not match its manifest: expected {a} {expected.get(a)} "
                f"({expected['size']} bytes), found {a} {actual.get(a)} ({actual['size']} bytes). The file "
                "changed after the stage committed; rerun the stage with "
                f"`verlflow rerun --from {stage_key.rsplit('/', 1)[-1]}`.")

    def read_verified(self, stage_key: str, rel: str) -> bytes:
        """Bytes of one committed file, checked against the manifest."""
        manifest = self._committed(stage_key)
        files = manifest["files"]
        if rel in manifest.get("pruned_files", []):
            raise self.pruned_error(stage_key, [rel])
        if rel not in files:
            raise StoreError(f"{self.uri(stage_key)} has no file {rel!r}; its manifest lists {sorted(files)}.")
        data = self.get_bytes(f"{stage_key}/{safe_key(rel)}")
        self._check(stage_key, rel, files[rel], bytes_digest(data, algorithm_of(files[rel])))
        return data

    def materialize(self, stage_key: str, local_dir: str | os.PathLike | None = None) -> Path:
        """A local folder holding every file of the committed stage, each verified against the manifest.

        file:// stores return the stage folder itself; a file whose size and mtime are those recorded at commit
        is not hashed again (VERLFLOW_VERIFY=full re-hashes every file). s3:// stores download into local_dir (default
        $VERLFLOW_CACHE_DIR or ~/.cache/verlflow, then <bucket/prefix>/<stage_key>); files already there with
        the right digest are not downloaded again.
        """
        manifest = self._committed(stage_key)
        files = manifest["files"]
        if manifest.get("pruned") and not files:
            raise self.pruned_error(stage_key, manifest["pruned_files"])
        if self.is_local:
            folder = Path(self._path(stage_key))
        else:
            cache = cache_root()
            folder = Path(local_dir) if local_dir is not None else cache / self.root / stage_key
        for rel, expected in files.items():
            key, dst = f"{stage_key}/{safe_key(rel)}", folder / rel
            if self.is_local and untouched(dst, expected):
                continue
            algorithm = algorithm_of(expected)
            actual = file_digest(dst, algorithm) if dst.is_file() else None
            if not self.is_local and not same_digest(actual, expected):  # not in the cache yet, or damaged there
                try:
                    self.download_file(key, dst)
                    actual = file_digest(dst, algorithm)
                except StoreError as exc:
                    if not isinstance(exc.__cause__, FileNotFoundError):
                        raise
                    actual = None
            if actual is None:
                if self._pruned_since(stage_key, rel):
                    continue
                raise ChecksumError(f"{self.uri(key)} is listed in the manifest but missing; rerun the stage with "
                                    f"`verlflow rerun --from {stage_key.rsplit('/', 1)[-1]}`.")
            self._check(stage_key, rel, expected, actual)
        return folder

    def _pruned_since(self, stage_key: str, rel: str) -> bool:
        """Retention pruned `rel` after this reader read the manifest (it commits the pruned manifest, then deletes
        the files): no stage still to run needs a pruned file (core/store/retention.py), so the reader goes on
        without it. A file missing for any other reason is damage."""
        manifest = self._committed(stage_key)
        return rel in manifest.get("pruned_files", []) and rel not in manifest["files"]

    # ---------- integrity of committed stages (verlflow verify, verlflow ls)
    def sizes(self, prefix: str) -> dict[str, int]:
        """Every file key under `prefix` with its size in bytes (one listing)."""
        with self._wrap("list", prefix):
            self._fresh()
            found = self.fs.find(self._path(prefix), detail=True)
        cut = len(self.root.rstrip("/")) + 1
        return {p[cut:]: int(info["size"]) for p, info in found.items()}

    def damage(self, stage_key: str, *, checksums: bool, sizes: dict[str, int] | None = None) -> list[str]:
        """What is wrong with a committed stage's files ([] if nothing): missing or of another size than the manifest
        says, and with `checksums` also a different digest. `sizes` (from sizes()) saves a request per file."""
        problems = []
        for rel, expected in sorted(self._committed(stage_key)["files"].items()):
            key = f"{stage_key}/{safe_key(rel)}"
            size = sizes.get(key) if sizes is not None else self._size_or_none(key)
            if size is None:
                problems.append(f"{rel} is missing")
            elif size != expected["size"]:
                problems.append(f"{rel} has {size} bytes, its manifest says {expected['size']}")
            elif checksums and not same_digest(self._digest(key, algorithm_of(expected)), expected):
                problems.append(f"{rel} does not match its {algorithm_of(expected)} in the manifest")
        return problems

    def _size_or_none(self, key: str) -> int | None:
        with self._wrap("check", key):
            try:
                return int(self.fs.size(self._path(key)))
            except FileNotFoundError:
                return None

    def _digest(self, key: str, algorithm: str) -> dict:
        with self._wrap("read", key):
            if self.is_local:
                return file_digest(self._path(key), algorithm)
            with self.fs.open(self._path(key), "rb", block_size=TREE_PIECE) as f:
                return stream_digest(f, algorithm)

    # ---------- pointers and probe
    def set_pointer(self, name: str, value: dict) -> None:
        self._write_atomic(f"pointers/{safe_key(name)}.json", json.dumps(value, sort_keys=True).encode())

    def _read_settled(self, key: str, attempts: int = 10) -> tuple[bytes, str] | None:
        """read_versioned, read again while other writers keep replacing the object under the read (S3)."""
        for attempt in range(1, attempts + 1):
            try:
                return self.read_versioned(key)
            except StoreError as exc:
                if attempt == attempts or not _read_raced(exc):
                    raise

    def get_pointer(self, name: str) -> dict | None:
        return self._read_json(f"pointers/{safe_key(name)}.json")

    def update_pointer(self, name: str, change: Callable[[dict | None], dict | None]) -> dict | None:
        """Read-modify-write of a pointer as one atomic, conditional write (flock here, If-Match on S3), retried
        while another writer gets in between: `change` maps the current value (None: none yet) to the new one
        (None: leave it). Returns what was written, or None."""
        key = f"pointers/{safe_key(name)}.json"
        while True:  # until our write lands on the version we read
            current = self._read_settled(key)
            value = change(None if current is None else json.loads(current[0]))
            if value is None:
                return None
            data = json.dumps(value, sort_keys=True).encode()
            done = self.create_exclusive(key, data) if current is None else self.replace_if(key, data, current[1])
            if done is not None:
                return value

    def probe(self) -> None:
        """Write, read back and delete a small object; raise StoreError saying what is wrong and how to fix it."""
        key, payload = f"_probe/{uuid.uuid4().hex}", b"verlflow probe"
        self.put_bytes(key, payload)
        try:
            if self.get_bytes(key) != payload:
                raise StoreError(f"Artifact store {self.root_uri} returned different bytes than were written to "
                                 f"{self.uri(key)}; check the endpoint (AWS_ENDPOINT_URL) and any proxy in between.")
        finally:
            self.rm(key)
