"""examples/reshard_*.py, each as a user runs it (``torchrun --nproc_per_node=4 EXAMPLE``),
with NCCL's rules enforced in every rank (``-m hybridflow_comm.nccl_rules``: the script runs unchanged,
its collectives refused where NCCL would refuse them; the gloo-only host point-to-point path
the rules switch off is covered by tests/test_reshard_multirank.py).

Every example builds its full tensors from a seed on every rank, shards them its framework's
way, reshards through the public API and compares every generation tensor bit-exactly; here
each must exit 0 and print exactly one result line whose received bytes equal the minimum.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["reshard_state_dict", "reshard_dtensor_tp", "reshard_fsdp2", "reshard_megatron"]
RESULT = re.compile(r"^(\w+): (\d+) tensors bit-exact, received ([\d.]+) MiB/rank "
                    r"\(minimum ([\d.]+) MiB\)$", re.MULTILINE)


def torchrun_example(name: str, timeout: float = 300,
                     nccl_rules: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=4 EXAMPLE --device cpu``; with ``nccl_rules``, through
    ``-m hybridflow_comm.nccl_rules`` (NCCL's rules enforced in every rank)."""
    # The scripts import hybridflow_comm like an installed package; the repository root on
    # PYTHONPATH makes that true for a checkout that was not pip-installed too.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    rules = ["-m", "hybridflow_comm.nccl_rules"] if nccl_rules else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", *rules, os.path.join(ROOT, "examples", f"{name}.py"), "--device", "cpu"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_reshards_bit_exact_with_minimum_bytes(name, nccl_rules=True):
    proc = torchrun_example(name, nccl_rules=nccl_rules)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = RESULT.findall(proc.stdout)
    assert len(results) == 1, proc.stdout
    example, tensors, received, minimum = results[0]
    assert example == name
    assert int(tensors) > 0
    assert float(received) == float(minimum) > 0, results[0]


def test_readme_links_every_example_with_the_entry_it_calls():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Call resharding from your framework"):]
    section = section[:section.index("\n## ")]
    rows = {m[1]: m[0] for m in re.finditer(r"^\|.*\]\(examples/(\w+)\.py\).*$", section,
                                          re.MULTILINE)}
    assert sorted(rows) == sorted(EXAMPLES)
    for name, row in rows.items():
        with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
            entry = re.search(r"\bhc\.(reshard_from_state_dict|from_\w+)\(", f.read())[1]
        assert f"`{entry}(" in row, (name, entry, row)


def test_examples_are_short_and_use_the_public_api():
    for name in EXAMPLES:
        with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
            text = f.read()
        assert "import hybridflow_comm as hc" in text, name
        assert len(text.splitlines()) <= 80, name
