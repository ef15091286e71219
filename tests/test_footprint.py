"""The space preflight (issue 15, item 2): validate estimates what a run keeps in its store at its peak
(core/checks/footprint.py) and refuses a file:// store whose filesystem cannot hold it; for s3:// it prints
the estimate.

The filesystems are real: a tmpfs of a chosen size mounted for the test (this machine and CI run as root). Only
where the tests do not run as root, `disk` fakes shutil.disk_usage for that folder instead (size minus the bytes
in it) and says so in its reason. The estimate itself is checked against the bytes the reference run's stages
really wrote (tests/reference.py).
"""

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from tinybp import ONE_RANK, tiny_blueprint, tiny_overrides

from verlflow.flows.cli import main
from verlflow.core.checks.footprint import estimate, human

pytestmark = pytest.mark.system

PAGE = 4096
AS_ROOT = os.geteuid() == 0


class Disk:
    """A filesystem of `size` bytes at `path`: a tmpfs as root, else a fake disk_usage (see the module's doc)."""

    def __init__(self, path: Path, monkeypatch):
        self.path, self.size = path, 0
        path.mkdir()
        if not AS_ROOT:  # no mount without root: the preflight's disk_usage is told the size instead
            real = shutil.disk_usage
            monkeypatch.setattr(shutil, "disk_usage", lambda p: self._fake(p) if Path(p).is_relative_to(path)
                                else real(p))

    def resize(self, size: int) -> None:
        size = -(-size // PAGE) * PAGE
        if AS_ROOT:
            opts = f"remount,size={size}" if self.size else f"size={size}"
            subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(self.path)], check=True)
        self.size = size

    def free(self) -> int:
        return shutil.disk_usage(self.path).free

    def _fake(self, p):
        used = sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        return SimpleNamespace(total=self.size, used=used, free=self.size - used)

    def unmount(self) -> None:
        if AS_ROOT and self.size:
            subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    d = Disk(tmp_path / "disk", monkeypatch)
    try:
        yield d
    finally:
        d.unmount()


