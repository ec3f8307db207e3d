"""The sandbox of the built-in ``python`` tool: model-written code runs isolated and limited.

``local`` backend, ``isolation=namespaces`` (the default): the snippet runs in fresh Linux
namespaces made by ``unshare`` (user, mount, pid, network, IPC, UTS), with a new root::

    /             tmpfs, read-only
    /usr /lib...  the host's, bound read-only (symlinks where the host has symlinks)
    <base_prefix> the interpreter's install tree, bound read-only (stdlib only: -I -S)
    /tmp          private tmpfs of max_file_mb MiB: the only writable place, the working dir
    /proc         the new pid namespace's, read-only
    /dev          null, zero, urandom

No network (an empty network namespace), no view of the host's other files or processes,
no capabilities (``setpriv``: no-new-privs, empty bounding set), no nested user namespaces
(``user.max_user_namespaces=0`` inside), and rlimits on CPU time, address space, processes
(counted inside the user namespace), file size and core files.  The process tree is::

    unshare (host) -> pid 1: bootstrap (waits, reaps, reports) -> the snippet (limits set)

The snippet is never pid 1, so the signals of its limits (SIGXCPU) act on it normally;
pid 1 writes its wait status to a pipe of its own, and when pid 1 exits the kernel kills
everything left in the namespace.  ``isolation=none`` runs the same bootstrap as a plain
child process (own session): limits only, no isolation.

``sandbox_fusion`` backend: the code is sent to a SandboxFusion service (``POST /run_code``).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace

from rlhf.config_run import SandboxConfig

KILLED_REASONS = ("wall_time", "cpu_time", "memory", "output", "processes", "file_size")
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# Seconds the pipes may stay open after the snippet's process exited (isolation=none: a
# descendant that left the process group); then they are abandoned.
DRAIN_S = 0.5


class SandboxUnavailable(RuntimeError):
    """Isolation was asked for and cannot be set up on this host."""


@dataclass
class SandboxResult:
    """What a snippet did."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The snippet's exit status; ``-N`` when signal N ended it; None when the sandbox
    killed it (``killed``) or it never reported."""
    timed_out: bool
    """A time limit (wall or CPU) ended it."""
    killed: str | None
    """Which limit ended it (one of :data:`KILLED_REASONS`, where it can be told); None when
    it ended by itself."""

    def to_dict(self) -> dict:
        return asdict(self)


# pid 1 of the sandbox (or the child of isolation=none): read the code from stdin, write it to
# the working dir, run it as a child with the limits, report the child's wait status and CPU
# seconds on the status fd.  Runs under -I -S: stdlib only.
BOOTSTRAP = r"""
import os, resource, sys
workdir, status_fd = sys.argv[1], int(sys.argv[2])
cpu, mem, nproc, fsize = (int(a) for a in sys.argv[3:7])
code = sys.stdin.buffer.read()
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
path = os.path.join(workdir, "snippet.py")
with open(path, "wb") as f:
    f.write(code)
child = os.fork()
if child == 0:
    os.close(status_fd)
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                            (resource.RLIMIT_NPROC, nproc, nproc),
                            (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))
    os.execv(sys.executable, [sys.executable, "-I", "-S", path])
while True:
    pid, status, usage = os.wait4(-1, 0)
    if pid == child:
        break
os.write(status_fd, f"{status} {usage.ru_utime + usage.ru_stime}".encode())
"""

# Run by `sh -c` as root of the new user namespace, before the bootstrap: builds the new root
# over /tmp (private to this mount namespace), pivots into it and drops every privilege.
# Arguments: base_prefix, python, /tmp size in MiB, setpriv's uid options, then the bootstrap
# and its arguments.
SETUP = r"""
set -eu
prefix=$1; python=$2; tmp_mb=$3; ids=$4; shift 4
R=/tmp
mount -t tmpfs -o size=1m,mode=755 sandbox-root $R
for d in usr lib lib64 bin sbin; do
  if [ -L /$d ]; then ln -s "$(readlink /$d)" $R/$d
  elif [ -d /$d ]; then
    mkdir $R/$d; mount --bind /$d $R/$d; mount -o remount,bind,ro,nosuid,nodev $R/$d
  fi
