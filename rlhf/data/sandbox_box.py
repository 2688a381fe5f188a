"""The code verifier's box (`reward.sandbox.isolation: kernel`, the default): the kernel's namespaces and a
seccomp filter around every program it runs (rlhf/data/sandbox.py), built from the standard library alone (no
daemon, no image, no setuid helper), so the fork server builds it once and forks each sample inside it.

    the box            (once per fork server, fresh interpreter or compile: `box_enter`)
      user namespace   the worker's uid and gid mapped to BOX_UID inside, nothing else: no other user's files
                       are writable, no host capability is held
      mount namespace  a new root holding only the interpreter, the compiler and their libraries read-only
                       (`ro`), the worker's scratch directory read-only (`scratch`), and /dev's null, zero,
                       random and urandom; no /proc, no /tmp, no home, none of the run's outputs
      network          a namespace of its own, its loopback down: no connection leaves, none comes in
      IPC, UTS         namespaces of their own (no shared System V memory or semaphores)
    each sample        (`box_fork`)
      PID namespace    the program is its init: it sees and signals only its own children, and everything it
                       started dies with it (its parent's death kills it too)
      its directory    bound read-write over its read-only place in the scratch directory, its cwd
      sealed           every capability dropped (the bounding and ambient sets too), no new privileges (a
                       setuid binary gains nothing), and a seccomp filter: a call that would leave the box
                       (mount, namespaces, ptrace, bpf, modules, kexec, io_uring, keyrings, a socket other
                       than AF_UNIX, ...) kills the program with SIGSYS, which the verifier reports as
                       `blocked`

The rlimits (memory, CPU, file size, no core) are the launcher's, as without the box. BOX is the box's code as a
string: the fork server, a fresh interpreter and the compile wrapper run it before anything else (they run
`python -I -S -c`, importing nothing of ours); this module uses the same text to probe the kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from rlhf.leftovers import remove_dead_process_dirs

BOX_UID = 1000  # the worker's uid and gid inside the box
BLOCKED_SIGNAL = 31  # SIGSYS: the seccomp filter killed the program

# x86_64 system calls that would leave the box or reach past it, killed (SIGSYS); the filter's table is this
# architecture's (`box_problem` refuses the others). Numbers from the kernel's arch/x86/entry/syscalls/syscall_64.tbl.
X86_64_DENIED = {
    "ptrace": 101, "syslog": 103, "personality": 135, "vhangup": 153, "pivot_root": 155, "adjtimex": 159,
    "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168,
    "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "pidfd_getfd": 438, "mount_setattr": 442,
}
X86_64_SOCKET, X86_64_CLONE, X86_64_CLONE3 = 41, 56, 435

BOX = r'''
import ctypes as _ct, os as _os, struct as _st
_libc = _ct.CDLL(None, use_errno=True)
_libc.mount.argtypes = (_ct.c_char_p, _ct.c_char_p, _ct.c_char_p, _ct.c_ulong, _ct.c_char_p)
_libc.umount2.argtypes = (_ct.c_char_p, _ct.c_int)
_libc.prctl.argtypes = (_ct.c_int, _ct.c_ulong, _ct.c_ulong, _ct.c_ulong, _ct.c_ulong)
_libc.syscall.restype = _ct.c_long
_syscall = _ct.pythonapi.syscall  # through the Python API's handle: the GIL stays held, as os.fork holds it
_syscall.restype = _ct.c_long
_syscall.argtypes = (_ct.c_long,) * 6
_before_fork, _after_fork_parent, _after_fork_child = (
    _ct.pythonapi.PyOS_BeforeFork, _ct.pythonapi.PyOS_AfterFork_Parent, _ct.pythonapi.PyOS_AfterFork_Child)
_NEWNS, _NEWUTS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
_NEWCGROUP = 0x2000000
_RDONLY, _NOSUID, _NODEV, _REMOUNT, _BIND, _REC, _PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

def _ok(r, what):
    if r != 0:
        e = _ct.get_errno()
        raise OSError(e, "sandbox box: %s: %s" % (what, _os.strerror(e)))

def _mount(src, dst, fs, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _ok(_libc.mount(enc(src), enc(dst), enc(fs), flags, enc(data)), "mount %s" % dst)

def _place(root, path, bind_flags, nodev=_NODEV):
    """Host `path` at the same path under `root`: bound (a directory or a file), or the same symlink."""
    target = root + path
    _os.makedirs(_os.path.dirname(target), exist_ok=True)
    if _os.path.islink(path):
        _os.symlink(_os.readlink(path), target)
        return
    if _os.path.isdir(path):
        _os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    _mount(path, target, None, _BIND | _REC)
    _mount(None, target, None, _BIND | _REMOUNT | _NOSUID | nodev | bind_flags)

def box_enter(root, ro, scratch, uid_inside):
    uid, gid = _os.getuid(), _os.getgid()
    _ok(_libc.unshare(_NEWUSER | _NEWNS | _NEWNET | _NEWIPC | _NEWUTS), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid_inside, uid)),
                       ("gid_map", "%d %d 1" % (uid_inside, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
    _mount(None, "/", None, _REC | _PRIVATE)
    _mount("tmpfs", root, "tmpfs", _NOSUID | _NODEV, "size=1m,mode=755")
    for path in ro:
        if _os.path.lexists(path):
            _place(root, path, _RDONLY)
    if scratch:
        _place(root, scratch, _RDONLY)
    _os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("null", "zero", "random", "urandom"):
        _place(root, "/dev/" + dev, 0, 0)
    _prepare_seal()
    _os.makedirs(root + "/.old", exist_ok=True)
    _ok(_libc.syscall(155 if _os.uname().machine == "x86_64" else 41, root.encode(), (root + "/.old").encode()),
        "pivot_root")
    _os.chdir("/")
    _ok(_libc.umount2(b"/.old", 2), "umount the old root")
    _os.rmdir("/.old")
    _mount(None, "/", None, _BIND | _REMOUNT | _RDONLY | _NOSUID | _NODEV)

def box_fork(d):
    """os.fork() into a new PID and mount namespace (one clone: the parent stays where it is): in the child, its
    namespace's init, `d` is bound read-write and the cwd and the process is sealed, and this returns 0; in the
    parent, the child's pid. The child dies with its parent (the server's backstop kills it)."""
    _before_fork()
    pid = _syscall(56, _NEWNS | _NEWPID | 17, 0, 0, 0, 0)  # clone(flags | SIGCHLD), no new stack: a fork
    if pid == 0:
        _after_fork_child()
        _libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL
        _mount(d, d, None, _BIND)
        _mount(None, d, None, _BIND | _REMOUNT | _NOSUID | _NODEV)
        _os.chdir(d)
        _seal()
        return 0
    _after_fork_parent()
    if pid < 0:
        raise OSError(_ct.get_errno(), "sandbox box: clone a PID namespace")
    return pid

def box_sample(d):
    """In a process of its own (a fresh interpreter, a compile), leading a session: `box_fork`, and this process
    waits for the child and exits with its status (128 + the signal that killed it); returns in the child."""
    pid = box_fork(d)
    if pid:
        _os.closerange(3, 256)  # the run's pipes end when the child ends
        status = _os.waitpid(pid, 0)[1]
        _os._exit(_os.WEXITSTATUS(status) if _os.WIFEXITED(status) else 128 + _os.WTERMSIG(status))

def _prepare_seal():
    """What sealing needs, made once before the root changes: the kernel's last capability and the filter."""
    global _LAST_CAP, _FPROG, _PROG
    with open("/proc/sys/kernel/cap_last_cap") as f:
        _LAST_CAP = int(f.read())
    _PROG = _ct.create_string_buffer(_st.pack("HBBI" * len(_FILTER), *[v for ins in _FILTER for v in ins]))
    _FPROG = _ct.create_string_buffer(_st.pack("HxxxxxxP", len(_FILTER), _ct.addressof(_PROG)))

