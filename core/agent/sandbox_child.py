"""The sandbox's child process: ``python -I -S -X utf8 sandbox_child.py CONFIG_JSON`` (verlflow.core.agent.sandbox).

Standard library only (it runs isolated, without site-packages). It reads the code, puts its guards up in this
order, each one a layer the config may leave out, then runs the code as ``__main__``:

1. namespaces: unshare a user + network namespace (a network namespace alone when only root may): no network
   interface but a down loopback, and the process keeps no capability over the host (so the limits below hold
   even for root).
2. landlock: writes only beneath the working folder; no TCP bind/connect (ABI >= 4); no signals to, and no
   abstract unix sockets of, processes outside the sandbox (ABI >= 6).
3. rlimits: CPU seconds, address space, file size, open files, no core dumps, and no new process (RLIMIT_NPROC 0;
   the kernel does not apply it to root).
4. seccomp: a BPF filter: no fork, vfork, clone of a process (threads pass), exec, socket (socketpair of unix
   sockets passes), ptrace, and no signal but to itself.
5. audit: a Python audit hook (PEP 578) that refuses, before the call, what the layers above refuse in the
   kernel: writes outside the working folder, sockets, new processes, signals, ctypes. It cannot be removed, but
   it is not a boundary against code that digs into the interpreter's internals: it is the fallback where the
   kernel offers none of the above, and the clear message where it does.

Fd `report_fd` (a file the parent reads) gets tab-separated lines: ``layers <json>``, ``refused <event> <what>``
(the audit hook), ``end <reason> <exception>`` (an uncaught exception: memory, refused or error).
"""

import builtins
import errno
import json
import os
import resource
import signal
import sys
import traceback
import types

AF_UNIX = 1
CLONE_NEWUSER, CLONE_NEWNET, CLONE_THREAD = 0x10000000, 0x40000000, 0x00010000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


class Refused(PermissionError):
    """The audit hook refused a call."""


def main() -> None:
    cfg = json.loads(sys.argv[1])
    with open(cfg["code"], encoding="utf-8") as f:
        code = f.read()
    os.unlink(cfg["code"])  # the code's text is not the code's to read (python env: its tests' pass tag)
    sys.argv = ["<code>"]
    report = cfg["report_fd"]
    layers = set(cfg["layers"])
    up: dict = {}
    steps = (("namespaces", _unshare), ("landlock", lambda: _landlock(cfg["work"])),
             ("rlimits", lambda: _rlimits(cfg)), ("seccomp", _seccomp))
    for name, put_up in steps:
        if name in layers:
            up[name] = _try(put_up)
    for mod in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[mod]  # so that user code must import it again, which the audit hook refuses
    if "audit" in layers:
        _audit_hook(cfg["work"], report, kernel_stops_forks=up.get("seccomp") is True)
        up["audit"] = True
    _write(report, "layers", json.dumps(up))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE a write fails (EFBIG) instead of killing
    _run(code, report, up)


def _try(put_up):
    try:
        return put_up()
    except (OSError, ValueError) as e:  # ValueError: a limit above the hard limit this process was given
        return f"unavailable: {e}"


