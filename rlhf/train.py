"""Entry point of an RLHF run::

    torchrun --nproc_per_node=4 -m rlhf.train algo=ppo [key=value ...]
    python -m rlhf.train algo=grpo iterations=2        # one process (CPU development)

Every rank loads and validates the config, its files (recipe, checkpoints, tokenizer, data,
reward function), its device and precision (``device=auto|cpu|cuda``,
``precision=auto|fp32|bf16``: :func:`rlhf.config.resolve_devices`) and the launch settings
against the world size before any process group exists, so a bad value stops the job with one
line naming it (exit code 2); then rank 0 runs the controller program
(:func:`rlhf.runtime.train`) and every rank serves its workers on its device.
"""

from __future__ import annotations

import os
import socket
import sys

import yaml
from omegaconf.errors import OmegaConfBaseException

from engine.host_memory import keep_freed_memory
from hybridflow_comm.devices import resolve_device
from rlhf.builders import check_run, tokenizer_of, tokenizer_path
from rlhf.config import Config, load_config, resolve_devices
from rlhf.controller import run
from rlhf.controller.launch import message_limit, stall_timeout
from rlhf.planner.config_bridge import resolve_config
from rlhf.runtime import train
from rlhf.world_plan import WorldPlan, validate_for_world

# What a bad input can raise on its way through the checks (ValueError: every message of our
# own; the rest from the parsers and readers underneath).  Anything else is a bug: traceback.
INVALID = (ValueError, TypeError, OverflowError, OSError, OmegaConfBaseException,
           yaml.YAMLError, RecursionError)


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
    world = int(text)
    message_limit(None, os.environ)
    stall_timeout(None, os.environ)
    # placement.mode=auto: the planner picks placement and layouts (same on every rank)
    cfg, _ = resolve_devices(load_config(argv))
    cfg = resolve_config(cfg, world)
    plan = validate_for_world(cfg, world)
    path = tokenizer_path(cfg)
    try:
        tok = tokenizer_of(cfg)
    except Exception as e:  # noqa: BLE001 - a user's tokenizer files, read by transformers
        if isinstance(e, ValueError) and str(path) in str(e):
            raise  # our own message, naming the folder
        raise ValueError(f"tokenizer={path!r} cannot be loaded: {_one_line(e)}") from None
    check_run(cfg, tok)
    return cfg, plan


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or repr(e)
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def main(argv: list[str]) -> int:
    try:
        cfg, plan = validated(argv)
        keep_freed_memory()  # every rank's steps reuse their freed host memory
    except INVALID as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"[rlhf] invalid configuration: {_one_line(e)}", file=sys.stderr, flush=True)
        return 2
    single_process_env()
    device = resolve_device(cfg.device)  # resolved: cpu, or cuda:<LOCAL_RANK>
    code = run(lambda ctl: train(ctl, cfg, plan), device=device)
    # Exit without interpreter teardown: destroying live gloo groups at exit can abort
    # ("terminate called without an active exception") after a successful run: 3 of 8
    # 4-rank PPO runs did without this line, and all 8 with an explicit
    # dist.destroy_process_group() before a normal exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
