"""Several RLHF runs inside ONE torchrun job (one ~8 s start-up for all of them).

    torchrun --standalone --nproc_per_node 2 -m tests.rlhf_jobs SPEC.json OUT.json
    torchrun --standalone --nproc_per_node 2 -m tests.rlhf_jobs reshard CKPT ROOT [k=v ...]

``SPEC.json`` is ``{name: [key=value, ...]}``; each run is validated and trained in turn by
the same controller (every run creates its own worker groups).  ``OUT.json`` gets
``{name: {"records": [...]} | {"error": "..."}}``.

``reshard``: build the roles of the config (any layout), load the sharded checkpoint CKPT into
them (each rank reads the saved chunks that overlap its shards) and save them again under ROOT
(each rank writes its own shards), so a test can compare the two checkpoints bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from rlhf.config import load_config, resolve_devices
from rlhf.controller import Controller, ControllerError, run
from rlhf.planner.config_bridge import resolve_config
from rlhf.builders import build_roles, check_run, tokenizer_of
from rlhf.runtime import RunState, restore, save, train
from rlhf.train import single_process_env
from rlhf.world_plan import validate_for_world

def launch(spec: dict, folder, name: str = "spec", nproc: int = 2,
           env: dict | None = None) -> dict:
    """Run ``spec`` (``{run: [key=value, ...]}``) in one torchrun job of ``nproc`` ranks from a
    test: ``{run: {"records": [...]} | {"error": ...}}`` (the job's output must exist)."""
    import subprocess

    spec_path, out_path = folder / f"{name}.json", folder / f"{name}_out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "tests.rlhf_jobs", str(spec_path), str(out_path)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert out_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out_path.read_text())


QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot=false",
         "device=cpu"]  # the workers of run() compute on the host
TINY = ["actor.model.hidden_size=32", "actor.model.intermediate_size=64",
        "actor.model.num_heads=4", "actor.model.num_kv_heads=2",
        "actor.model.num_layers=2"] + QUIET


def base_overrides(overrides: list[str]) -> list[str]:
    """The tiny built-in model, unless the run brings a checkpoint (its config.json rules)."""
    own_model = any(o.startswith("actor.model.init_from=") for o in overrides)
    return QUIET if own_model else TINY


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plans = {}
    for name, overrides in spec.items():  # every rank validates every run before any work
        cfg, _ = resolve_devices(load_config(base_overrides(overrides) + overrides))
        cfg = resolve_config(cfg, world)  # as rlhf.train_launch.checked_for_world
        plans[name] = (cfg, validate_for_world(cfg, world))
        check_run(cfg, tokenizer_of(cfg))  # as rlhf.train does before any process group

    def program(ctl: Controller) -> None:
        out = {}
        for name, (cfg, plan) in plans.items():
            try:
                out[name] = {"records": train(ctl, cfg, plan)}
            except (ValueError, ControllerError) as e:  # a bad input, a worker that raised
                out[name] = {"error": f"{e}", "traceback": traceback.format_exc()}
        with open(out_path, "w") as f:
            json.dump(out, f)

    single_process_env()
    code = run(program)
    sys.stdout.flush()
    os._exit(code)


def reshard(ckpt: str, root: str, *overrides: str) -> int:
    cfg, _ = resolve_devices(load_config(TINY + list(overrides)))
    plan = validate_for_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))

    def program(ctl: Controller) -> None:
        roles, state = build_roles(ctl, cfg, plan), RunState(cfg, tokenizer_of(cfg))
        restore(roles, state, ckpt)
        save(roles, state, root, keep_last=0)

    single_process_env()
    code = run(program)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "reshard":
        sys.exit(reshard(*sys.argv[2:]))
    sys.exit(main(*sys.argv[1:]))
