"""The config is light: ``import rlhf.config`` loads neither torch nor the engines, the controller,
the workers or a C++ extension, and building a config (the checks that reject a bad value)
loads none of the engines, the controller's launch machinery or a C++ extension either.  Each in
a fresh interpreter, listing every module it should not have loaded.  (What this costs in CPU
time: ``bench/config_check.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENGINE_SETTINGS = {"engine", "engine.optim_config", "engine.lora_config", "engine.seeds"}
"""The engine modules a config embeds, builds or checks with (dataclasses and the seed check, on
the standard library only)."""
EXTENSIONS = {"hybridflow_comm._C", "engine._kernels"}


def loaded_by(code: str) -> list[str]:
    """The modules in ``sys.modules`` after ``code`` runs in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, env=os.environ | {"PYTHONPATH": ROOT}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def under(modules: list[str], *packages: str) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def test_import_rlhf_config_is_light():
    modules = loaded_by("import rlhf.config")
    offending = sorted(
        set(under(modules, "engine")) - ENGINE_SETTINGS
        | set(under(modules, "rlhf.controller", "rlhf.workers", "rlhf.programs", "torch"))
        | EXTENSIONS & set(modules))
    assert not offending, f"import rlhf.config loaded {offending}"


def test_building_a_config_loads_no_engine_controller_or_extension():
    """A config is built against the registries (torch code, the algorithms' programs), but
    without the engines, the controller's launch, sockets and worker groups, or an extension."""
    modules = loaded_by("from rlhf.config import load_config\n"
                        "load_config(['algo=grpo', 'actor.layout.tp=1'])")
    allowed_engine = ENGINE_SETTINGS
    allowed_controller = {"rlhf.controller", "rlhf.controller.batch", "rlhf.controller.wire",
                          "rlhf.controller.messages"}  # the Batch of the programs, its codec
    offending = sorted(
        set(under(modules, "engine")) - allowed_engine
        | set(under(modules, "rlhf.controller")) - allowed_controller
        | set(under(modules, "rlhf.workers", "hybridflow_comm.layout", "hybridflow_comm.groups"))
        | EXTENSIONS & set(modules))
    assert not offending, f"load_config loaded {offending}"
