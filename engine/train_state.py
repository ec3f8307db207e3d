"""A training engine's state beside the parameters: the flat gradient buffers, the float32
master weights of low-precision parameters (with the hook that accumulates into them), and the
state offloaded to host memory between steps (:class:`engine.train.TrainEngine` owns them).

Gradients live in one flat buffer per dtype holding this rank's training parameters, each
``param.grad`` a view at a fixed offset (autograd accumulates into it in place)::

    GradBuffer[float32]   (no padding; parameter order = forward order of the stage)
    | embed_tokens | layers.0.input_norm | layers.0.qkv | ... | norm | lm_head |
    |<-- bucket 0 (bucket_numel) -->|<-- bucket 1 -->|<-- ...   -->|<- last ->|

Mixed precision.  Under a :class:`~hybridflow_comm.devices.Precision` with
``master_weights`` (``bf16``) the optimizer trains float32 master weights and the parameters
are their low-precision copies::

    model.params  (bf16 views of the FlatParamBuffer: forward, backward, the resharder)
    | embed_tokens | layers.0.input_norm | ... | lm_head |      p.grad: None between hooks
          |  per micro-batch: post-accumulate hook adds p.grad (bf16) into the fp32 view,
          v  then sets p.grad = None (Megatron's main_grad; add_grad_into)
    GradBuffer[float32]   master.grad views, same order and offsets as the masters
    | embed_tokens | layers.0.input_norm | ... | lm_head |      DP all-reduce, clip
          |  AdamW (fused; exp_avg, exp_avg_sq float32, keyed by the masters)
          v
    MasterWeights[float32]  one flat tensor per parameter dtype, a view per parameter
    | embed_tokens | layers.0.input_norm | ... | lm_head |
          |  after every step: copied into the bf16 params in place (never re-allocated)
          v
    model.params

In ``fp32`` there are no masters: the parameters themselves are trained, exactly as above.

Between steps (while the actor generates) the masters and the Adam state can leave the device
for host memory and the gradient buffer be freed (:class:`OffloadedState`); the parameters
always stay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _flat_offsets(params: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, int], dict[torch.dtype, int]]:
    """Each parameter's offset in the flat tensor of its dtype, and each flat tensor's size
    (parameters back to back in the given order, no padding)."""
    offsets: dict[str, int] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, p in params.items():
        offsets[name] = sizes.get(p.dtype, 0)
        sizes[p.dtype] = offsets[name] + p.numel()
    return offsets, sizes


def params_device(params: dict[str, torch.Tensor]) -> torch.device:
    """The one device every tensor of ``params`` lives on."""
    devices = {p.device for p in params.values()}
    if len(devices) != 1:
        raise ValueError(f"the parameters must live on one device, got {devices}")
    return devices.pop()


class GradBuffer:
    """One flat gradient storage per dtype; ``param.grad`` of every parameter is a view of it."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        device = params_device(params)
        self.offsets, sizes = _flat_offsets(params)
        self.flat: dict[torch.dtype, torch.Tensor] = {
            dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        for name, p in params.items():
            off = self.offsets[name]
            p.grad = self.flat[p.dtype][off:off + p.numel()].view_as(p)

    def zero_(self) -> None:
        for t in self.flat.values():
            t.zero_()

    def buckets(self, bucket_numel: int) -> list[torch.Tensor]:
        """Contiguous slices of at most ``bucket_numel`` elements covering every buffer."""
        return [t[i:i + bucket_numel] for t in self.flat.values()
                for i in range(0, t.numel(), bucket_numel)]


class MasterWeights:
    """Float32 master copies of low-precision parameters (module docstring's diagram).

    Args:
        params: the model's parameters by name (any dtype); the masters start as their values.

    Attributes:
        flat: one float32 tensor per parameter dtype, the masters of that dtype back to back.
        params: by name, a float32 ``nn.Parameter`` viewing its slice of ``flat`` (what the
            optimizer steps; never part of an autograd graph).
    """

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        device = params_device(params)
        offsets, sizes = _flat_offsets(params)
        self.flat: dict[torch.dtype, torch.Tensor] = {
            dtype: torch.empty(n, dtype=torch.float32, device=device)
            for dtype, n in sizes.items()}
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, p in params.items():
            view = self.flat[p.dtype][offsets[name]:offsets[name] + p.numel()].view_as(p)
            self.params[name] = torch.nn.Parameter(view)  # shares the flat tensor's storage
        self.copy_from_(params)

    @torch.no_grad()
    def copy_from_(self, params: dict[str, torch.Tensor]) -> None:
        """Masters <- ``params`` (upcast), e.g. after weights were loaded into the model."""
        torch._foreach_copy_([self.params[n] for n in params], list(params.values()))

    @torch.no_grad()
    def copy_to_(self, params: dict[str, torch.Tensor]) -> None:
        """``params`` <- masters, rounded to each parameter's dtype, in place."""
        torch._foreach_copy_(list(params.values()), [self.params[n] for n in params])


def add_grad_into(main_grad: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Post-accumulate hook of a low-precision parameter: its micro-batch gradient is added
    into ``main_grad`` (float32) and dropped, so no low-precision sum ever builds up."""

    def hook(p: torch.Tensor) -> None:
        main_grad.add_(p.grad)
        p.grad = None

    return hook


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as one uint8 tensor (the bytes every view of it shares)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class OffloadedState:
    """Device storages given back while their tensors and views stay valid (FSDP's trick).

    A storage is resized to 0 bytes and later to its size again; every tensor viewing it
    (``param.grad``, a master's ``nn.Parameter``, an Adam moment) holds the storage object,
    not the address, so it reads the new allocation after :meth:`restore`::

        offload:  device storage --copy--> host bytes (pinned on CUDA);  storage.resize_(0)
        restore:  storage.resize_(nbytes);  host bytes --copy--> device storage

    Args:
        kept: tensors whose storages' contents are copied to the host and back.
        dropped: tensors whose storages are freed and re-allocated uninitialised (the
            gradient buffer, zeroed at the start of every step).
        pin: host copies in pinned memory (CUDA: asynchronous copies on the current stream,
            ordered before any later use of the freed device blocks).

    Attributes:
        device_nbytes: device bytes given back.
    """

    def __init__(self, kept: list[torch.Tensor], dropped: list[torch.Tensor],
                 pin: bool) -> None:
        self.pin = pin
        self.kept = [(t, self._to_host(t, pin)) for t in kept]
        self.dropped = [(t, t.untyped_storage().nbytes()) for t in dropped]
        self.device_nbytes = (sum(host.numel() for _, host in self.kept)
                              + sum(n for _, n in self.dropped))
        for t in kept + dropped:
            t.untyped_storage().resize_(0)

    @staticmethod
    def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
        raw = _storage_bytes(t)
        host = torch.empty(raw.numel(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        return host.copy_(raw, non_blocking=pin)

    def restore(self) -> None:
        """Re-allocate every storage; the kept ones get their bytes back."""
        for t, n in self.dropped:
            t.untyped_storage().resize_(n)
        for t, host in self.kept:
            t.untyped_storage().resize_(host.numel())
            _storage_bytes(t).copy_(host, non_blocking=self.pin)
        self.kept, self.dropped = [], []
