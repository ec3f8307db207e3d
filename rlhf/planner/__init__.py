"""Auto-mapping: place the models of an RLHF dataflow on devices and pick their parallelism.

Modules: :mod:`models` (sizes), :mod:`dataflow` (algorithms, workload), :mod:`partitions`
(placements, allocations), :mod:`strategy` (per-model layouts), :mod:`memory`,
:mod:`simulator`, :mod:`profile` (device constants), :mod:`search` (the planner),
:mod:`calibrate` (measure this machine), :mod:`report` (table, JSON), :mod:`config_bridge`
(plan -> :mod:`rlhf.config` overrides).
"""

from rlhf.planner.dataflow import DATAFLOWS, STAGES, Dataflow, RoleSpec, Workload, build_dataflow
from rlhf.planner.models import PRESETS, ModelShape, model_shape
from rlhf.planner.profile import DeviceProfile, load_profile
from rlhf.planner.search import Mapping, Planner, SetPlan
from rlhf.planner.strategy import Strategy

__all__ = ["DATAFLOWS", "STAGES", "Dataflow", "RoleSpec", "Workload", "build_dataflow",
           "PRESETS", "ModelShape", "model_shape", "DeviceProfile", "load_profile", "Mapping",
           "Planner", "SetPlan", "Strategy"]
