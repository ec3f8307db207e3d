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

import importlib

# Imported on first use, so that a module which needs one of them (a controller program's
# Batch) does not load the launch machinery, the sockets and the C++ extension with it.
_EXPORTS = {
    "Batch": "batch", "Controller": "controller", "TransferStats": "controller",
    "ControllerError": "errors", "RankLostError": "errors", "WorkerError": "errors",
    "Future": "futures", "run": "launch", "Worker": "worker", "WorkerGroup": "worker_group",
    **{name: "protocols" for name in (
        "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_METRIC", "DP_PROTO", "ONE_TO_ALL", "RANK_ZERO",
        "THREE_D_ALL_MICRO_DP", "THREE_D_PP_ONLY", "THREE_D_PROTO", "Plan", "Protocol",
        "get_protocol", "protocol", "register_protocol")},
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlhf.controller' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlhf.controller.{_EXPORTS[name]}"), name)