done
mkdir -p "$R$prefix" $R/tmp $R/proc $R/dev $R/old
mount --bind "$prefix" "$R$prefix"; mount -o remount,bind,ro,nosuid,nodev "$R$prefix"
mount -t tmpfs -o "size=${tmp_mb}m,mode=1777,nosuid,nodev" sandbox-tmp $R/tmp
mount -t proc -o nosuid,nodev,noexec proc $R/proc
echo 0 > $R/proc/sys/user/max_user_namespaces
mount -o remount,bind,ro $R/proc
for f in null zero urandom; do touch $R/dev/$f; mount --bind /dev/$f $R/dev/$f; done
cd $R; pivot_root . old; umount -l /old; rmdir /old
mount -o remount,bind,ro /
cd /tmp
export PATH=/usr/bin:/bin HOME=/tmp
exec setpriv $ids --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- \
  "$python" -I -S -c "$@"
"""
UNSHARE = ("unshare", "--user", "--net", "--pid", "--fork", "--mount", "--ipc", "--uts",
           "--kill-child")
# Run by the host's root, the namespace's root is the host's root too (it builds the new root:
# it must reach base_prefix wherever that is), and the snippet runs as nobody, 65534 inside
# and outside: the kernel exempts the host's uid 0 from RLIMIT_NPROC, and nothing root-owned
# that stays visible is writable by its mode bits.  pid 1 (the bootstrap) is nobody too and
# counts towards the snippet's RLIMIT_NPROC.
AS_ROOT = (("--map-user=0", "--map-group=0", "--map-users=65534,65534,1",
            "--map-groups=65534,65534,1"), "--reuid=65534 --regid=65534 --clear-groups", 1)
# Run by another user, everything runs as that user, root of the namespace; unshare counts
# towards RLIMIT_NPROC too.
AS_USER = (("--map-root-user",), "", 2)
# unshare maps more than its caller's uid with shadow-utils' newuidmap and newgidmap; the
# host's root writes the maps itself with these stand-ins (`NAME pid inner outer count ...`).
IDMAP_HELPER = """#!/bin/sh
pid=$1; shift; map=""
while [ $# -ge 3 ]; do map="$map$1 $2 $3
"; shift 3; done
printf '%s' "$map" > /proc/$pid/{kind}_map
"""


@functools.cache
def _idmap_helpers() -> str:
    """A private directory holding the ``newuidmap``/``newgidmap`` stand-ins (removed at
    exit)."""
    path = tempfile.mkdtemp(prefix="rlhf-sandbox-idmap-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    for kind in ("uid", "gid"):
        helper = os.path.join(path, f"new{kind}map")
        with open(helper, "w") as f:
            f.write(IDMAP_HELPER.replace("{kind}", kind))
        os.chmod(helper, 0o700)
    return path


def _python_binary() -> str | None:
    """The interpreter of ``sys.base_prefix`` (the snippet gets the stdlib only)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for name in (f"python{version}", "python3"):
        path = os.path.join(sys.base_prefix, "bin", name)
        if os.access(path, os.X_OK):
            return path
    return None


def _limit_args(cfg: SandboxConfig, extra_processes: int) -> list[str]:
    mib = 1 << 20
    return [str(max(1, math.ceil(cfg.cpu_time_s))), str(int(cfg.memory_mb * mib)),
            str(int(cfg.max_processes) + extra_processes), str(int(cfg.max_file_mb * mib))]


def _namespace_command(cfg: SandboxConfig, python: str, status_fd: int) -> list[str]:
    maps, ids, extra_processes = AS_ROOT if os.geteuid() == 0 else AS_USER
    tmp_mb = str(max(1, math.ceil(cfg.max_file_mb)))
    return [*UNSHARE, *maps, "sh", "-c", SETUP, "sh", sys.base_prefix, python, tmp_mb, ids,
            BOOTSTRAP, "/tmp", str(status_fd), *_limit_args(cfg, extra_processes)]


def _plain_command(cfg: SandboxConfig, python: str, status_fd: int, workdir: str) -> list[str]:
    return [python, "-I", "-S", "-c", BOOTSTRAP, workdir, str(status_fd),
            *_limit_args(cfg, 0)]


@functools.cache
def isolation_problem() -> str | None:
    """None when the namespace sandbox works on this host, else one line naming what is
    missing (cached: the answer is the host's)."""
    for tool in ("unshare", "setpriv", "mount", "umount", "pivot_root"):
        if shutil.which(tool, path=HOST_PATH) is None:
            return f"{tool} not found (util-linux)"
    if _python_binary() is None:
        return f"no python interpreter under sys.base_prefix={sys.base_prefix}"
    if os.geteuid() != 0 and _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        return ("unprivileged user namespaces are disabled "
                "(kernel.unprivileged_userns_clone=0)")
    if _read_int("/proc/sys/user/max_user_namespaces") == 0:
        return "user namespaces are disabled (user.max_user_namespaces=0)"
    trial = _run_local("print('ok')", SandboxConfig(), isolate=True)
    if trial.exit_code == 0 and trial.stdout == "ok\n":
        return None
    lines = [line for line in trial.stderr.splitlines() if line.strip()]
    return ("a trial sandbox failed: " + (lines[-1] if lines else
            f"exit code {trial.exit_code}, killed={trial.killed}"))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


@functools.cache
def _warn_no_isolation() -> None:
    print("rlhf.tools.sandbox: WARNING: rollout.sandbox.isolation=none: model-written code "
          "runs as a plain child process of this user, with rlimits only: it can read and "
          "write this user's files, reach the network and signal this user's processes "
          "(and run as root, its process limit does not hold)", file=sys.stderr)


def run_python(code: str, cfg: SandboxConfig) -> SandboxResult:
    """Run a Python snippet in the sandbox that ``cfg`` describes.

    Args:
        code: the snippet's source.
        cfg: backend, isolation and limits (``rollout.sandbox``).

    Returns:
        What the snippet printed, its exit status and which limit ended it, if one did.

    Raises:
        SandboxUnavailable: ``isolation=namespaces`` and the host cannot set it up.
    """
    if cfg.backend == "sandbox_fusion":
        return run_sandbox_fusion(code, cfg)
    if cfg.isolation == "none":
        _warn_no_isolation()
        return _run_local(code, cfg, isolate=False)
    problem = isolation_problem()
    if problem is not None:
        raise SandboxUnavailable(f"{problem}; set rollout.sandbox.isolation=none to run "
                                 "without isolation")
    return _run_local(code, cfg, isolate=True)


def _run_local(code: str, cfg: SandboxConfig, isolate: bool) -> SandboxResult:
    python = _python_binary()
    if python is None:
        raise SandboxUnavailable(f"no python interpreter under sys.base_prefix="
                                 f"{sys.base_prefix}")
    status_r, status_w = os.pipe()
    try:
        with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-") as workdir:
            cmd = (_namespace_command(cfg, python, status_w) if isolate else
                   _plain_command(cfg, python, status_w, workdir))
            root = isolate and os.geteuid() == 0
            env = {"PATH": f"{_idmap_helpers()}:{HOST_PATH}" if root else HOST_PATH,
                   "LANG": "C.UTF-8", "HOME": workdir}
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(status_w,), start_new_session=True)
            finally:
                os.close(status_w)
            threading.Thread(target=_feed, args=(proc.stdin, code.encode()), daemon=True).start()
            try:
                out, err, killed = _collect(proc, cfg)
            finally:
                _kill_group(proc.pid)
                proc.wait()
                proc.stdout.close()
                proc.stderr.close()
            status = _read_status(status_r)
    finally:
        os.close(status_r)
    return _result(out, err, killed, status, proc.returncode, cfg)


