"""How the code verifier starts each sample's process (rlhf/data/sandbox.py): a fork of a warm interpreter (the
fork server, default) or a fresh `python -I -S` (`reward.sandbox.fork_server: false`).

A fresh interpreter costs its start on every sample, more than a small program's whole run (2.4-4.4x the ms of
a forked sample with one process: benchmarks/sandbox_bench.py, docs/code_reward.md). The fork server is that
interpreter started once per concurrent slot of a reward worker (`processes` of them), importing beyond a fresh
one only `socket` and the launcher's own imports (resource, select, signal, traceback, types); for each sample it forks,
and the child becomes the run: its own session, the sample's directory as cwd and HOME, the sample's files as
fds 0-2, then the launcher, exactly as a fresh interpreter runs it. A child is a copy of the server: what a
program changes (modules, builtins, globals) dies with it, so samples cannot see each other.

The worker sends a request with the run's fds (SCM_RIGHTS over a socket pair); the server answers the child's
pid at once and its exit code when it ends. The worker enforces the deadline (killing the child's group and
session), as it does with a fresh process; the server also kills the child past a backstop deadline, and when
the worker goes away (its end of the socket closes), then exits. A server that breaks (a program killed it) is
replaced; the sample it ran scores 0.
"""

from __future__ import annotations

import atexit
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from rlhf.data.sandbox_box import Box

# Sets the limits inside the child, then runs the program as __main__ (no preexec_fn: the reward worker has
# threads, and a fork with threads must exec at once); compiled and exec'd in a fresh `__main__` module, not by
# runpy, whose lazy imports (pkgutil, typing) cost more than a small program's whole run.
# assert-style: the program and its tests run in the launcher; the run counts as finished only when the
# launcher gets past them and writes a nonce the program never sees (read from a pipe, closed before the program
# starts) to `done`: a program that exits early (`sys.exit(0)` before the asserts, `os._exit`) fails.
# stdin/stdout: one interpreter per sample and a fork per case (a case costs a fork, not a Python start): each
# child closes both pipes at once, takes in_<i> / out_<i> / err_<i> as fds 0-2 and runs the program; the
# launcher waits for it (killed past timeout_s), reports "<case> <exit code or ->" on the progress pipe, where
# the worker compares that case's output (the expected outputs never enter the sandbox) and kills the run at
# the first wrong one, and stops itself at the first case that fails or times out (with partial credit it runs
# every case, and the worker reads them all). It reads the nonce only after the last case and ends the progress
# with it. `sys.exit(0)` is a normal end of a case. A compiled program (argument 10 "bin", stdin/stdout only): each
# case's child execs ./main instead of running main.py.
LAUNCH = """\
import os, resource, sys, types
mem, cpu, size, fd, cases, progress = (int(v) for v in sys.argv[1:7])
mode, timeout, stop, binary = sys.argv[7], float(sys.argv[8]), sys.argv[9] == "1", sys.argv[10] == "bin"
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
def run(code):
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
source = b""
if not binary:
    with open("main.py", "rb") as f:
        source = f.read()
if mode == "asserts":
    nonce = os.read(fd, 64)
    os.close(fd)
    run(compile(source, "main.py", "exec"))
    sys.stdout.flush()
    with open("done", "wb") as f:
        f.write(nonce)
    sys.exit(0)
import select, signal, traceback
try:
    code = None if binary else compile(source, "main.py", "exec")  # once: each case's fork runs it
except BaseException:
    with open("err_0", "w") as f:
        traceback.print_exc(file=f)
    os.write(progress, b"0 1\\nend " + os.read(fd, 64) + b"\\n")
    sys.exit(0)
for i in range(cases):
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.close(fd)
            os.close(progress)
            for name, target, flags in ((f"in_{i}", 0, os.O_RDONLY), (f"out_{i}", 1, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                        (f"err_{i}", 2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                os.dup2(os.open(name, flags, 0o600), target)
            if binary:  # a compiled program (C++): the case child becomes it, under the same limits
                os.execv("./main", ["./main"])
            run(code)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (e.code is not None)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            status = status or 1
        os._exit(status)
    try:
        pfd = os.pidfd_open(pid)
        done_in_time = bool(select.select([pfd], [], [], timeout)[0])
        os.close(pfd)
    except (AttributeError, OSError):
        import time
        end = time.monotonic() + timeout
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None and time.monotonic() < end:
            time.sleep(0.001)
        done_in_time = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    if not done_in_time:
        os.kill(pid, signal.SIGKILL)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) if done_in_time else None
    os.write(progress, f"{i} {'-' if status is None else status}\\n".encode())
    if status != 0 and stop:
        break
os.write(progress, b"end " + os.read(fd, 64) + b"\\n")
"""