def _seal():
    for cap in range(_LAST_CAP + 1):  # PR_CAPBSET_DROP every capability
        _libc.prctl(24, cap, 0, 0, 0)
    _libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    header = _ct.create_string_buffer(_st.pack("Ii", 0x20080522, 0))
    data = _ct.create_string_buffer(24)
    _ok(_libc.syscall(126, header, data), "capset")  # no effective, permitted or inheritable capability
    _ok(_libc.prctl(38, 1, 0, 0, 0), "no new privileges")
    _ok(_libc.prctl(22, 2, _ct.addressof(_FPROG), 0, 0), "seccomp filter")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
'''


def seccomp_filter() -> list[tuple[int, int, int, int]]:
    """The x86_64 filter as BPF instructions (code, jt, jf, k): another architecture's call, an x32 call, a denied
    call, a socket other than AF_UNIX and a clone making a namespace are killed (SIGSYS); clone3 answers ENOSYS
    (its flags are behind a pointer the filter cannot read; the C library falls back to clone); the rest pass."""
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    kill, allow, enosys = 0x80000000, 0x7FFF0000, 0x00050000 | 38
    ns_flags = 0x20000 | 0x2000000 | 0x4000000 | 0x8000000 | 0x10000000 | 0x20000000 | 0x40000000
    denied = sorted(X86_64_DENIED.values())
    # layout: [arch check][nr load][x32][denied...][clone3][socket][clone][allow][kill][enosys][socket args][clone args]
    prog: list[tuple[int, int, int, int]] = [(ld_abs, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, kill),
                                             (ld_abs, 0, 0, 0)]
    n = len(denied)
    body = 1 + n + 3  # x32, denied, clone3, socket, clone
    allow_at = len(prog) + body  # index of `ret allow`
    kill_at, enosys_at = allow_at + 1, allow_at + 2
    sock_at, clone_at = allow_at + 3, allow_at + 7  # each: a load, a test, then its two returns

    def jump(i: int, target: int) -> int:
        return target - i - 1

    i = len(prog)
    prog.append((jge, jump(i, kill_at), 0, 0x40000000))
    for nr in denied:
        i = len(prog)
        prog.append((jeq, jump(i, kill_at), 0, nr))
    i = len(prog)
    prog.append((jeq, jump(i, enosys_at), 0, X86_64_CLONE3))
    i = len(prog)
    prog.append((jeq, jump(i, sock_at), 0, X86_64_SOCKET))
    i = len(prog)
    prog.append((jeq, jump(i, clone_at), 0, X86_64_CLONE))
    assert len(prog) == allow_at
    prog += [(ret, 0, 0, allow), (ret, 0, 0, kill), (ret, 0, 0, enosys)]
    # socket(domain, ...): AF_UNIX (1) only (BPF jumps forward only: each check ends in its own returns)
    assert len(prog) == sock_at
    prog += [(ld_abs, 0, 0, 16), (jeq, 0, 1, 1), (ret, 0, 0, allow), (ret, 0, 0, kill)]
    # clone(flags, ...): no namespace flag
    assert len(prog) == clone_at
    prog += [(ld_abs, 0, 0, 16), (jset, 0, 1, ns_flags), (ret, 0, 0, kill), (ret, 0, 0, allow)]
    for j, (code, jt, jf, _) in enumerate(prog):
        assert 0 <= jt < 256 and 0 <= jf < 256, (j, code, jt, jf)
    return prog


@functools.lru_cache(maxsize=1)
def box_code() -> str:
    """BOX with its filter, ready to run in a boxed process."""
    return BOX + f"\n_FILTER = {seccomp_filter()!r}\n"


def read_only_paths(site_packages: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """What a boxed program may read: the system's programs and libraries, the interpreter's prefix (and the
    virtual environment's, with site packages), `extra` (a precompiled-header directory)."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/alternatives",
             sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    if site_packages:
        paths.append(sys.prefix)
    paths = [p for p in dict.fromkeys([*paths, *extra]) if p and p != "/"]
    return [p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)]  # not inside another


ROOT_PREFIX, WORK_PREFIX = "rlhf-boxroot-", "rlhf-boxwork-"  # + the pid of the worker that made them


def remove_dead_dirs() -> list[str]:
    """The box directories of workers that are gone (killed before their exit)."""
    base = tempfile.gettempdir()
    return remove_dead_process_dirs(base, ROOT_PREFIX) + remove_dead_process_dirs(base, WORK_PREFIX)


_scratch_lock = threading.Lock()
_scratch: tuple[str, str] | None = None


def scratch() -> tuple[str, str]:
    """This worker's (box mountpoint, scratch directory): the empty directory every box's root is mounted on (in
    its own mount namespace), and the directory the samples' directories are made in, read-only in the box and
    not listable (mode 0311: the worker makes directories in it, a program cannot see its neighbours). Made once
    per process (under a lock: a reward worker's threads ask at once), removed at exit or by `release`; those of a
    worker killed before either, by the next one (`remove_dead_dirs`)."""
    global _scratch
    with _scratch_lock:
        if _scratch is None:
            remove_dead_dirs()
            root = tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-")
            d = tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-")
            os.chmod(d, 0o311)
            _scratch = (root, d)
            atexit.register(release)
        return _scratch


def release() -> None:
    """This worker's box directories removed now (a Ray actor is killed without running its exit handlers); a
    later box makes new ones."""
    global _scratch
    with _scratch_lock:
        made, _scratch = _scratch, None
        Box.for_worker.cache_clear()
    if made is not None:
        atexit.unregister(release)
        root, d = made
        with contextlib.suppress(OSError):
            os.chmod(d, 0o700)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Box:
    """Where a worker's boxes are built: the mountpoint of their roots, the scratch directory the samples'
    directories are made in, and what a program may read."""

    root: str
    scratch: str
    ro: tuple[str, ...]

    @staticmethod
    @functools.lru_cache(maxsize=8)  # asked for by every sample: one per worker and setting
    def for_worker(site_packages: bool, extra: tuple[str, ...] = ()) -> "Box":
        root, d = scratch()
        return Box(root, d, tuple(read_only_paths(site_packages, extra)))

    @functools.cached_property  # the key a sample's fork server is found by: made once per Box
    def server_code(self) -> str:
        """Python that puts the process running it (a fork server) into the box."""
        return box_code() + f"box_enter({self.root!r}, {list(self.ro)!r}, {self.scratch!r}, {BOX_UID})\n"

    def sample_code(self, d: str) -> str:
        """Python that puts the process running it into the box and forks sample directory `d`'s PID namespace,
        sealed: put before a fresh interpreter's launcher or the compile wrapper."""
        return self.server_code + f"box_sample({d!r})\n"


@functools.lru_cache(maxsize=1)
def box_problem() -> str | None:
    """Why this machine cannot box programs (None: it can), found by boxing a probe process: the kernel's user,
    mount, PID and network namespaces for this user, and the seccomp filter's architecture."""
    if platform.system() != "Linux":
        return f"the box needs Linux namespaces; this is {platform.system()}"
    if platform.machine() != "x86_64":
        return (f"the box's seccomp filter has the x86_64 system call table; this machine is {platform.machine()} "
                "(rlhf/data/sandbox_box.py: add its table)")
    root, d = scratch()
    sample = tempfile.mkdtemp(dir=d)
    try:
        code = Box(root, d, tuple(read_only_paths(False))).sample_code(sample) + "open('ok', 'w').write('ok')\n"
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0 or not os.path.exists(os.path.join(sample, "ok")):
            said = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            return (f"the kernel refused the box ({said}); unprivileged user namespaces may be off "
                    "(sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, or a container's seccomp "
                    "profile)")
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"the box's probe failed: {e}"
    finally:
        shutil.rmtree(sample, ignore_errors=True)


def isolation_problem(cfg) -> str | None:
    """Why `reward.sandbox` (a `SandboxConfig`) cannot be had on this machine, saying what to change (None: it
    can): `isolation: kernel` where the kernel cannot make the box."""
    if cfg.isolation.value != "kernel":
        return None
    problem = box_problem()
    return None if problem is None else (
        f"reward.sandbox.isolation=kernel: {problem}. Enable the kernel feature, or set "
        "reward.sandbox.isolation=process to run the policy's programs without the box (they can then read what the "
        "reward worker's user can, and reach the network: docs/security.md)")
