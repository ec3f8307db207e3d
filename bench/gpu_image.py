"""The lent GPU machine's Python packages, and an import blocker that makes this machine look
like it: a step of the GPU check that needs a package the image lacks fails here, on the CPU,
naming the package, instead of there with the clock running.

    python -m bench.gpu_image --wheels                          # what `make gpu-wheels` fetches
    python -m bench.gpu_image --check MODULE... [--hide NAME]   # import them with the rest hidden

What a GPU step may import:

=========  ===================================================================================
IMAGE      the packages the image is known to have, and every distribution they declare they
           need (their ``Requires-Dist`` closure without extras, as installed here: torch
           brings filelock, sympy, jinja2, fsspec, setuptools; transformers huggingface-hub,
           regex, packaging; accelerate psutil)
CARRIED    the wheels of ``wheels/`` that the check installs first (``make gpu-wheels``), each
           without its own requirements (installed with ``--no-deps``)
TOOLS      pip (the check's install step) and this project
=========  ===================================================================================

Every other distribution installed here is hidden: its modules are not found (``import``
raises ModuleNotFoundError naming the module; ``importlib.util.find_spec`` answers None, so a
library's "is X available" probe says no, as it would there) and its metadata is not listed
(``importlib.metadata`` does not find it; pytest loads none of its plugins).  The packages
beyond the image, decided one by one: omegaconf (the config), datasets and what it needs
(dill, multiprocess, xxhash) and TRL (the e2e bench's peer) are carried; TensorBoard (event
files) and matplotlib (the metrics plot) are optional: without them :mod:`rlhf.metrics` prints
one line and writes neither.

The blocker wraps every finder on ``sys.meta_path``: :func:`hide` installs it in this process,
:func:`site_folder` writes a ``sitecustomize.py`` that installs it in every Python process
with that folder on its ``PYTHONPATH`` (the dry run's steps and the processes they start).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Iterable

IMAGE = ("torch", "transformers", "accelerate", "peft", "safetensors", "tokenizers", "pyarrow",
         "pandas", "pytest", "pyyaml", "tqdm", "rich", "numpy", "triton", "cupy-cuda13x")
"""The distributions the GPU image is known to have (cupy as its CUDA 13 build)."""
CARRIED = ("omegaconf", "datasets", "dill", "multiprocess", "xxhash", "trl")
"""The wheels the check carries in ``wheels/``: omegaconf and datasets (requirements.txt),
what datasets needs beyond the image (dill, multiprocess, xxhash), TRL (requirements.txt)."""
OPTIONAL = ("tensorboard", "matplotlib")
"""Used where installed, skipped with a one-line notice where not (:mod:`rlhf.metrics`)."""
TOOLS = ("pip", "hybridflow")
"""pip, which installs the carried wheels, and this project's own distribution."""
PROJECT_PACKAGES = ("bench", "engine", "examples", "hybridflow_comm", "rlhf", "tests")
"""This repository's packages: never hidden, whatever another distribution's files claim."""
SITE_FILE = "sitecustomize.py"
HIDDEN_FILE = "hidden_imports.json"