# The fork server. A request: the sample's directory, a backstop deadline (s), then the launcher's arguments with
# "R" and "P" where the nonce pipe's and the progress pipe's fd numbers go, NUL-separated; its fds: stdin, stdout,
# stderr, nonce pipe, progress pipe. Answers "<pid>\n" at once, "<exit code>\n" when the child ends. The child
# ends as an interpreter would: SystemExit's code, 1 and the traceback for an exception, then its threads joined,
# atexit handlers run and stdio flushed.
_SERVER = """\
import os, resource, select, signal, socket, sys, traceback, types  # the launcher's imports, made once
sock = socket.socket(fileno=int(sys.argv[1]))
launch = compile(sys.argv[2], "<launcher>", "exec")
boxed = len(sys.argv) > 3  # the box's code (rlhf/data/sandbox_box.py): this server goes into it, each run too
if boxed:
    exec(sys.argv[3])
base_env = dict(os.environ)
def child(d, args, fds):
    sock.close()
    os.setsid()
    os.chdir(d)
    os.environ.clear()
    os.environ.update(base_env, HOME=d, TMPDIR=d)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    sys.argv = ["-c", *(str(fds[3]) if a == "R" else str(fds[4]) if a == "P" else a for a in args)]
    code = 0
    try:
        exec(launch, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (e.code is not None)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 1
    os._exit(code & 0xFF)  # as the interpreter: sys.exit(-1) is 255
while True:
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 5)
    except OSError:
        break
    if not msg:
        break
    d, backstop, *args = msg.decode().split("\\0")
    pid = box_fork(d) if boxed else os.fork()  # boxed: the run is its PID namespace's init, sealed
    if pid == 0:
        child(d, args, fds)
    for fd in fds:
        os.close(fd)
    pfd = os.pidfd_open(pid)
    sock.sendall(f"{pid}\\n".encode())
    ready = select.select([pfd, sock], [], [], float(backstop))[0]
    if pfd not in ready:  # past the backstop, or the worker went away: its end of the socket closed
        os.kill(pid, signal.SIGKILL)  # boxed: its PID namespace dies with it
        for p in os.listdir("/proc") if os.path.isdir("/proc") else ():  # the session: children that left its group
            try:
                with open(f"/proc/{p}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[3]) == pid:
                        os.kill(int(p), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    os.close(pfd)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if sock in ready and pfd not in ready:
        break
    try:
        sock.sendall(f"{status}\\n".encode())
    except OSError:
        break
"""


def available() -> bool:
    """The fork server needs pidfds and fd passing (Linux >= 5.3, Python >= 3.9)."""
    return hasattr(os, "pidfd_open") and hasattr(socket, "send_fds") and sys.platform.startswith("linux")


def wait_pid(pid: int, timeout: float) -> bool:
    """Whether process `pid` (any, not only a child) ended within `timeout` seconds, woken by the exit itself."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def session_members(sid: int) -> list[int]:
    """Processes in session `sid` (from /proc; none where /proc is missing)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


def kill_group(pid: int) -> None:
    """Kill a run's process group and every process left in its session (a child that moved to a group of its
    own too; one that called setsid() escapes: hence containers for untrusted code)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for member in session_members(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ServerBroken(RuntimeError):
    """The fork server went away or answered nonsense (a program killed it): the sample fails, the server goes."""


class ForkServer:
    """One warm interpreter that forks a run per request, one request at a time; `box`: the box's code, run by the
    server before its first request (rlhf/data/sandbox_box.py), so each run is forked inside it."""

    def __init__(self, flags: tuple[str, ...], env: dict[str, str], box: str | None = None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen([sys.executable, *flags, "-c", _SERVER, str(theirs.fileno()), LAUNCH,
                                          *([box] if box else [])],
                                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.sock, self.buf = ours, b""

    def _line(self, timeout: float | None) -> str | None:
        """The next answer line; None when none came within `timeout`. ServerBroken when the server went away."""
        while b"\n" not in self.buf:
            if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
                return None
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ServerBroken("the fork server went away")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def start(self, d: str, backstop: float, args: list[str], fds: list[int]) -> int:
        """Fork a run in directory `d`; its pid."""
        try:
            socket.send_fds(self.sock, ["\0".join([d, str(backstop), *args]).encode()], fds)
            pid = self._line(30.0)
        except OSError as e:
            raise ServerBroken(f"the fork server went away ({e})") from None
        if pid is None or not pid.isdigit():
            raise ServerBroken(f"the fork server answered {pid!r}")
        return int(pid)

    def exit_code(self, timeout: float | None) -> int | None:
        """The run's exit code once it ended (None: not within `timeout`)."""
        line = self._line(timeout)
        if line is None:
            return None
        try:
            return int(line)
        except ValueError:
            raise ServerBroken(f"the fork server answered {line!r}") from None

    def close(self) -> None:
        self.sock.close()  # the server exits when its end closes
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()


