"""Entry point of an RLHF run::

    torchrun --nproc_per_node=4 -m rlhf.train algo=ppo [key=value ...]
    python -m rlhf.train algo=grpo iterations=2 actor.layout.tp=1   # one process (CPU development)
    python -m rlhf.train --check algo=grpo [key=value ...]          # the checks only

Every rank loads and validates the config, its files (recipe, checkpoints, tokenizer, data,
reward function), its device and precision (``device=auto|cpu|cuda``,
``precision=auto|fp32|bf16``: :func:`rlhf.config.resolve_devices`) and the launch settings
against the world size before any process group exists, so a bad value stops the job with one
line naming it (exit code 2); then rank 0 runs the controller program
(:func:`rlhf.runtime.train`) and every rank serves its workers on its device.

The config is checked on its own first (:func:`rlhf.config.load_config`, which loads no torch
and no engine); only a config that passed imports the engines, the controller and the C++
extension, for the checks against the world and the files and for the run
(:mod:`rlhf.train_launch`).  ``--check`` stops after the checks: exit code 0 and one line
with the plan on rank 0 (the world is ``WORLD_SIZE``, 1 without torchrun).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import TYPE_CHECKING

import yaml
from omegaconf.errors import OmegaConfBaseException

from engine.host_memory import keep_freed_memory
from rlhf.config import Config, load_config
from rlhf.config_io import one_line

if TYPE_CHECKING:  # annotations only: the world plan loads the C++ extension
    from rlhf.world_plan import WorldPlan

# What a bad input can raise on its way through the checks (ValueError: every message of our
# own; the rest from the parsers and readers underneath).  Anything else is a bug: traceback.
INVALID = (ValueError, TypeError, OverflowError, OSError, OmegaConfBaseException,
           yaml.YAMLError, RecursionError)
CHECK_FLAG = "--check"
OTHER_RANKS_EXIT_AFTER_S = 2.0
"""Seconds a rank other than 0 waits before it exits on an invalid configuration: every rank
finds the error alike, and a worker that exits first has torchrun terminate the others,
rank 0 (which prints the one line) included, even before it printed when the machine is
loaded."""


def single_process_env() -> None:
    """Without torchrun: a world of one on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def validated(argv: list[str]) -> tuple[Config, WorldPlan]:
    """The run's config, its device and precision resolved for this rank, and its plan for
    ``WORLD_SIZE`` ranks; raises one of :data:`INVALID` (normally a ValueError naming the key
    and the fix) for any bad input.  Cheap: reads files and does arithmetic, builds nothing."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.strip().isdigit():
        raise ValueError(f"WORLD_SIZE={text!r} is not a number of ranks")
    cfg = load_config(argv)
    # the config passed on its own: now the engines, the controller and the C++ extension
    from rlhf.train_launch import checked_for_world

    return checked_for_world(cfg, int(text))


def summary(cfg: Config, plan: WorldPlan) -> str:
    """One line: the algorithm, the placement and every role's layout on its pool."""
    roles = ", ".join(f"{name} pp={r.pp} tp={r.tp} dp={r.dp} on {len(r.pool)} rank(s)"
                      for name, r in plan.roles.items())
    return (f"algo={cfg.algo.name} placement={cfg.placement.mode} world={plan.world_size} "
            f"device={cfg.device} precision={cfg.precision}: {roles}")


def main(argv: list[str]) -> int:
    check_only = CHECK_FLAG in argv
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        cfg, plan = validated([a for a in argv if a != CHECK_FLAG])
        keep_freed_memory()  # every rank's steps reuse their freed host memory
    except INVALID as e:
        if rank0:
            print(f"[rlhf] invalid configuration: {one_line(e)}", file=sys.stderr, flush=True)
        else:  # torchrun stops every worker once one exits: rank 0 must print its line first
            time.sleep(OTHER_RANKS_EXIT_AFTER_S)
        return 2
    if check_only:
        if rank0:
            print(f"[rlhf] configuration valid: {summary(cfg, plan)}", flush=True)
        return 0
    from rlhf.train_launch import launch

    single_process_env()
    code = launch(cfg, plan)
    # Exit without interpreter teardown: destroying live gloo groups at exit can abort
    # ("terminate called without an active exception") after a successful run: 3 of 8
    # 4-rank PPO runs did without this line, and all 8 with an explicit
    # dist.destroy_process_group() before a normal exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