def _cli(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def _times(term) -> str:
    return f"{term.count} x " if term.count != 1 else ""


def _variant(bp, **storage):
    out = bp.model_copy(deep=True)
    for k, v in storage.items():
        setattr(out.storage, k, v)
    return out


# --------------------------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("verb", ("validate-blueprint", "run"))
def test_a_small_filesystem_is_refused_with_the_numbers_and_the_fields(verb, disk, tiny_kit, capsys):
    store = disk.path / "store"
    overrides = tiny_overrides(tiny_kit, store, iterations=12)
    bp = tiny_blueprint(tiny_kit, store, iterations=12)
    need, one_checkpoint = estimate(bp), estimate(_variant(bp, keep_last_checkpoints=1)).total
    disk.resize(one_checkpoint + 16 * PAGE)  # room for keep_last_checkpoints: 1, not for the defaults
    assert estimate(_variant(bp, keep_last=1)).total > disk.size  # the case tells fitting fields from others
    rc, out, err = _cli([verb, *overrides] + (["--run-id", "small"] if verb == "run" else []), capsys)
    assert rc not in (0, None), out + err
    assert err.startswith(f"verlflow {verb}: error: storage.uri=file://{store}: the run would keep "
                          f"~{human(need.total)} at its peak ("), err
    held = [t for t in need.terms if t.count]
    for term in held[:4]:  # the main terms, each with its count and size
        assert f"{term.name} ({term.detail}) {_times(term)}{human(term.each)}" in err, err
    for term in need.terms:
        if not term.count:  # a term this run does not have (no phases) is left out of the message
            assert f"{term.name} (" not in err, err
    assert f"but there is {human(disk.free())} free at file://{store}: {human(need.total - disk.free())} short" \
        in err, err
    fitting, rest = err.split("Retention that makes it fit: ", 1)[1].split(" Not enough: ", 1)
    assert "storage.keep_last_checkpoints: 1 (~" in fitting and "storage.keep_best_metric: null (~" in fitting, err
    assert "storage.keep_last: 1 (~" in rest and "storage.keep_last: 1" not in fitting, err
    assert "Traceback" not in err
    assert _files(disk.path) == []  # nothing written: not even the store's folder


def test_a_filesystem_big_enough_passes_and_shows_the_estimate(disk, tiny_kit, capsys):
    store = disk.path / "store"
    need = estimate(tiny_blueprint(tiny_kit, store, iterations=12))
    disk.resize(need.total + 16 * PAGE)
    rc, out, err = _cli(["validate-blueprint", *tiny_overrides(tiny_kit, store, iterations=12)], capsys)
    assert rc == 0, err
    assert f"store footprint ~{human(need.total)} at its peak (training checkpoints" in out, out
    assert f"; {human(disk.free())} free at file://{store}" in out, out
    assert _files(disk.path) == []


def test_a_rerun_counts_what_the_run_already_holds(reference, disk, capsys):
    """The reference run, copied onto a disk with less free space than the estimate: its rerun fits (its own
    stages are part of the estimate), a new run there does not."""
    from reference import copy_store, rekey

    disk.resize(4 * estimate(reference.bp).total)
    bp, root = copy_store(reference.bp, disk.path)
    rekey(bp, reference.run_id)
    held = sum(p.stat().st_size for p in _files(root / "runs" / reference.run_id))
    need = estimate(bp).total
    used = disk.size - disk.free()
    disk.resize(used + need - held + 64 * 1024)  # free < need <= free + held
    assert disk.free() < need <= disk.free() + held
    # the reference's own retention: `need` above is its estimate, and validate's key holds the storage section (a
    # rerun with another retention ran validate again, in a 2-rank pool started for it)
    overrides = tiny_overrides(reference.kit, root, iterations=2, storage__keep_last_checkpoints=3)
    rc, out, err = _cli(["rerun", reference.run_id, *overrides], capsys)
    assert rc == 0, err
    assert f"(+ {human(held)} this run already holds there)" in out, out
    assert "is committed with the same key: reusing" in out  # nothing ran again
    assert not re.search(r"^\[verlflow\] \w+\[\w+\] -> ", out, re.M), out  # no stage was launched
    before = sorted(_files(root))
    rc, out, err = _cli(["run", *overrides, "--run-id", "another"], capsys)
    assert rc not in (0, None) and "short. " in err, out + err
    assert sorted(_files(root)) == before


def test_the_validate_stage_refuses_too(disk, tiny_kit):
    """A flow run (UI, schedule) starts at the validate stage, with no CLI preflight: the stage checks the same."""
    from verlflow.core.errors import VerlflowError
    from verlflow.core.orchestrate.runner import RunContext, run_stage

    store = disk.path / "store"
    bp = tiny_blueprint(tiny_kit, store, *ONE_RANK, iterations=12)
    need = estimate(bp)
    disk.resize(need.total // 2)
    lines = []
    with pytest.raises(VerlflowError) as e:
        run_stage(RunContext(bp, "flow", on_line=lines.append), "validate", "init", {})
    assert "store_space" in str(e.value) and f"~{human(need.total)} at its peak" in str(e.value), str(e.value)
    assert "Retention that makes it fit" in str(e.value) or "No retention setting" in str(e.value)
    assert not [p for p in _files(store) if p.name == "manifest.json"]  # nothing committed


def test_an_object_store_gets_the_estimate(s3_bucket, tiny_kit, capsys):
    bp = tiny_blueprint(tiny_kit, s3_bucket.uri)
    rc, out, err = _cli(["validate-blueprint", *tiny_overrides(tiny_kit, s3_bucket.uri)], capsys)
    assert rc == 0, err
    assert f"store footprint ~{human(estimate(bp).total)} at its peak" in out, out
    assert f"s3://{s3_bucket.name} is an object store: its room is not checked" in out, out


# ----------------------------------------------------------------------------------------- vs the real run


def _written(root: Path) -> Counter:
    """The bytes the reference run's stages wrote, by the estimate's terms."""
    term = {"update": "training checkpoints", "export": "HF exports", "rollout": "rollout batches",
            "validate": "validate report"}
    out = Counter()
    for p in _files(root):
        parts = p.relative_to(root).parts  # runs/<run>/<iteration>/<stage>/...
        if parts[0] != "runs":
            out["other"] += p.stat().st_size  # pointers, the key index
        elif parts[3] == "build":
            out["initial checkpoint" if parts[4] in ("policy", "critic") else "reference"] += p.stat().st_size
        else:
            out[term[parts[3]]] += p.stat().st_size
    return out


def test_the_estimate_covers_what_the_stages_write(reference):
    """Each term holds at least what its stages wrote and not much more (the weights' terms within 1.25x, all of it
    within 3x): the guard that the estimate follows what the stages really write."""
    fp, written = estimate(reference.bp), _written(reference.root)
    actual = sum(written.values())
    for term in fp.terms:
        assert written[term.name] <= term.bytes, (term, written)
    for name in ("training checkpoints", "initial checkpoint", "reference", "HF exports"):
        print(f"{name}: estimate {fp.term(name).bytes}, written {written[name]}")
        assert fp.term(name).bytes <= 1.25 * written[name], (fp.term(name), written)
    assert actual <= fp.total <= 3 * actual, (fp.total, actual)
    print(f"estimate {fp.total} bytes, the reference store {actual}: {fp.total / actual:.2f}x")
