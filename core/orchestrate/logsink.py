"""Where a stage's output goes: every line to the stage's log file, and records to a caller (the terminal, a Prefect
task's logger), with a rank's traceback as ONE ERROR record instead of one INFO record per line.

A stage's log file is `$VERLFLOW_CACHE_DIR/logs/<protocol>/<store root>/<run_id>/<stage>-<iteration>.log` on the
machine that ran it (default ~/.cache/verlflow, where the inductor cache and S3 downloads already live), e.g.
~/.cache/verlflow/logs/s3/bucket/prefix/r1/update-1.log. Not in the store: it holds committed, checksummed
artifacts only (a refused or failed stage leaves nothing there), an S3 object cannot be appended to line by line,
and one rule serves every store. A failure's message prints the path. Each attempt appends, after a header line.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import socket
import threading
from pathlib import Path
from typing import Callable

from verlflow.core.cachedir import cache_root
from verlflow.core.store.artifacts import ArtifactStore, safe_run_id

# The launcher's lines: "[rank3] text" or "[torchrun] text".
_SOURCE = re.compile(r"(\[(?:rank\d+|torchrun)\]) ?(.*)", re.S)
_TRACEBACK = "Traceback (most recent call last):"
# A line that starts a new log record ends a traceback: the workers' format (setup_logging: "12:00:00 name: ..."),
# torch's glog-style lines ("W1201 12:00:00.123 ...", also in brackets), or ours ("[verlflow] ...").
_RECORD = re.compile(r"(\d\d:\d\d:\d\d |\[?[IWEF]\d{4} \d\d:\d\d:\d\d|\[verlflow)")
_MAX_BLOCK = 2000  # lines: a runaway block is emitted in parts


def log_folder(store: ArtifactStore, run_id: str) -> Path:
    cache = cache_root()
    return cache / "logs" / store.protocol / store.root.lstrip("/") / safe_run_id(run_id)


def stage_log_path(store: ArtifactStore, run_id: str, stage: str, iteration) -> Path:
    return log_folder(store, run_id) / f"{stage}-{iteration}.log"


class LineSink:
    """The on_line of a stage's job: `emit(level, text)` gets INFO records for ordinary lines and one ERROR record
    per traceback (with its source prefix once); the file gets every line as it came. Thread-safe (a warm pool
    streams from its own thread). Close it (or use it as a context manager) to emit a traceback still open."""

    def __init__(self, path: Path, emit: Callable[[int, str], None]):
        self.path, self.emit = Path(path), emit
        self._lock = threading.Lock()
        self._blocks: dict[str, list[str]] = {}  # source -> the lines of its open traceback
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8", errors="replace")
        stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self._file.write(f"==== {stamp} {socket.gethostname()} pid {os.getpid()}\n")
        self._file.flush()

    def __call__(self, line: str) -> None:
        with self._lock:
            self._write(line)
            m = _SOURCE.match(line)
            source, text = (m[1], m[2]) if m else ("", line)
            block = self._blocks.get(source)
            if block is not None and not _RECORD.match(text):
                block.append(text)
                if len(block) >= _MAX_BLOCK:
                    self._end(source)
                return
            if block is not None:
                self._end(source)
            if text.startswith(_TRACEBACK):
                self._blocks[source] = [text]
            else:
                self.emit(logging.INFO, line)

    def _write(self, line: str) -> None:
        if self._file.closed:  # a background commit's lines after the stage ended
            self._file = open(self.path, "a", encoding="utf-8", errors="replace")
        self._file.write(line + "\n")
        self._file.flush()

    def _end(self, source: str) -> None:
        lines = self._blocks.pop(source)
        self.emit(logging.ERROR, (f"{source} " if source else "") + "\n".join(lines))

    def close(self) -> None:
        with self._lock:
            for source in list(self._blocks):
                self._end(source)
            self._file.close()

    def __enter__(self) -> "LineSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
