"""Device profiles: the constants of the simulator, one JSON file per accelerator.

Shipped profiles live in ``rlhf/planner/profiles/*.json`` (``a100-80gb``, ``h100-80gb``,
``cpu``); ``python -m rlhf.plan --calibrate PATH`` measures this machine into a new file (see
:mod:`rlhf.planner.calibrate`).  Bandwidths are per device in bytes/s, FLOPs per device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


@dataclass(frozen=True)
class DeviceProfile:
    """Speeds and sizes of one device type and its interconnect."""

    name: str
    """Label (e.g. ``a100-80gb``)."""
    memory_gb: float
    """Memory per device in GiB."""
    peak_flops: float
    """Dense matmul peak, FLOP/s, in the training dtype."""
    mfu_train: float
    """Fraction of peak reached by training (forward + backward) matmuls."""
    mfu_infer: float
    """Fraction of peak reached by forward-only passes and prefill."""
    mem_bw: float
    """Memory bandwidth, bytes/s."""
    mem_bw_eff: float
    """Fraction of ``mem_bw`` reached by a decode step (weights + KV cache reads)."""
    per_node: int
    """Devices per node (collectives inside a node use ``intra_bw``)."""
    intra_bw: float
    """Collective bandwidth per device inside a node, bytes/s."""
    inter_bw: float
    """Collective bandwidth per device across nodes, bytes/s."""
    intra_latency_s: float
    """Fixed cost of one collective inside a node."""
    inter_latency_s: float
    """Fixed cost of one collective across nodes."""
    layer_overhead_s: float
    """Fixed cost of running one layer once (kernel launches, Python), per micro-batch/step."""
    call_overhead_s: float
    """Fixed cost of one worker call from the controller (dispatch, collect)."""
    param_bytes: int = 2
    """Bytes per weight."""
    grad_bytes: int = 2
    """Bytes per gradient element."""
    optim_bytes: int = 12
    """Optimizer bytes per parameter (Adam: fp32 master + m + v = 12; fp32 training: 8)."""
    act_bytes: int = 2
    """Bytes per activation element (and KV cache element)."""
    memory_reserve: float = 0.1
    """Fraction of device memory kept free (allocator fragmentation, workspace)."""
    host_cores: int = 0
    """CPU ranks sharing one machine: ``k`` busy ranks run ``k / min(k, host_cores)`` times
    slower.  0 = devices are independent (accelerators)."""
    notes: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for f in ("memory_gb", "peak_flops", "mem_bw", "intra_bw", "inter_bw", "per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"profile {self.name!r}: {f}={v!r} must be > 0")
        for f in ("mfu_train", "mfu_infer", "mem_bw_eff"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"profile {self.name!r}: {f}={v!r} must be in (0, 1]")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"profile {self.name!r}: memory_reserve={self.memory_reserve} "
                             f"must be in [0, 1)")

    @property
    def usable_bytes(self) -> float:
        """Memory a plan may fill on one device."""
        return self.memory_gb * 2**30 * (1 - self.memory_reserve)

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a collective over ``span`` consecutive devices."""
        if span <= self.per_node:
            return self.intra_bw, self.intra_latency_s
        return self.inter_bw, self.inter_latency_s

    def slowdown(self, busy: int) -> float:
        """How much slower each of ``busy`` devices runs because they share host cores."""
        if not self.host_cores or busy <= self.host_cores:
            return 1.0
        return busy / self.host_cores

    def with_memory(self, memory_gb: float) -> DeviceProfile:
        return dataclasses.replace(self, memory_gb=memory_gb)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def shipped_profiles() -> list[str]:
    return sorted(f[:-5].replace("_", "-") for f in os.listdir(PROFILES_DIR)
                  if f.endswith(".json"))


def profile_from_dict(data: dict) -> DeviceProfile:
    names = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"profile has unknown keys {unknown}; valid keys: {sorted(names)}")
    try:
        return DeviceProfile(**data)
    except TypeError as e:
        raise ValueError(f"profile {data.get('name')!r}: {e}") from None


def load_profile(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name (``a100-80gb``) or a JSON file path."""
    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(PROFILES_DIR, name_or_path.lower().replace("-", "_") + ".json")
    if not os.path.isfile(path):
        raise ValueError(f"profile={name_or_path!r} is neither a file nor a shipped profile "
                         f"({shipped_profiles()})")
    with open(path, encoding="utf-8") as f:
        return profile_from_dict(json.load(f))


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=2)
        f.write("\n")
