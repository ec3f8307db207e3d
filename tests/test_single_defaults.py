"""Every hyperparameter default is defined in exactly one place: the run config's dataclasses
(rlhf.config) or the engine dataclass that the config embeds (engine.optim_config.OptimConfig).

The test walks the config dataclasses for every field that has a default, then parses the
workers, builders, programs, runtime, the algorithm functions and the engine constructors and
fails on any parameter or dataclass field of the same name that carries a default of its own.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

from rlhf import config as C

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ["rlhf/workers", "rlhf/builders.py", "rlhf/programs", "rlhf/runtime.py", "rlhf/algos",
           "engine/train.py", "engine/hybrid_engine.py", "engine/generation.py",
           "engine/sampling.py", "engine/model.py", "engine/llama_spec.py"]


def _sections(cls, seen: set) -> None:
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for t in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(t):
                _sections(t, seen)


def config_defaults() -> dict[str, str]:
    """Field name -> owning class, for every field with a default in a config section that is
    defined in rlhf (rlhf.config and the section modules it imports; an embedded engine
    dataclass owns its own defaults)."""
    seen: set = set()
    _sections(C.Config, seen)
    out = {}
    for cls in seen:
        if not cls.__module__.startswith("rlhf."):
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            has = f.default is not dataclasses.MISSING or \
                f.default_factory is not dataclasses.MISSING
            section = any(dataclasses.is_dataclass(t)
                          for t in (hints[f.name], *typing.get_args(hints[f.name])))
            if has and not section:
                out.setdefault(f.name, cls.__name__)
    return out


def code_defaults(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(name, line, where) of every defaulted parameter and defaulted class-level field."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            pos = a.posonlyargs + a.args
            for arg in pos[len(pos) - len(a.defaults):]:
                out.append((arg.arg, node.lineno, f"def {node.name}"))
            for arg, d in zip(a.kwonlyargs, a.kw_defaults):
                if d is not None:
                    out.append((arg.arg, node.lineno, f"def {node.name}"))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None \
                        and isinstance(item.target, ast.Name):
                    out.append((item.target.id, item.lineno, f"class {node.name}"))
    return out


# ``seed`` is the run's seed in the config; the engine's seeds are per-call RNG seeds that the
# runtime derives from it (SamplingParams.seed = derive_seed(seed, "rollout", step)), another
# quantity.  ``device`` is the run's request (auto, cpu, cuda); the engines' ``device`` is the
# torch.device a rank resolved from it (rlhf.config.resolve_devices); ``precision`` alike (auto,
# fp32, bf16; the engines' is the resolved hybridflow_comm.devices.Precision).
# ``rollout.engine`` names the generation backend; a worker's ``engine`` is its TrainEngine.
NOT_THE_SAME_QUANTITY = {"seed", "device", "precision", "engine"}
# Engine switches whose default is "off" (HF's and vLLM's too), so that direct engine users
# need not name them; the runtime always passes the config's value (builders.sampling_of,
# builders.actor_spec; a model's experts: the checkpoint's config.json or the config's
# actor.model / actor.router_aux_loss_coef, 0 = a dense model, no load-balancing term).
ENGINE_OFF_SWITCHES = {"min_new_tokens", "offload_during_generation", "num_experts",
                       "num_experts_per_tok", "router_aux_loss_coef"}


def test_no_config_default_is_restated_in_code():
    names = {k: v for k, v in config_defaults().items()
             if k not in NOT_THE_SAME_QUANTITY | ENGINE_OFF_SWITCHES}
    assert {"kl_estimator", "clip_ratio", "temperature", "gamma", "value_clip"} <= set(names)
    files = []
    for entry in SCANNED:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    clashes = [f"{f.relative_to(ROOT)}:{line} {where}: {name} (default of "
               f"rlhf.config.{names[name]}.{name})"
               for f in files for name, line, where in code_defaults(f) if name in names]
    assert not clashes, "defaults written twice:\n" + "\n".join(clashes)


def test_the_scan_finds_a_restated_default(tmp_path):
    p = tmp_path / "w.py"
    p.write_text("class A:\n    kl_estimator: str = 'k3'\n\ndef f(x, *, gamma=1.0):\n    pass\n")
    assert {n for n, _, _ in code_defaults(p)} == {"kl_estimator", "gamma"}
