"""Which device a rank computes on, in which precision, and its process groups.

One rank drives one device.  The choices are made once per process, before any process group
exists, so a bad request is a one-line ``ValueError`` and never a hang::

    device     auto -> cuda:<LOCAL_RANK> when CUDA is available, else cpu
    precision  auto -> bf16 on cuda, fp32 on cpu, into one :class:`Precision` value:
               fp32 = fp32 parameters and compute, no master weights
               bf16 = bf16 parameters and compute; trained models keep fp32 master weights,
               fp32 gradients and fp32 optimizer state (engine.train)

    backend    cpu  -> "gloo"
               cuda -> "cpu:gloo,cuda:nccl": every group runs device tensors over NCCL and
               host tensors over gloo; the NCCL communicator is created eagerly (device_id)

Groups that only ever carry host tensors (the runtime's data plane) are created with
``backend="gloo"`` by their owners.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Precision:
    """A resolved precision (no ``auto``): the one value the builders, the SFT entry and the
    engines take, so that none of them decides it again from a name or a tensor.

    Example::

        precision = resolve_precision("auto", torch.device("cpu"))   # FP32
        LlamaConfig(..., dtype=precision.param_dtype)
        TrainEngine(model, optim, precision=precision)   # masters iff precision.master_weights
    """

    name: str
    """``fp32`` or ``bf16``: the config's value once resolved (what the saved config says);
    ``fp64`` for the tests' float64 reference models."""
    param_dtype: torch.dtype
    """Dtype of every parameter and of the compute (activations, KV cache)."""
    master_weights: bool
    """A trained model keeps float32 master weights, gradients and optimizer state beside its
    16-bit parameters (:class:`engine.train_state.MasterWeights`)."""

    @staticmethod
    def named(name: str) -> Precision:
        """The value of a resolved precision name (a resolved config's ``precision``).

        Raises:
            ValueError for ``auto`` (only :func:`resolve_precision` reads it, on the rank's
            device) or an unknown name.
        """
        if name == "auto":
            raise ValueError("precision='auto' is not resolved: it depends on the device "
                             "(resolve it once per rank with rlhf.config.resolve_devices or "
                             "hybridflow_comm.devices.resolve_precision)")
        try:
            return RESOLVED[name]
        except KeyError:
            raise ValueError(f"precision={name!r} must be one of {tuple(RESOLVED)}") from None

    def check_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming this precision and the parameters whose dtype is not its
        ``param_dtype`` (a model built in another precision than the engine was given)."""
        wrong = {n: p.dtype for n, p in params.items() if p.dtype != self.param_dtype}
        if wrong:
            shown = ", ".join(f"{n}: {d}" for n, d in list(wrong.items())[:3])
            more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
            raise ValueError(f"precision={self.name} trains {self.param_dtype} parameters, but "
                             f"{len(wrong)} of the model's are not ({shown}{more}); build the "
                             f"model in the run's precision (LlamaConfig.dtype="
                             f"{self.param_dtype})")

    @staticmethod
    def of_dtype(dtype: torch.dtype) -> Precision:
        """The precision whose parameters are ``dtype`` (a model built by hand in its
        config's dtype); ValueError for a dtype no precision trains."""
        known = (*RESOLVED.values(), FP64)
        for p in known:
            if p.param_dtype == dtype:
                return p
        names = ", ".join(f"{p.name}: {p.param_dtype}" for p in known)
        raise ValueError(f"no precision has {dtype} parameters ({names})")


FP32 = Precision("fp32", torch.float32, master_weights=False)
BF16 = Precision("bf16", torch.bfloat16, master_weights=True)
RESOLVED = {p.name: p for p in (FP32, BF16)}
"""Every resolved precision by name (the config's values other than ``auto``)."""
FP64 = Precision("fp64", torch.float64, master_weights=False)
"""Float64 reference models (tests compare against them); not a config value."""


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """``LOCAL_RANK`` (set by torchrun), else 0."""
    value = (os.environ if env is None else env).get("LOCAL_RANK", "0")
    try:
        rank = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={value!r} is not a rank number") from None
    if rank < 0:
        raise ValueError(f"LOCAL_RANK={rank} must be >= 0")
    return rank


def resolve_device(name: str = "auto", rank_on_node: int | None = None) -> torch.device:
    """The device this process computes on.

    Args:
        name: ``auto``, ``cpu`` or ``cuda``.
        rank_on_node: index of the GPU (default: ``LOCAL_RANK``).

    Raises:
        ValueError naming the request when it cannot be met (CUDA asked for but absent, fewer
        GPUs than ranks on the node).
    """
    if name not in DEVICES:
        raise ValueError(f"device={name!r} must be one of {DEVICES}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device=cuda but this machine has no usable CUDA device "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                         "use device=cpu or device=auto")
    index = local_rank() if rank_on_node is None else rank_on_node
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"local rank {index} has no GPU: this node has {count} "
                         f"(start at most {count} ranks per node: torchrun "
                         f"--nproc_per_node={count})")
    return torch.device("cuda", index)


def resolve_precision(precision: str, device: torch.device) -> Precision:
    """The precision a rank on ``device`` computes in: the one place ``auto`` is read (bf16 on
    CUDA, fp32 on CPU).

    Args:
        precision: ``auto``, ``fp32`` or ``bf16`` (the config's ``precision``).
        device: the rank's device (:func:`resolve_device`).
    Raises:
        ValueError when the device cannot compute in the requested precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16" and device.type == "cuda" \
            and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"precision=bf16 but {torch.cuda.get_device_name(device)} has no "
                         f"native bf16 (compute capability "
                         f"{torch.cuda.get_device_capability(device)} < (8, 0)); use "
                         f"precision=fp32")
    return Precision.named(precision)


def precision_dtype(precision: str) -> torch.dtype:
    """Parameter and compute dtype of a resolved precision name (:meth:`Precision.named`)."""
    return Precision.named(precision).param_dtype


def backend_for(device: torch.device) -> str:
    """The default process-group backend of a job computing on ``device``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def use_device(device: torch.device) -> None:
    """Make ``device`` current in the calling thread (CUDA keeps one per thread); no-op on
    CPU.  Every thread that launches device work calls it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def init_process_group(device: torch.device, timeout_s: float, **kwargs) -> None:
    """``dist.init_process_group`` for a job computing on ``device`` (the environment from
    torchrun unless ``kwargs`` say otherwise): gloo on CPU; gloo for host tensors and NCCL,
    initialised eagerly on ``device``, for CUDA tensors."""
    use_device(device)
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s),
                            **kwargs)