_pools: dict[tuple, queue.SimpleQueue] = {}
_every: list[ForkServer] = []
_lock = threading.Lock()


def checkout(flags: tuple[str, ...], env: dict[str, str], box: str | None = None) -> ForkServer:
    """A free fork server for these interpreter flags, environment and box (started when none is free)."""
    key = (flags, tuple(sorted(env.items())), box)
    with _lock:
        pool = _pools.setdefault(key, queue.SimpleQueue())
    try:
        return pool.get_nowait()
    except queue.Empty:
        server = ForkServer(flags, env, box)
        with _lock:
            _every.append(server)
            server.key = key
        return server


def give_back(server: ForkServer, broken: bool) -> None:
    """Return a server after a run; a broken one is stopped, and the next checkout starts another."""
    with _lock:
        kept = not broken and server in _every  # close_all may have run meanwhile
        if kept:
            _pools.setdefault(server.key, queue.SimpleQueue()).put(server)
        elif server in _every:
            _every.remove(server)
    if not kept:
        server.close()


@atexit.register
def close_all() -> None:
    """Stop every fork server (at exit; tests call it to see that none is left)."""
    with _lock:
        servers, _every[:] = list(_every), []
        _pools.clear()
    for server in servers:
        server.close()


class Run:
    """A sample's launcher process: a fork of a warm server, or a fresh interpreter. `fds`: its stdin, stdout,
    stderr, the nonce pipe and the progress pipe (the caller closes its own copies after the start); `args`: the
    launcher's, "R" and "P" standing for the two pipes' fd numbers. `box`: where programs run in the box
    (sandbox_box.py); the pid is then the process that waits for the sample's PID namespace."""

    def __init__(self, flags: tuple[str, ...], env: dict[str, str], d: str, fds: list[int], args: list[str],
                 backstop: float, fork_server: bool, box: Box | None = None):
        self.server: ForkServer | None = None
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self.broken = False
        if fork_server and available():
            for attempt in range(2):  # a server broken while idle is replaced once
                self.server = checkout(flags, env, box.server_code if box else None)
                try:
                    self.pid = self.server.start(d, backstop, args, fds)
                    return
                except ServerBroken:
                    give_back(self.server, broken=True)
                    if attempt:
                        raise
        fresh = [str(fds[3]) if a == "R" else str(fds[4]) if a == "P" else a for a in args]
        code = (box.sample_code(d) if box else "") + LAUNCH
        self.proc = subprocess.Popen([sys.executable, *flags, "-c", code, *fresh], cwd=d,
                                     env={**env, "HOME": d, "TMPDIR": d}, stdin=fds[0], stdout=fds[1],
                                     stderr=fds[2], start_new_session=True, pass_fds=tuple(fds[3:]))
        self.pid = self.proc.pid

    def wait(self, timeout: float) -> None:
        """Until the launcher ends; subprocess.TimeoutExpired past `timeout` seconds."""
        if self.proc is not None:
            ended = wait_pid(self.pid, timeout) if hasattr(os, "pidfd_open") else self._popen_wait(timeout)
            if not ended:
                raise subprocess.TimeoutExpired("sandbox", timeout)
            return
        end = time.monotonic() + timeout
        try:
            self.code = self.server.exit_code(timeout)
        except ServerBroken:  # a program killed its server: the launcher may live on, an orphan
            self.broken = True
            if not wait_pid(self.pid, max(0.0, end - time.monotonic())):
                raise subprocess.TimeoutExpired("sandbox", timeout) from None
            return
        if self.code is None:
            raise subprocess.TimeoutExpired("sandbox", timeout)

    def _popen_wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def finish(self) -> int | None:
        """Kill what is left of the run (its group and session: on a timeout or a wrong case, and the children it
        started after it ended) and hand its server back; the launcher's exit code (None: unknown, its server
        broke)."""
        kill_group(self.pid)
        if self.proc is not None:
            self.proc.wait()
            return self.proc.returncode
        if self.code is None and not self.broken:
            try:
                self.code = self.server.exit_code(10.0)
            except ServerBroken:
                self.code = None
            self.broken = self.code is None
        give_back(self.server, self.broken)
        return self.code
