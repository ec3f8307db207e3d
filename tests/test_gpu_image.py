"""The GPU image's packages and the import blocker (bench/gpu_image.py): a hidden package is
absent to imports, probes and metadata; the GPU steps' code imports with the image's packages
and the carried wheels alone (and without engine._kernels, which a GPU does not build).  Each
check runs in a subprocess, so the blocker never reaches this one."""

import json
import os
import subprocess
import sys

from bench import gpu_check, gpu_image

PY = sys.executable

HIDDEN_PROBE = r"""
import importlib.metadata, importlib.util, json
from bench import gpu_image
gpu_image.hide(gpu_image.hidden_imports(["engine._kernels"]))
out = {}
try:
    import tensorboard
except ModuleNotFoundError as e:
    out["import"] = e.name
out["find_spec"] = importlib.util.find_spec("matplotlib")
try:
    out["metadata"] = importlib.metadata.version("tensorboard")
except importlib.metadata.PackageNotFoundError:
    out["metadata"] = None
out["plugins"] = sorted(ep.value for ep in importlib.metadata.entry_points(group="pytest11"))
try:
    import engine._kernels
except ModuleNotFoundError as e:
    out["kernels"] = e.name
import omegaconf, xxhash, yaml  # carried, and the image's
out["kept"] = [m.__name__ for m in (omegaconf, xxhash, yaml)]
print(json.dumps(out))
"""


def _run(argv):
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          cwd=gpu_check.ROOT)


def test_a_hidden_package_is_absent_to_imports_probes_metadata_and_plugins():
    proc = _run([PY, "-c", HIDDEN_PROBE])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["import"] == "tensorboard" and out["find_spec"] is None
    assert out["metadata"] is None
    # pytest-timeout, -xdist, -benchmark: not the image's, so pytest loads none of them
    assert not [p for p in out["plugins"] if p.startswith(("pytest_timeout", "xdist",
                                                           "pytest_benchmark"))]
    assert out["kernels"] == "engine._kernels"
    assert out["kept"] == ["omegaconf", "xxhash", "yaml"]


def test_a_module_that_needs_a_hidden_package_is_named():
    proc = _run([PY, "-m", "bench.gpu_image", "--check", "matplotlib.pyplot"])
    assert proc.returncode == 1
    assert "matplotlib.pyplot needs matplotlib (distribution matplotlib" in proc.stderr


def test_the_gpu_steps_code_imports_with_the_image_and_the_carried_wheels_alone():
    modules = gpu_check.gpu_modules()
    assert {"bench.generation", "bench.e2e", "rlhf.main_job", "tests.test_engine_cuda"} \
        <= set(modules)
    proc = _run([PY, "-m", "bench.gpu_image", "--check", *modules, "--hide", "engine._kernels"])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_what_the_image_lacks_is_carried_or_optional():
    allowed = gpu_image.allowed_distributions()
    for name in ("omegaconf", "datasets", "trl", "dill", "multiprocess", "xxhash"):
        assert name in gpu_image.CARRIED
    assert not {"tensorboard", "matplotlib"} & allowed  # optional: hidden in the dry run
    # the carried pins are requirements.txt's where it pins them
    pins = dict(p.split("==") for p in gpu_image.carried_pins())
    with open(os.path.join(gpu_check.ROOT, "requirements.txt")) as f:
        required = dict(line.split("#")[0].strip().split("==") for line in f
                        if "==" in line.split("#")[0])
    assert all(pins[n] == required[n] for n in pins if n in required)
    assert {"omegaconf", "datasets", "trl"} <= set(required)
