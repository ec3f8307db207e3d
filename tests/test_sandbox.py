"""Escapes from the sandbox of the built-in ``python`` tool (:mod:`rlhf.tools.sandbox`): each
must be contained and reported, and leave the host as it was.

The namespace tests fail (they do not skip) where the sandbox cannot be set up: CI runs on
hosts where it can, and a run there would refuse to start.
"""

from __future__ import annotations

import errno
import http.server
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf.config_run import SandboxConfig
from rlhf.tools import sandbox
from rlhf.tools.sandbox import SandboxResult, SandboxUnavailable, run_python

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxConfig(wall_time_s=5, cpu_time_s=1, memory_mb=256, max_processes=8,
                       max_output_bytes=4096, max_file_mb=4)
PLAIN = replace(LIMITS, isolation="none")


def run(code: str, **changes) -> SandboxResult:
    """Run ``code`` in the namespace sandbox with small limits (``changes`` on top)."""
    problem = sandbox.isolation_problem()
    if problem is not None:
        pytest.fail(f"the namespace sandbox cannot be set up on this host: {problem}")
    return run_python(textwrap.dedent(code), replace(LIMITS, **changes))


def run_json(code: str, **changes) -> dict:
    result = run(code, **changes)
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


def processes_in_pid_namespace(link: str) -> list[int]:
    """Host pids whose pid namespace is ``link`` (``pid:[inode]``)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == link:
                pids.append(int(entry))
        except OSError:  # the process ended meanwhile
            pass
    return pids


# ---- ordinary snippets -------------------------------------------------------------------

def test_normal_snippet_prints_and_exits_0():
    result = run("import os\nprint(sum(range(10)), os.getcwd())")
    assert result == SandboxResult(f"{sum(range(10))} /tmp\n", "", 0, False, None)


def test_raising_snippet_exits_1_with_its_traceback():
    result = run("def f():\n    return 1 / 0\nf()")
    assert (result.exit_code, result.timed_out, result.killed) == (1, False, None)
    assert "Traceback" in result.stderr and result.stderr.rstrip().endswith(
        "ZeroDivisionError: division by zero")


def test_snippet_runs_without_privileges():
    facts = run_json("""
        import ctypes, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        nested = libc.unshare(0x10000000)  # CLONE_NEWUSER: a user namespace of its own
        caps = {line.split(":")[0]: int(line.split()[1], 16)
                for line in open("/proc/self/status") if line.startswith("Cap")}
        print(json.dumps({"uid": os.getuid(), "nested": [nested, ctypes.get_errno()],
                          "caps": caps}))
    """)
    if os.geteuid() == 0:
        assert facts["uid"] == 65534  # nobody, not the host's root
    assert facts["nested"][0] == -1 and facts["nested"][1] in (errno.EPERM, errno.ENOSPC)
    assert facts["caps"] and not any(facts["caps"].values()), facts["caps"]


# ---- the host's files, environment and processes -----------------------------------------

def test_host_files_and_environment_are_out_of_sight(tmp_path, monkeypatch):
    token = secrets.token_hex(16)
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    monkeypatch.setenv("RLHF_TEST_SECRET", token)
    facts = run_json(f"""
        import json, os
        def read(path):
            try:
                return open(path).read()
            except OSError as e:
                return type(e).__name__
        def ls(path):
            try:
                return sorted(os.listdir(path))
            except OSError as e:
                return type(e).__name__
        print(json.dumps({{"secret": read({str(secret)!r}), "root": ls("/"),
                          "root_home": ls("/root"), "work": ls("/work"), "etc": ls("/etc"),
                          "home": ls("/home"), "tmp": ls("/tmp"), "env": dict(os.environ),
                          "pid1_env": read("/proc/1/environ")}}))
    """)
    assert facts["secret"] == "FileNotFoundError"
    assert token not in json.dumps(facts)
    prefix = Path(sys.base_prefix).parts  # ('/', 'root', '.pyenv', ...)
    expected_root = {"usr", "lib", "lib64", "bin", "sbin", "tmp", "proc", "dev", prefix[1]}
    assert set(facts["root"]) <= expected_root, facts["root"]
    assert facts["work"] == facts["etc"] == "FileNotFoundError"
    if prefix[1] == "root":  # only the way down to the interpreter's tree
        assert facts["root_home"] == [prefix[2]]
    else:
        assert facts["root_home"] == "FileNotFoundError"
    if prefix[1] != "home":
        assert facts["home"] == "FileNotFoundError"
    assert facts["tmp"] == ["snippet.py"]


def test_nothing_outside_tmp_is_writable_and_tmp_is_private(tmp_path):
    name = f"sandbox-write-{secrets.token_hex(8)}"
    targets = ["/x", "/usr/x", os.path.join(sys.base_prefix, "x"), "/dev/x",
               "/proc/sys/vm/drop_caches", f"/proc/{os.getpid()}/x"]
    facts = run_json(f"""
        import json
        errors = {{}}
        for path in {targets!r}:
            try:
                open(path, "w").write("1")
                errors[path] = None
            except OSError as e:
                errors[path] = type(e).__name__
        open("/tmp/{name}", "w").write("kept")
        print(json.dumps({{"errors": errors, "tmp": open("/tmp/{name}").read()}}))
    """)
    assert all(facts["errors"].values()), facts["errors"]
    assert facts["tmp"] == "kept"
    assert not (Path("/tmp") / name).exists()  # the host's /tmp never saw it
    assert run("import os; print(os.listdir('/tmp'))").stdout == "['snippet.py']\n"


def test_local_tcp_port_cannot_be_reached():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = run(f"""
            import socket
            print(socket.if_nameindex())
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as e:
                print(type(e).__name__, e.errno)
        """)
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    names, outcome = result.stdout.splitlines()
    assert names == "[(1, 'lo')]"  # an empty network namespace: loopback only
    assert outcome.split()[0] != "connected" and int(outcome.split()[1]) in (
        errno.ENETUNREACH, errno.ECONNREFUSED)


def test_other_processes_cannot_be_seen_or_signalled():
    helper = subprocess.Popen(["sleep", "30"])
    try:
        facts = run_json(f"""
            import json, os, signal
            outcome = {{}}
            # SIGKILL only to the helper; a probe (signal 0) to pytest and its parent
            for pid, sig in (({helper.pid}, signal.SIGKILL), ({os.getpid()}, 0),
                             ({os.getppid()}, 0)):
                try:
                    os.kill(pid, sig)
                    outcome[pid] = "reached"
                except OSError as e:
                    outcome[pid] = type(e).__name__
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            print(json.dumps({{"outcome": outcome, "pids": pids, "me": os.getpid()}}))
        """)
        time.sleep(0.1)
        assert helper.poll() is None  # still running
    finally:
        helper.kill()
        helper.wait()
    assert set(facts["outcome"].values()) == {"ProcessLookupError"}, facts["outcome"]
    assert facts["pids"] == [1, facts["me"]]  # its own pid 1 (the bootstrap) and itself


# ---- limits ------------------------------------------------------------------------------

def test_max_processes_counts_the_snippet_and_its_children():
    result = run("""
        import os, time
        n = 0
        try:
            while n < 100:
                if os.fork() == 0:
                    time.sleep(10)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(n, type(e).__name__)
    """)
    assert result.stdout == f"{LIMITS.max_processes - 1} BlockingIOError\n", result
    assert (result.exit_code, result.killed) == (0, None)  # it exited itself: children die


def test_fork_bomb_is_contained_and_leaves_nothing_behind():
    result = run("""
        import os
        print(os.readlink("/proc/self/ns/pid"), flush=True)
        while True:
            os.fork()
    """, wall_time_s=3)
    link = result.stdout.splitlines()[0]
    assert link.startswith("pid:[")
    assert result.killed in ("processes", "cpu_time", "wall_time"), result
    assert "BlockingIOError" in result.stderr or result.timed_out
    assert processes_in_pid_namespace(link) == []
    assert run("print('after')").stdout == "after\n"


def test_memory_bomb_stops_at_the_address_space_limit():
    counted = run("""
        chunks = []
        try:
            while True:
                chunks.append(bytearray(1 << 24))
        except MemoryError:
            print(len(chunks) * 16)
    """)
    assert counted.exit_code == 0 and 0 < int(counted.stdout) <= LIMITS.memory_mb
    bomb = run("x = [bytearray(1 << 24) for _ in range(10_000)]")
    assert (bomb.exit_code, bomb.killed, bomb.timed_out) == (1, "memory", False)
    assert bomb.stderr.rstrip().endswith("MemoryError")


def test_infinite_loop_ends_at_the_cpu_limit():
    start = time.monotonic()
    result = run("while True:\n    pass", wall_time_s=20)
    assert time.monotonic() - start < 20
    assert (result.exit_code, result.timed_out, result.killed) == (
        -signal.SIGXCPU, True, "cpu_time")


def test_sleeping_snippet_ends_at_the_wall_time():
    start = time.monotonic()
    result = run("import time\ntime.sleep(60)", wall_time_s=1)
    assert time.monotonic() - start < 5
    assert (result.exit_code, result.timed_out, result.killed) == (None, True, "wall_time")


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_cut_and_killed(stream):
    result = run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)")
    limit = LIMITS.max_output_bytes
    text = getattr(result, stream)
    assert (result.killed, result.exit_code, result.timed_out) == ("output", None, False)
    assert text.startswith("x" * limit)
    assert text[limit:] == f"\n[output cut: more than {limit} bytes]"


def test_big_file_hits_the_file_limit():
    result = run(f"open('/tmp/big', 'wb').write(b'x' * {(LIMITS.max_file_mb + 1) << 20})")
    assert (result.exit_code, result.killed) == (1, "file_size")


# ---- isolation=none, refusal, CLI --------------------------------------------------------

def test_isolation_none_applies_the_limits_and_warns_once(capsys):
    sandbox._warn_no_isolation.cache_clear()
    assert run_python("print('plain')", PLAIN) == SandboxResult("plain\n", "", 0, False, None)
    loop = run_python("while True:\n    pass", PLAIN)
    memory = run_python("x = [bytearray(1 << 24) for _ in range(10_000)]", PLAIN)
    output = run_python("while True:\n    print('y' * 100)", PLAIN)
    assert (loop.killed, loop.timed_out) == ("cpu_time", True)
    assert (memory.killed, memory.exit_code) == ("memory", 1)
    assert output.killed == "output" and len(output.stdout) < 2 * PLAIN.max_output_bytes
    warnings = [line for line in capsys.readouterr().err.splitlines() if "isolation=none" in line]
    assert len(warnings) == 1


def test_unavailable_isolation_refuses_with_one_line(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "unshare not found (util-linux)")
    with pytest.raises(SandboxUnavailable) as info:
        run_python("print(1)", LIMITS)
    message = str(info.value)
    assert "\n" not in message and message.startswith("unshare not found")
    assert "rollout.sandbox.isolation=none" in message
    assert sandbox.main([__file__]) == 2


def test_cli_prints_one_json_object(tmp_path):
    snippet = tmp_path / "snippet.py"
    snippet.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n")
    done = subprocess.run([sys.executable, "-m", "rlhf.tools.sandbox", str(snippet),
                           "--wall-time-s", "5", "--cpu-time-s", "1", "--memory-mb", "256",
                           "--max-processes", "8", "--max-output-bytes", "1000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"stdout": "out\n", "stderr": "err\n", "exit_code": 3,
                                       "timed_out": False, "killed": None}
    missing = subprocess.run([sys.executable, "-m", "rlhf.tools.sandbox",
                              str(tmp_path / "missing.py")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stdout == ""
    assert len(missing.stderr.strip().splitlines()) == 1 and "missing.py" in missing.stderr


# ---- SandboxFusion -----------------------------------------------------------------------

class FakeFusion(http.server.BaseHTTPRequestHandler):
    """Answers ``POST /run_code`` with ``server.reply`` and keeps the requests."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        data = json.dumps(self.server.reply).encode()
        self.send_response(self.server.code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fusion():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeFusion)
    server.requests, server.code = [], 200
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def fusion_config(url: str) -> SandboxConfig:
    return replace(LIMITS, backend="sandbox_fusion", url=url)