def _feed(pipe, data: bytes) -> None:
    """Write the snippet to the sandbox's stdin (from a thread: the sandbox may read it late,
    or never)."""
    try:
        pipe.write(data)
    except OSError:  # the sandbox ended before it read its code
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its pid, the group's id, stays ours)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _collect(proc: subprocess.Popen, cfg: SandboxConfig) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr together until both close, keeping ``max_output_bytes`` + 1 of
    each; stop at the wall time or when a stream overflows (the caller then kills the
    process group).

    Returns:
        (stdout, stderr, the limit that made the sandbox kill it or None)
    """
    limit = cfg.max_output_bytes
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    deadline = time.monotonic() + cfg.wall_time_s
    killed, ended = None, False
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and killed is None:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = None if ended else "wall_time"
                break
            for key, _ in sel.select(min(left, 0.05)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += chunk[:limit + 1 - len(buf)]
                if len(buf) > limit:
                    killed = "output"
            if not ended and _exited(proc.pid):
                ended = True  # kill what it left in its group, then drain the pipes briefly
                _kill_group(proc.pid)
                deadline = min(deadline, time.monotonic() + DRAIN_S)
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), killed


def _read_status(fd: int) -> tuple[int, float] | None:
    """The bootstrap's report: the snippet's wait status and CPU seconds (None: no report)."""
    os.set_blocking(fd, False)
    try:
        text = os.read(fd, 256).decode()
    except BlockingIOError:
        return None
    try:
        status, cpu = text.split()
        return int(status), float(cpu)
    except ValueError:
        return None


def _decode(data: bytes, limit: int) -> str:
    text = data[:limit].decode(errors="replace")
    if len(data) > limit:
        text += f"\n[output cut: more than {limit} bytes]"
    return text


def _result(out: bytes, err: bytes, killed: str | None, status: tuple[int, float] | None,
            returncode: int, cfg: SandboxConfig) -> SandboxResult:
    stdout, stderr = _decode(out, cfg.max_output_bytes), _decode(err, cfg.max_output_bytes)
    exit_code = None
    if killed is None and status is not None:
        wait_status, cpu_s = status
        exit_code = os.waitstatus_to_exitcode(wait_status)
        killed = _limit_reached(exit_code, cpu_s, stderr, cfg)
    elif killed is None:
        exit_code = returncode  # the sandbox itself failed before the snippet ran
    return SandboxResult(stdout, stderr, exit_code, killed in ("wall_time", "cpu_time"), killed)


# The last line of a traceback that a limit causes.
LIMIT_ERRORS = (("MemoryError", "memory"), ("OSError: [Errno 27]", "file_size"),
                ("OSError: [Errno 28]", "file_size"), ("BlockingIOError: [Errno 11]", "processes"),
                ("RuntimeError: can't start new thread", "processes"))

_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception)\b")


def _limit_reached(exit_code: int, cpu_s: float, stderr: str, cfg: SandboxConfig) -> str | None:
    """Which limit ended a snippet that exited by itself, told from its status and stderr."""
    # SIGXCPU at the soft limit; SIGKILL at the hard one (one second on) if it ignored that
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and
                                        cpu_s >= math.ceil(cfg.cpu_time_s)):
        return "cpu_time"
    if exit_code == -signal.SIGXFSZ:
        return "file_size"
    if exit_code == 0:
        return None
    # the last exception line: tracebacks of several processes may interleave their lines
    errors = [line for line in stderr.splitlines() if _EXCEPTION_LINE.match(line)]
    last = errors[-1] if errors else ""
    return next((why for prefix, why in LIMIT_ERRORS if last.startswith(prefix)), None)


def run_sandbox_fusion(code: str, cfg: SandboxConfig) -> SandboxResult:
    """Run a snippet on a SandboxFusion service (``POST {url}/run_code``).  A service that
    cannot be reached, or a reply that cannot be read, is a result with the error in
    ``stderr`` and no exit code, never an exception."""
    request = {"code": code, "language": "python", "run_timeout": cfg.wall_time_s,
               "memory_limit_MB": cfg.memory_mb}
    url = cfg.url.rstrip("/") + "/run_code"
    req = urllib.request.Request(url, data=json.dumps(request).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=cfg.wall_time_s + 30) as reply:
            body = json.loads(reply.read().decode(errors="replace"))
    except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, bad JSON
        return SandboxResult("", f"sandbox_fusion at {url}: {type(e).__name__}: {e}",
                             None, False, None)
    return _fusion_result(body, cfg)


def _fusion_result(body: dict, cfg: SandboxConfig) -> SandboxResult:
    run = body.get("run_result") if isinstance(body, dict) else None
    if not isinstance(run, dict):
        status = body.get("status") if isinstance(body, dict) else None
        message = body.get("message") if isinstance(body, dict) else body
        return SandboxResult("", f"sandbox_fusion: status={status}: {message}", None, False,
                             None)
    timed_out = run.get("status") == "TimeLimitExceeded"
    limit = cfg.max_output_bytes
    return SandboxResult(_decode(str(run.get("stdout") or "").encode(), limit),
                         _decode(str(run.get("stderr") or "").encode(), limit),
                         run.get("return_code"), timed_out, "wall_time" if timed_out else None)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlhf.tools.sandbox",
                                description="Run a Python file in the sandbox of the built-in "
                                            "python tool; print one JSON object.")
    p.add_argument("file")
    for name, kind in (("wall_time_s", float), ("cpu_time_s", float), ("memory_mb", int),
                       ("max_processes", int), ("max_output_bytes", int),
                       ("max_file_mb", int)):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind)
    p.add_argument("--isolation", choices=("namespaces", "none"))
    p.add_argument("--backend", choices=("local", "sandbox_fusion"))
    p.add_argument("--url")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k != "file" and v is not None}
    try:
        cfg = replace(SandboxConfig(), **given)
        with open(args.file, encoding="utf-8", errors="replace") as f:
            code = f.read()
        result = run_python(code, cfg)
    except (OSError, ValueError, SandboxUnavailable) as e:
        print(f"rlhf.tools.sandbox: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
