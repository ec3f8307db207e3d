"""The part of :mod:`rlhf.train` that needs the engines, the controller and the C++ extension:
the checks of a config (already valid on its own) against the world and the run's files, and
the run itself.  :mod:`rlhf.train` imports this module only once :func:`rlhf.config.load_config`
accepted the config, so a bad key or value never pays for these imports.
"""

from __future__ import annotations

import os

from hybridflow_comm.devices import resolve_device
from rlhf.builders import check_run, tokenizer_of, tokenizer_path
from rlhf.config import Config, resolve_devices
from rlhf.config_io import one_line
from rlhf.controller import run
from rlhf.controller.launch import message_limit, stall_timeout
from rlhf.planner.config_bridge import resolve_config
from rlhf.runtime import train
from rlhf.world_plan import WorldPlan, validate_for_world


def checked_for_world(cfg: Config, world: int) -> tuple[Config, WorldPlan]:
    """``cfg`` with its device and precision resolved for this rank, and its plan for
    ``world`` ranks; raises one of :data:`rlhf.train.INVALID` (normally a ValueError naming
    the setting, file or size and the fix) for the launch settings, the world, the tokenizer
    and the run's files.  Cheap: reads files and does arithmetic, builds nothing."""
    message_limit(None, os.environ)
    stall_timeout(None, os.environ)
    # placement.mode=auto: the planner picks placement and layouts (same on every rank)
    cfg, _ = resolve_devices(cfg)
    cfg = resolve_config(cfg, world)
    plan = validate_for_world(cfg, world)
    path = tokenizer_path(cfg)
    try:
        tok = tokenizer_of(cfg)
    except Exception as e:  # noqa: BLE001 - a user's tokenizer files, read by transformers
        if isinstance(e, ValueError) and str(path) in str(e):
            raise  # our own message, naming the folder
        raise ValueError(f"tokenizer={path!r} cannot be loaded: {one_line(e)}") from None
    check_run(cfg, tok)
    return cfg, plan


def launch(cfg: Config, plan: WorldPlan) -> int:
    """Rank 0 runs the controller program (:func:`rlhf.runtime.train`), every rank serves its
    workers on its device; the exit code of this rank."""
    device = resolve_device(cfg.device)  # resolved: cpu, or cuda:<LOCAL_RANK>
    return run(lambda ctl: train(ctl, cfg, plan), device=device)