def _norm(name: str) -> str:
    """A distribution's name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed_distributions() -> set[str]:
    """The normalised names of IMAGE's closure, TOOLS and CARRIED (these without their own
    requirements: the check installs them with ``--no-deps``)."""
    from packaging.requirements import Requirement

    seen, todo = set(), [_norm(n) for n in (*IMAGE, *TOOLS)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (triton, cupy on a CPU machine)
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen | {_norm(n) for n in CARRIED}


def hidden_imports(extra: Iterable[str] = ()) -> dict:
    """What :func:`hide` hides here: ``{"modules": {top-level module: its distribution},
    "distributions": [...], "extra": [...]}`` for every installed distribution outside
    :func:`allowed_distributions` (a module that an allowed distribution also provides, a
    standard-library name and this project's packages stay), and ``extra`` modules (full
    names, with their submodules) on top."""
    allowed = allowed_distributions()
    keep = set(sys.stdlib_module_names) | set(PROJECT_PACKAGES)
    modules = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        if module not in keep and not any(_norm(d) in allowed for d in dists):
            modules[module] = dists[0]
    dists = {_norm(d.metadata["Name"] or "") for d in importlib.metadata.distributions()}
    return {"modules": dict(sorted(modules.items())),
            "distributions": sorted(dists - allowed - {""}), "extra": sorted(extra)}


class _Hiding:
    """A meta-path finder: ``inner`` with the hidden modules and distributions left out."""

    def __init__(self, inner, modules: Iterable[str], dists: Iterable[str],
                 extra: Iterable[str]) -> None:
        self.inner = inner
        self.modules, self.dists, self.extra = frozenset(modules), frozenset(dists), tuple(extra)

    def hides(self, fullname: str) -> bool:
        return (fullname.partition(".")[0] in self.modules
                or any(fullname == m or fullname.startswith(m + ".") for m in self.extra))

    def find_spec(self, fullname, path=None, target=None):
        find = getattr(self.inner, "find_spec", None)
        return None if find is None or self.hides(fullname) else find(fullname, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        found = () if find is None else find(*args, **kwargs)
        return (d for d in found if _norm(d.metadata["Name"] or "") not in self.dists)

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def hide(spec: dict) -> None:
    """Hide ``spec``'s modules and distributions (:func:`hidden_imports`) from this process's
    imports from now on (modules imported already stay)."""
    if any(isinstance(f, _Hiding) for f in sys.meta_path):
        return
    sys.meta_path[:] = [_Hiding(f, spec["modules"], spec["distributions"], spec["extra"])
                        for f in sys.meta_path]
    importlib.invalidate_caches()


SITE_CODE = f"""\
# Written by bench.gpu_image.site_folder: this process sees the GPU image's packages alone.
import json, os
from bench import gpu_image
with open(os.path.join(os.path.dirname(__file__), {HIDDEN_FILE!r})) as f:
    gpu_image.hide(json.load(f))
"""


def site_folder(folder: str, extra: Iterable[str] = ()) -> str:
    """Write ``folder/sitecustomize.py`` (with the repository's root also on ``PYTHONPATH``,
    every Python process started with ``folder`` on it hides what :func:`hidden_imports`
    hides) and return ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, HIDDEN_FILE), "w") as f:
        json.dump(hidden_imports(extra), f)
    with open(os.path.join(folder, SITE_FILE), "w") as f:
        f.write(SITE_CODE)
    return folder


def carried_pins() -> list[str]:
    """``name==version`` of each CARRIED package as installed here (``make setup`` installs
    requirements.txt's pins; pip resolved the others for datasets)."""
    return [f"{n}=={importlib.metadata.version(n)}" for n in CARRIED]


def check(modules: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """Import ``modules`` with everything outside the image hidden, and ``extra`` too.

    Returns:
        One line per module that does not import: what it misses and where that is.
    """
    spec = hidden_imports(extra)
    hide(spec)
    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing = e.name or str(e)
            dist = spec["modules"].get(missing.partition(".")[0])
            where = (f"distribution {dist}: installed here, not in the GPU image; carry it "
                     f"(bench.gpu_image.CARRIED) or make it optional" if dist else
                     "hidden by --hide" if any(missing.startswith(m) for m in spec["extra"])
                     else f"not installed: {e}")
            problems.append(f"{module} needs {missing} ({where})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", action="store_true", help="print the carried wheels' pins")
    p.add_argument("--check", nargs="+", default=[], metavar="MODULE",
                   help="import these with every package outside the image hidden")
    p.add_argument("--hide", nargs="*", default=[], metavar="NAME",
                   help="modules to hide as well (engine._kernels: not built on a GPU)")
    a = p.parse_args(argv)
    if a.wheels:
        print(" ".join(carried_pins()))
    if a.check:
        problems = check(a.check, a.hide)
        for line in problems:
            print(f"[gpu_image] {line}", file=sys.stderr)
        print(f"[gpu_image] {len(a.check) - len(problems)} of {len(a.check)} modules import "
              f"with the GPU image's packages alone")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
