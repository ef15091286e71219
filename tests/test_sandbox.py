"""The code-execution sandbox (verlflow.core.agent.sandbox): each attack is stopped or refused, the result says
by what, and the next call works. Each attack also runs with layers left out, to show which layer holds it,
and with none (the negative control: the same code then gets through, so the guarded runs prove the guard)."""

import os
import socket
import time

import pytest

from verlflow.core.agent.sandbox import LAYERS, run_python

pytestmark = pytest.mark.unit

KERNEL = tuple(layer for layer in LAYERS if layer != "audit")
LIMITS = dict(cpu_s=1, memory_mb=256, wall_s=2)


def run(code, scratch, layers=LAYERS, **kw):
    return run_python(code, scratch=scratch, layers=layers, **{**LIMITS, **kw})


def _still_works(scratch):
    after = run("print(6 * 7)", scratch)
    assert after.ok and after.stdout == "42\n" and after.reason is None, after


def _need(result, *layers):
    down = {layer: result.layers.get(layer) for layer in layers
            if not result.layers.get(layer) or str(result.layers.get(layer)).startswith("unavailable")}
    if down:
        pytest.skip(f"this Linux does not allow the layer(s): {down}")


def test_a_normal_call_runs_in_its_own_folder_with_the_layers_up(tmp_path):
    r = run("import os\nopen('mine.txt', 'w').write('x')\nprint(os.listdir('.'), os.environ.get('TMPDIR') == "
            "os.getcwd())", tmp_path)
    assert r.ok and r.stdout == "['mine.txt'] True\n", r
    assert r.layers.get("rlimits") is True and r.layers.get("audit") is True
    assert list(tmp_path.iterdir()) == []  # the call's folder is gone


def test_output_is_cut_at_the_cap(tmp_path):
    r = run("print('x' * 100000)", tmp_path, output_cap=100)
    assert r.ok and r.stdout.startswith("x" * 100) and "truncated at 100 characters" in r.stdout
    assert len(r.stdout) < 200


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(tmp_path):
    r = run("while True: pass", tmp_path, wall_s=20)  # a loaded machine gives it 1 s of CPU late
    assert (r.ok, r.reason) == (False, "cpu") and "RLIMIT_CPU" in r.detail, r
    _still_works(tmp_path)


def test_without_the_cpu_limit_the_wall_clock_stops_it(tmp_path):
    t0 = time.monotonic()
    r = run("while True: pass", tmp_path, layers=("audit",), wall_s=1.5)
    assert r.reason == "timeout" and "process group was killed" in r.detail, r
    assert time.monotonic() - t0 < 5


def test_a_sleeping_call_is_killed_at_the_wall_clock(tmp_path):
    t0 = time.monotonic()
    r = run("import time\nprint('started', flush=True)\ntime.sleep(30)", tmp_path, wall_s=1)
    assert (r.reason, r.stdout) == ("timeout", "started\n"), r
    assert time.monotonic() - t0 < 5
    _still_works(tmp_path)


MEMORY_BOMB = "blocks = []\nfor _ in range(8):\n    blocks.append(bytearray(64 << 20))\nprint('allocated')"


def test_a_memory_bomb_is_stopped_by_the_memory_limit(tmp_path):
    r = run(MEMORY_BOMB, tmp_path, memory_mb=200)
    assert (r.ok, r.reason) == (False, "memory") and "RLIMIT_AS" in r.detail, r
    _still_works(tmp_path)
    unguarded = run(MEMORY_BOMB, tmp_path, memory_mb=200, layers=())  # 512 MiB: gets through without the limit
    assert unguarded.ok and unguarded.stdout == "allocated\n", unguarded


FORK_BOMB = "import os\nfor _ in range(3):\n    os.fork()\nprint('forked', flush=True)"
WRITE = "open({path!r}, 'w').write('escaped')\nprint('wrote')"
CONNECT = "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')"


@pytest.fixture
def listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@pytest.mark.parametrize("layers,says", [
    (LAYERS, "os.fork (audit hook)"),
    (("audit",), "os.fork (audit hook)"),
    (KERNEL, "(seccomp)"),
    (("rlimits",), "(RLIMIT_NPROC)"),
])
def test_a_fork_bomb_is_refused(tmp_path, layers, says):
    if layers == ("rlimits",) and os.geteuid() == 0:
        pytest.skip("the kernel does not apply RLIMIT_NPROC to root: seccomp holds it there")
    r = run(FORK_BOMB, tmp_path, layers=layers)
    _need(r, *layers)
    assert (r.ok, r.reason, r.stdout) == (False, "refused", ""), r
    assert says in r.detail, r.detail
    _still_works(tmp_path)


@pytest.mark.parametrize("layers,says", [
    (LAYERS, "write outside the working folder"),
    (("audit",), "write outside the working folder"),
    (("landlock",), "(landlock)"),
])
def test_a_write_outside_scratch_is_refused(tmp_path, layers, says):
    target = tmp_path / "outside" / "escape.txt"
    target.parent.mkdir()
    r = run(WRITE.format(path=str(target)), tmp_path / "scratch", layers=layers)
    _need(r, *layers)
    assert (r.ok, r.reason) == (False, "refused") and says in r.detail, r
    assert not target.exists()
    _still_works(tmp_path / "scratch")


@pytest.mark.parametrize("layers,says", [
    (LAYERS, "socket of family 2 (audit hook)"),
    (("audit",), "socket of family 2 (audit hook)"),
    (KERNEL, "(seccomp)"),
    (("namespaces",), "(network namespace)"),
    (("landlock",), "(landlock)"),
])
def test_a_socket_connect_is_refused(tmp_path, listener, layers, says):
    r = run(CONNECT.format(port=listener), tmp_path, layers=layers)
    _need(r, *layers)
    if layers == ("landlock",) and r.layers["landlock"] < 4:
        pytest.skip(f"landlock ABI {r.layers['landlock']} has no network rules (4 and later do)")
    assert (r.ok, r.reason, r.stdout) == (False, "refused", ""), r
    assert says in r.detail, r.detail
    _still_works(tmp_path)


def test_without_any_layer_the_same_attacks_get_through(tmp_path, listener):
    """The negative control: what the tests above see refused is refused by the layers, not by the test."""
    target = tmp_path / "outside.txt"
    scratch = tmp_path / "scratch"
    assert run(WRITE.format(path=str(target)), scratch, layers=()).stdout == "wrote\n" and target.exists()
    assert run(CONNECT.format(port=listener), scratch, layers=()).stdout == "connected\n"
    forked = run(FORK_BOMB, scratch, layers=())
    assert forked.stdout.count("forked") == 8, forked  # 2**3 processes, each exits after printing
