"""The single controller of HybridFlow: worker groups, transfer protocols, futures, launch.

A PPO iteration reads like the paper's::

    gen = actor.generate_sequences(prompts)      # Future at once
    values = critic.compute_values(gen)           # critic ranks pull their rows from the actor
    ref = reference.compute_ref_log_prob(gen)
    ...

Modules, each importing only modules listed before it (no import cycle): :mod:`.errors`,
:mod:`.messages` (every controller/worker message), :mod:`.wire` (encoding), :mod:`.batch`
(Batch container), :mod:`.protocols` (protocols, registry, decorator), :mod:`.calls` (issued
calls and the controller interface that groups and futures use), :mod:`.worker` (Worker base,
per-rank loop, data plane), :mod:`.futures`, :mod:`.worker_group`, :mod:`.controller`,
:mod:`.handshake` (who may connect), :mod:`.rendezvous` (where to connect, the job's secret),
:mod:`.launch` (``run`` under torchrun).
"""

from rlhf.controller.batch import Batch
from rlhf.controller.controller import Controller, TransferStats
from rlhf.controller.errors import ControllerError, RankLostError, WorkerError
from rlhf.controller.futures import Future
from rlhf.controller.launch import run
from rlhf.controller.protocols import (ALL_TO_ALL, DP_COMPUTE, DP_COMPUTE_METRIC, DP_PROTO,
                                       ONE_TO_ALL, RANK_ZERO, THREE_D_ALL_MICRO_DP,
                                       THREE_D_PP_ONLY, THREE_D_PROTO, Plan, Protocol,
                                       get_protocol, protocol, register_protocol)
from rlhf.controller.worker import Worker
from rlhf.controller.worker_group import WorkerGroup

__all__ = ["Batch", "Controller", "TransferStats", "ControllerError", "RankLostError",
           "WorkerError", "Future", "run", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_METRIC",
           "DP_PROTO", "ONE_TO_ALL", "RANK_ZERO", "THREE_D_ALL_MICRO_DP", "THREE_D_PP_ONLY",
           "THREE_D_PROTO", "Plan", "Protocol", "get_protocol", "protocol", "register_protocol",
           "Worker", "WorkerGroup"]
