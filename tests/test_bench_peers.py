"""bench/peers.py: a bench whose peer is missing names the install line instead of failing
deep inside the run."""

import subprocess
import sys

import pytest

from bench.peers import peer_missing, require_peer


def test_installed_module_is_no_missing_peer():
    assert peer_missing("torch") is None


def test_missing_peer_exits_with_the_install_line():
    name = "hybridflow_no_such_peer"
    assert "requirements-dev.txt" in peer_missing(name)
    with pytest.raises(SystemExit, match=f"bench/x.py compares against {name}.*pip install"):
        require_peer(name, "bench/x.py")


def test_learning_bench_stops_before_work_without_trl(tmp_path):
    # A fresh interpreter in which "trl" cannot be found: the bench exits with the hint.
    code = ("import importlib.util, runpy, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'trl' else real(n, *a)\n"
            "sys.argv = ['bench/learning.py', '--budget-s', '1']\n"
            "runpy.run_path('bench/learning.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "compares against trl" in proc.stderr and "requirements-dev.txt" in proc.stderr
    assert "Traceback" not in proc.stderr