def _run(code: str, report: int, up: dict) -> None:
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    try:
        exec(compile(code, "<code>", "exec"), main_module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every uncaught error is the code's result
        reason, layer = _classify(e, up)
        _write(report, "end", reason, f"{type(e).__name__}: {e}" + (f" ({layer})" if layer else ""))
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except MemoryError:
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def _classify(e: BaseException, up: dict) -> tuple[str, str]:
    """(reason, the layer that most likely refused) of an uncaught exception."""
    if isinstance(e, MemoryError):
        return "memory", "RLIMIT_AS"
    if isinstance(e, Refused):
        return "refused", "audit hook"
    layer = {errno.EAGAIN: "RLIMIT_NPROC", errno.EFBIG: "RLIMIT_FSIZE", errno.EMFILE: "RLIMIT_NOFILE",
             errno.ENETUNREACH: "network namespace", errno.ENETDOWN: "network namespace",
             errno.EPERM: "seccomp" if up.get("seccomp") is True else "permissions",
             errno.EACCES: "landlock" if isinstance(up.get("landlock"), int) else "file permissions",
             }.get(getattr(e, "errno", None))
    return ("refused", layer) if isinstance(e, OSError) and layer else ("error", "")


def _write(fd: int, *fields: str) -> None:
    line = "\t".join(str(f).replace("\t", " ").replace("\n", " ")[:500] for f in fields) + "\n"
    os.write(fd, line.encode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------------- kernel
def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return ctypes, libc


def _check(ctypes, result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _unshare():
    ctypes, libc = _libc()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "user+net"
    _check(ctypes, libc.unshare(CLONE_NEWNET), "unshare")  # root where user namespaces are off
    return "net"


# Landlock (linux/landlock.h): syscalls 444-446 on every architecture.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT, _LL_VERSION, _LL_PATH_BENEATH = 444, 445, 446, 1, 1
# write-side filesystem rights, by the ABI that added them: WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR,
# MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM (1); REFER (2); TRUNCATE (3); IOCTL_DEV (5)
_LL_FS_WRITE = {1: 0b1111111110010, 2: 1 << 13, 3: 1 << 14, 5: 1 << 15}


def _landlock(work: str) -> int:
    ctypes, libc = _libc()
    abi = _check(ctypes, libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_VERSION)),
                 "landlock")

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    fs = sum(bits for since, bits in _LL_FS_WRITE.items() if abi >= since)
    attr = RulesetAttr(fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)  # TCP bind+connect; unix+signal
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _check(ctypes, libc.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size),
                                          ctypes.c_uint32(0)), "landlock_create_ruleset")
    folder = os.open(work, os.O_PATH | os.O_CLOEXEC)
    try:
        rule = PathBeneath(fs, folder)
        _check(ctypes, libc.syscall(_LL_ADD_RULE, ruleset, _LL_PATH_BENEATH, ctypes.byref(rule), 0),
               "landlock_add_rule")
        _check(ctypes, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        _check(ctypes, libc.syscall(_LL_RESTRICT, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(folder)
        os.close(ruleset)
    return abi


def _rlimits(cfg: dict) -> bool:
    cpu = max(1, int(-(-cfg["cpu_s"] // 1)))  # whole seconds, rounded up
    limits = {resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
              resource.RLIMIT_AS: (cfg["memory_mb"] << 20,) * 2, resource.RLIMIT_FSIZE: (cfg["file_mb"] << 20,) * 2,
              resource.RLIMIT_NOFILE: (64, 64), resource.RLIMIT_CORE: (0, 0), resource.RLIMIT_NPROC: (0, 0)}
    for which, (soft, hard) in limits.items():
        resource.setrlimit(which, (soft, hard))
    return True


# seccomp: (audit arch, syscall numbers) of the architectures the filter knows.
_ARCHES = {
    "x86_64": (0xC000003E, dict(fork=57, vfork=58, clone=56, clone3=435, execve=59, execveat=322, socket=41,
                                socketpair=53, ptrace=101, kill=62, tkill=200, tgkill=234, pidfd_open=434,
                                pidfd_send_signal=424)),
    "aarch64": (0xC00000B7, dict(clone=220, clone3=435, execve=221, execveat=281, socket=198, socketpair=199,
                                 ptrace=117, kill=129, tkill=130, tgkill=131, pidfd_open=434, pidfd_send_signal=424)),
}
_LD_W_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def _seccomp_program(arch: int, nr: dict, pid: int) -> list[tuple[int, int, int, int]]:
    deny = _ERRNO | errno.EPERM
    arg0 = 16  # offsetof(struct seccomp_data, args[0]), its low 32 bits (little-endian)
    prog = [(_LD_W_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, deny), (_LD_W_ABS, 0, 0, 0)]
    if arch == 0xC000003E:  # x32 syscalls would get past the numbers below
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, deny)]
    for name in ("fork", "vfork", "execve", "execveat", "socket", "ptrace", "tkill", "pidfd_open",
                 "pidfd_send_signal"):
        if name in nr:
            prog += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, deny)]
    prog += [(_JEQ, 0, 1, nr["clone3"]), (_RET, 0, 0, _ERRNO | errno.ENOSYS)]  # libc then falls back to clone
    # (syscall, test of its first argument that lets it pass)
    for name, test, value in (("clone", _JSET, CLONE_THREAD), ("socketpair", _JEQ, AF_UNIX),
                              ("kill", _JEQ, pid), ("tgkill", _JEQ, pid)):
        prog += [(_JEQ, 0, 4, nr[name]), (_LD_W_ABS, 0, 0, arg0), (test, 0, 1, value), (_RET, 0, 0, _ALLOW),
                 (_RET, 0, 0, deny)]
    return prog + [(_RET, 0, 0, _ALLOW)]


def _seccomp() -> bool:
    import platform

    if platform.machine() not in _ARCHES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {platform.machine()}")
    ctypes, libc = _libc()
    arch, nr = _ARCHES[platform.machine()]
    prog = _seccomp_program(arch, nr, os.getpid())

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(prog))(*[Insn(*i) for i in prog])
    fprog = Prog(len(prog), insns)
    _check(ctypes, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(ctypes, libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(SECCOMP)")
    return True


# ---------------------------------------------------------------------------------------------------- audit hook
_REFUSED = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.spawn", "os.exec", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill", "os.link", "os.symlink", "os.mkfifo", "os.mknod", "os.chroot",
    "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.getnameinfo",
})
_REFUSED_IMPORTS = frozenset({"ctypes", "_ctypes"})  # and _posixsubprocess: its fork_exec has no audit event
# event: (positions of its path arguments, positions of its dir_fd arguments)
_PATH_EVENTS = {
    "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)), "os.mkdir": ((0,), (2,)),
    "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()),
    "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()), "os.chflags": ((0,), ()), "shutil.rmtree": ((0,), (1,)),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _audit_hook(work: str, report: int, kernel_stops_forks: bool) -> None:
    # Everything the hook uses is bound now (default arguments), so that code which rebinds a module's or the
    # builtins' names changes nothing it sees; assigning the hook's __defaults__ is an audited event it refuses.
    import pathlib

    path_types = tuple(getattr(pathlib, n) for n in ("PurePath", "PurePosixPath", "Path", "PosixPath"))
    imports = _REFUSED_IMPORTS | (set() if kernel_stops_forks else {"_posixsubprocess"})  # asyncio imports it

    def hook(event, args, work=work, report=report, refused=_REFUSED, imports=frozenset(imports),
             paths=_PATH_EVENTS, write_flags=_WRITE_FLAGS, path_types=path_types, inside=_inside,
             relative_down=_relative_down, write=_write, error=Refused, own_file=__file__,
             isinstance=isinstance, type=type, any=any, len=len, getattr=getattr):
        what = None
        if event == "open" or event in paths:
            path_at, dir_fd_at = paths.get(event, ((0,), ()))
            given = [args[i] for i in path_at if not isinstance(args[i], int)]  # an int is an open descriptor
            if any(not isinstance(p, (str, bytes)) and type(p) not in path_types for p in given):
                what = f"{event} of a path that is not a str, bytes or pathlib path"  # its __fspath__ could lie
            elif event != "open" or args[1] is None or args[2] & write_flags:  # os.open: any (a dir_fd to be)
                outside = [p for p in given if not inside(p, work)]
                if outside:
                    verb = event if event != "open" else "os.open" if args[1] is None else "write"
                    what = f"{verb} outside the working folder: {outside[0]!r}"
                elif any(args[i] not in (None, -1) for i in dir_fd_at if i < len(args)) and not all(
                        relative_down(p) for p in given):  # dir fds come from os.open, inside the folder
                    what = f"{event} with dir_fd and a path that may leave its folder"
        elif event in refused or event.startswith("ctypes."):
            what = event
        elif event == "socket.__new__" and args[1] != AF_UNIX:
            what = f"socket of family {args[1]}"
        elif event == "import" and args[0] in imports:
            what = f"import {args[0]}"
        elif event == "object.__setattr__" and (args[0] in path_types or args[1] in (
                "__code__", "__defaults__", "__kwdefaults__") and getattr(getattr(args[0], "__code__", None),
                                                                          "co_filename", None) == own_file):
            what = f"setting {args[1]} of the sandbox's own code"
        if what is not None:
            write(report, "refused", event, what)
            raise error(f"sandbox refused {what} (audit hook)")

    sys.addaudithook(hook)


def _relative_down(path, fspath=os.fspath, fsdecode=os.fsdecode, isinstance=isinstance) -> bool:
    """Whether `path` is relative and never goes up ('..')."""
    raw = fspath(path)
    text = "" + (fsdecode(b"" + raw) if isinstance(raw, bytes) else raw)
    return not text.startswith("/") and ".." not in text.split("/")


def _inside(path, root: str, fspath=os.fspath, fsdecode=os.fsdecode, getcwd=os.getcwd, isinstance=isinstance) -> bool:
    """Whether `path` (made absolute, '..' resolved by its text: the hook refuses making links) is under root."""
    raw = fspath(path)
    text = "" + (fsdecode(b"" + raw) if isinstance(raw, bytes) else raw)  # exact str: no overridden methods
    if not text.startswith("/"):
        text = getcwd() + "/" + text
    parts: list = []
    for part in text.split("/"):
        if part == "..":
            parts[-1:] = []
        elif part not in ("", "."):
            parts.append(part)
    return ("/" + "/".join(parts) + "/").startswith(root.rstrip("/") + "/")


if __name__ == "__main__":
    main()
