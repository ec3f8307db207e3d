"""hybridflow_comm: layouts, flat parameter buffers, process groups and resharding.

The low-level toolkit of HybridFlow. Pure layout maths lives in :mod:`.layout`; the C++ core
(``hybridflow_comm._C``) owns page-aligned flat storages and multi-threaded pack/unpack.
"""

from hybridflow_comm.flat_buffer import FlatParamBuffer, SlotSpec
from hybridflow_comm.groups import Group, HybridGroups, build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

__all__ = ["FlatParamBuffer", "SlotSpec", "Group", "HybridGroups", "build_hybrid_groups",
           "HybridLayout", "ParallelLayout"]
