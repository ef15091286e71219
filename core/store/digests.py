"""A file's digest as a manifest records it: sha256, or above TREE_MIN bytes sha256 of its 64 MiB pieces' sha256s
(hashed in parallel). The store (core/store/artifacts.py) writes and checks them; a stage hashes what it commits."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
# Files this big get a chunked digest: sha256 of the sha256s of their 64 MiB pieces, hashed in parallel threads
# (one 18 GB policy checkpoint: ~11 s for a plain sha256 at 1.7 GB/s, ~2 s chunked on 8 cores).
TREE_MIN, TREE_PIECE = 256 << 20, 64 << 20
DIGESTS = ("sha256", "sha256_64m")  # the manifest records exactly one of these per file


def file_digest(local_path: str | os.PathLike, algorithm: str | None = None) -> dict[str, Any]:
    """{"sha256": hex, "size": bytes} of a local file, or {"sha256_64m": ...} above TREE_MIN bytes. `algorithm`
    forces one (to check a file against a manifest written with it)."""
    size = os.path.getsize(local_path)
    algorithm = algorithm or ("sha256_64m" if size >= TREE_MIN else "sha256")
    if algorithm == "sha256":
        h = hashlib.sha256()
        with open(local_path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return {"sha256": h.hexdigest(), "size": size}
    from concurrent.futures import ThreadPoolExecutor

    def piece(offset: int) -> bytes:
        h = hashlib.sha256()
        with open(local_path, "rb") as f:
            f.seek(offset)
            left = min(TREE_PIECE, size - offset)
            while left > 0 and (chunk := f.read(min(CHUNK * 8, left))):
                h.update(chunk)
                left -= len(chunk)
        return h.digest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        pieces = list(pool.map(piece, range(0, max(size, 1), TREE_PIECE)))
    return {"sha256_64m": hashlib.sha256(b"".join(pieces)).hexdigest(), "size": size}


def bytes_digest(data: bytes, algorithm: str = "sha256") -> dict[str, Any]:
    if algorithm == "sha256":
        return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    pieces = [hashlib.sha256(data[i:i + TREE_PIECE]).digest() for i in range(0, max(len(data), 1), TREE_PIECE)]
    return {"sha256_64m": hashlib.sha256(b"".join(pieces)).hexdigest(), "size": len(data)}


def stream_digest(f, algorithm: str = "sha256") -> dict[str, Any]:
    """file_digest of an open binary stream (an S3 object read piece by piece), with no local copy."""
    h, size, in_piece, pieces = hashlib.sha256(), 0, 0, []
    while chunk := f.read(CHUNK * 8):
        size += len(chunk)
        if algorithm == "sha256":
            h.update(chunk)
            continue
        while chunk:
            take = chunk[:TREE_PIECE - in_piece]
            h.update(take)
            in_piece, chunk = in_piece + len(take), chunk[len(take):]
            if in_piece == TREE_PIECE:
                pieces.append(h.digest())
                h, in_piece = hashlib.sha256(), 0
    if algorithm == "sha256":
        return {"sha256": h.hexdigest(), "size": size}
    if in_piece or not pieces:
        pieces.append(h.digest())
    return {"sha256_64m": hashlib.sha256(b"".join(pieces)).hexdigest(), "size": size}


def algorithm_of(entry: dict) -> str:
    return next((a for a in DIGESTS if a in entry), "sha256")


def same_digest(actual: dict | None, expected: dict) -> bool:
    a = algorithm_of(expected)
    return actual is not None and actual.get(a) == expected.get(a) and actual["size"] == expected["size"]


def digest_files(folder: Path, rels: list[str], *, stamp: bool = False, workers: int = 8) -> dict[str, dict]:
    """file_digest of many files at once (hashlib releases the GIL, so threads hash in parallel). `stamp` adds
    each file's mtime_ns, which lets a local store skip re-hashing a file nobody has touched since."""
    from concurrent.futures import ThreadPoolExecutor

    def one(rel: str) -> dict:
        d = file_digest(folder / rel)
        if stamp:
            d["mtime_ns"] = os.stat(folder / rel).st_mtime_ns
        return d

    with ThreadPoolExecutor(max(1, min(workers, len(rels)))) as pool:
        return dict(zip(rels, pool.map(one, rels)))


def untouched(path: Path, expected: dict) -> bool:
    """Same size and modification time as when committed: the quick check (VERLFLOW_VERIFY=full re-hashes)."""
    if "mtime_ns" not in expected or os.environ.get("VERLFLOW_VERIFY") == "full":
        return False
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_size == expected["size"] and st.st_mtime_ns == expected["mtime_ns"]
