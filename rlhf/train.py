"""Entry point of an RLHF run::

    torchrun --nproc_per_node=4 -m rlhf.train algo=ppo [key=value ...]
    python -m rlhf.train algo=grpo iterations=2        # one process (CPU development)

Every rank loads and validates the config against the world size before any process group
exists, so a bad value stops the job with a message naming it; then rank 0 runs the
controller program (:func:`rlhf.runtime.train`) and every rank serves its workers.
"""

from __future__ import annotations

import os
import socket
import sys

from rlhf.builders import check_run, tokenizer_of
from rlhf.config import load_config, validate_for_world
from rlhf.controller import run
from rlhf.planner.config_bridge import resolve_config
from rlhf.runtime import train


def single_process_env() -> None:
    """Without torchrun: a world of one on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def main(argv: list[str]) -> int:
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # placement.mode=auto: the planner picks placement and layouts (same on every rank)
        cfg = resolve_config(load_config(argv), world)
        plan = validate_for_world(cfg, world)
        check_run(cfg, tokenizer_of(cfg))
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"[rlhf] invalid configuration: {e}", file=sys.stderr, flush=True)
        return 2
    single_process_env()
    code = run(lambda ctl: train(ctl, cfg, plan))
    # Exit without interpreter teardown: destroying live gloo groups at exit can abort
    # ("terminate called without an active exception") after a successful run: 3 of 8
    # 4-rank PPO runs did without this line, and all 8 with an explicit
    # dist.destroy_process_group() before a normal exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