def test_sandbox_fusion_request_and_reply(fusion):
    url = f"http://127.0.0.1:{fusion.server_address[1]}"
    fusion.reply = {"status": "Success", "message": "", "compile_result": None,
                    "run_result": {"status": "Finished", "execution_time": 0.01,
                                   "return_code": 0, "stdout": "4\n", "stderr": ""}}
    assert run_python("print(2 + 2)", fusion_config(url + "/")) == SandboxResult(
        "4\n", "", 0, False, None)
    path, body = fusion.requests[0]
    assert path == "/run_code"
    assert (body["code"], body["language"], body["run_timeout"]) == (
        "print(2 + 2)", "python", LIMITS.wall_time_s)
    fusion.reply = {"status": "Failed", "message": "",
                    "run_result": {"status": "TimeLimitExceeded", "execution_time": 5.0,
                                   "return_code": None, "stdout": "y" * 10_000, "stderr": ""}}
    slow = run_python("while True: print('y')", fusion_config(url))
    assert (slow.timed_out, slow.killed, slow.exit_code) == (True, "wall_time", None)
    assert slow.stdout.startswith("y" * LIMITS.max_output_bytes) and "output cut" in slow.stdout
    fusion.reply = {"status": "SandboxError", "message": "no runner for python"}
    broken = run_python("print(1)", fusion_config(url))
    assert (broken.exit_code, broken.killed) == (None, None)
    assert "SandboxError" in broken.stderr and "no runner for python" in broken.stderr
    fusion.code = 500
    assert run_python("print(1)", fusion_config(url)).exit_code is None


def test_sandbox_fusion_unreachable_is_a_result_not_an_exception():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_python("print(1)", fusion_config(f"http://127.0.0.1:{port}"))
    assert (result.stdout, result.exit_code, result.timed_out, result.killed) == (
        "", None, False, None)
    assert f"127.0.0.1:{port}" in result.stderr and "refused" in result.stderr.lower()
