"""Builds the packages and the C++ extensions ``hybridflow_comm._C`` and ``engine._kernels``
(C++ only, also on GPU machines: the CUDA paths are torch's own kernels and the driver API
through ctypes).  Install with ``pip install --no-build-isolation -e .`` (torch must already
be installed).

``HYBRIDFLOW_CPU_KERNELS=0`` builds ``hybridflow_comm._C`` alone: ``engine._kernels`` holds
CPU decode kernels that every caller does without (each imports it inside ``try``), which the
GPU check (bench/gpu_check.py) does not spend its minutes on.
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_KERNELS = os.environ.get("HYBRIDFLOW_CPU_KERNELS", "1") != "0"
# at::parallel_for is a header template: it runs serially unless the extension itself is
# compiled (and linked) with OpenMP
OPENMP = ["-fopenmp"]


def _extension():
    return cpp_extension.CppExtension(
        "hybridflow_comm._C", sorted(glob.glob(os.path.join("csrc", "*.cpp"))),
        extra_compile_args=["-O3", "-std=c++17", *OPENMP], extra_link_args=OPENMP)


def _requirements(name: str) -> list[str]:
    """The pins of one requirements file (comments and blank lines dropped)."""
    with open(os.path.join(ROOT, name)) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def _kernels_extension():
    # -ffp-contract=off: no FMA contraction, so every SIMD clone rounds alike and RoPE rounds
    # like ATen's separate multiplies and add
    return cpp_extension.CppExtension(
        "engine._kernels", sorted(glob.glob(os.path.join("csrc", "engine", "*.cpp"))),
        extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", *OPENMP],
        extra_link_args=OPENMP)


setup(
    name="hybridflow",
    version="0.1.0",
    description="HybridFlow: resharding toolkit, HybridEngine and RLHF runtime",
    packages=find_packages(include=["hybridflow_comm*", "engine*", "rlhf*"]),
    package_data={"rlhf": ["recipes/*.yaml", "planner/profiles/*.json"]},
    ext_modules=[_extension(), *([_kernels_extension()] if CPU_KERNELS else [])],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    # optional, GPU only, not installed by `make test` / CI; the pin lives in the file
    extras_require={"vllm": _requirements("requirements-vllm.txt")},
)
