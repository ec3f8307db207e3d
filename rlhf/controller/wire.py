"""Wire format of the control plane: pickle protocol 5 with tensors as raw out-of-band buffers,
decoded against an allow-list.

One message on a stream socket::

    +----------------+---------------+----------+------------------+--------------+-----+
    | u64 pickle len | u32 n_buffers | u16 kind | u64 len x n_bufs | pickle bytes | buf | ...
    +----------------+---------------+----------+------------------+--------------+-----+

``kind`` 0: the pickle is the object.  ``kind`` k > 0: the object is a message of class
``messages.MESSAGES[k - 1]`` and the pickle holds its field values (a pickled class reference
costs an import lookup on each side, more than the rest of a small command or reply).
:func:`recv_msg` refuses a frame whose header adds up to more than ``max_bytes`` (default
:data:`MAX_MESSAGE_BYTES`) before it allocates anything; :func:`send_msg` refuses to send one.

Tensors are not pickled through torch.save: each tensor becomes (dtype name, shape) in the
pickle plus its bytes as one out-of-band buffer that is written straight from the tensor's
memory and read straight into the receiving tensor's memory (``torch.frombuffer`` over the
receive buffer, no extra copy).  :func:`dumps`/:func:`loads` give the same format as one bytes
object.  Every tensor travels from host memory and arrives in host memory: a device tensor is
copied to the host where it is encoded (the only host synchronisation of the control and data
planes), and the worker moves its arguments to its device (:mod:`rlhf.controller.worker`).

Decoding runs no code chosen by the sender.  The unpickler resolves a global only from the
registry of this module (exact module and qualified name, never a prefix, never a subclass):

* containers, numbers, strings, bytes, None and bool, which pickle builds without any global;
* every message class of :data:`~rlhf.controller.messages.MESSAGES`;
* classes registered with :func:`allow` (a decorator: ``@wire.allow`` on the class, in the
  module that defines it, e.g. :class:`~rlhf.controller.batch.Batch`), and the classes that
  the runtime sends inside call arguments but whose modules must not import the controller
  (:data:`PROJECT_CLASSES`, imported by name when a message first names them);
* torch dtypes, ``torch.Size`` and ``torch.device``, a few inert value types of the standard
  library (complex, datetime, Decimal), and this module's own rebuild functions for tensors and
  numeric numpy values, which check dtype, shape and byte count before building anything.

Anything else raises :class:`UnsafeMessageError` naming the class, before the class is
imported or called.  The encoder applies the same list, so a value that the other side would
refuse fails where it is sent, with the same error.
"""

from __future__ import annotations

import datetime
import decimal
import importlib
import io
import math
import pickle
import re
import socket
import struct
import types
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from rlhf.controller.messages import MESSAGES, astuple

T = TypeVar("T")

MAX_MESSAGE_BYTES = 1 << 30
"""Default limit of one control-plane frame (header, pickle and tensor buffers): 1 GiB."""

_HEAD = struct.Struct("<QIH")
_LEN = struct.Struct("<Q")
_KIND = {cls: k for k, cls in enumerate(MESSAGES, start=1)}


class MessageError(ValueError):
    """A frame that the control plane refuses: malformed, too large, or naming a class that
    is not allowed.  The connection it came on must be dropped."""


class UnsafeMessageError(MessageError):
    """A message names a class or function outside the allow-list (at either end)."""


class MessageTooLargeError(MessageError):
    """A frame is larger than the configured maximum (``max_message_bytes``)."""


# Allow-list -----------------------------------------------------------------------------------
_GLOBALS: dict[tuple[str, str], Any] = {}
"""(module, qualname) -> the object a pickle may name: class, function or torch dtype."""
_IDS: set[int] = set()
"""``id`` of every class and function in :data:`_GLOBALS` (the encoder's check)."""
_ENCODABLE: set[type] = {list, tuple, dict, set, frozenset, bytearray, pickle.PickleBuffer}
"""Types whose instances the encoder passes to pickle as they are."""

PROJECT_CLASSES = frozenset({
    "engine.llama_spec:LlamaConfig",
    "engine.lora_config:LoraConfig",
    "engine.optim_config:OptimConfig",
    "engine.rope:RopeScaling",
    "engine.sampling:SamplingParams",
    "hybridflow_comm.devices:Precision",
    "rlhf.algos.kl:KLLossTerm",
    "rlhf.config_roles:PolicyLossConfig",
    "rlhf.config_roles:ValueLossConfig",
    "rlhf.config_run:RolloutConfig",
    "rlhf.config_run:SandboxConfig",
    "rlhf.task.arithmetic:CostRule",
    "rlhf.workers.specs:ActorSpec",
    "rlhf.workers.specs:CriticSpec",
    "rlhf.workers.specs:ModelSpec",
    "rlhf.workers.specs:OverlongShaping",
    "rlhf.workers.specs:ReferenceSpec",
    "rlhf.workers.specs:ScoreSpec",
    "rlhf.workers.specs:UpdateSpec",
    "rlhf.workers.rollout:RolloutSpec",
    "rlhf.workers.rollout:SyncSpec",
})
"""``module:qualname`` of the frozen dataclasses that worker groups are created or called with
(worker specs, the configs they embed, sampling parameters).  Named, not imported: the engine
must not import the controller, and the controller must not import the workers."""
_NAMED = {tuple(path.split(":")) for path in PROJECT_CLASSES}


def allow(obj: T) -> T:
    """Let a class (its instances) or a function travel on the control plane; returns ``obj``.

    Use as a class decorator in the module that defines the class.  The class is allowed by
    exact module and qualified name: subclasses are not, and every rank that decodes it must
    have imported the defining module (the worker program's imports do that).

    Raises:
        TypeError: ``obj`` is not a class or function defined at module level.
    """
    if not (isinstance(obj, type) or callable(obj)) or not hasattr(obj, "__qualname__"):
        raise TypeError(f"wire.allow takes a class or a function, got {obj!r}")
    if "<locals>" in obj.__qualname__ or "<lambda>" in obj.__qualname__:
        raise TypeError(f"{obj.__qualname__} must be defined at module level to travel on the "
                        f"control plane (the receiver finds it by module and name)")
    replaced = _GLOBALS.get((obj.__module__, obj.__qualname__))
    if replaced is not None:  # a reloaded module: its old objects may be freed, ids reused
        _IDS.discard(id(replaced))
        _ENCODABLE.discard(replaced)
    _GLOBALS[(obj.__module__, obj.__qualname__)] = obj
    _IDS.add(id(obj))
    if isinstance(obj, type):
        _ENCODABLE.add(obj)
    return obj


def _lookup(module: str, name: str) -> Any:
    """The allowed object named by a pickle (the unpickler's ``find_class``)."""
    obj = _GLOBALS.get((module, name))
    if obj is None and (module, name) in _NAMED:
        obj = _import_named(module, name)
    if obj is None:
        raise UnsafeMessageError(
            f"refused to decode {module}.{name}: it is not on the control plane's allow-list "
            f"(register a class with rlhf.controller.wire.allow in the module that defines it, "
            f"and import that module on every rank)")
    return obj


def _import_named(module: str, name: str) -> type:
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise UnsafeMessageError(f"{module}.{name} in PROJECT_CLASSES is not a class")
    return allow(obj)


def _admit(obj: Any) -> Any:
    """Encoder check of an object that is not yet known to be allowed (slow path)."""
    if isinstance(obj, type):
        cls, what = obj, "the class"
    elif isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        cls, what = None, "the function"
    else:
        cls, what = type(obj), "an instance of"
    if cls is not None:
        key = (cls.__module__, cls.__qualname__)
        if key in _NAMED and _import_named(*key) is cls:
            return NotImplemented
    else:
        key = (getattr(obj, "__module__", "?"), getattr(obj, "__qualname__", repr(obj)))
    raise UnsafeMessageError(
        f"cannot send {what} {key[0]}.{key[1]} on the control plane: it is not on the "
        f"allow-list (register it with rlhf.controller.wire.allow in the module that defines "
        f"it, or send plain values: containers, numbers, strings, tensors)")


# Tensors and numpy values -------------------------------------------------------------------
_TORCH_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)}
_NUMPY_DTYPE = re.compile(r"[<>|=][biufc][0-9]{1,2}")


def _check_shape(shape: Any, nbytes: int, itemsize: int, what: str) -> int:
    if type(shape) is not tuple or not all(type(d) is int and 0 <= d < 1 << 63 for d in shape):
        raise MessageError(f"{what}: shape {shape!r:.80} is not a tuple of sizes")
    numel = math.prod(shape)
    if numel * itemsize != nbytes:
        raise MessageError(f"{what} of shape {shape} needs {numel * itemsize} bytes, the "
                           f"message carries {nbytes}")
    return numel


def _buffer(buf: Any, what: str) -> memoryview:
    if not isinstance(buf, (bytearray, bytes, memoryview)):
        raise MessageError(f"{what}: data is a {type(buf).__name__}, not a buffer")
    return memoryview(buf)


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = _TORCH_DTYPES.get(dtype) if type(dtype) is str else None
    if dt is None:
        raise UnsafeMessageError(f"refused a tensor of dtype {dtype!r:.40}: not one of "
                                 f"{sorted(_TORCH_DTYPES)}")
    view = _buffer(buf, "tensor")
    if not _check_shape(shape, view.nbytes, dt.itemsize, "tensor"):
        return torch.empty(shape, dtype=dt, device="cpu")
    if view.readonly:
        buf = bytearray(view)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)


def _rebuild_numpy(buf: Any, dtype: str, shape: tuple[int, ...] | None) -> Any:
    if type(dtype) is not str or not _NUMPY_DTYPE.fullmatch(dtype):
        raise UnsafeMessageError(f"refused a numpy value of dtype {dtype!r:.40}: only bool "
                                 f"and numeric dtypes travel")
    dt = np.dtype(dtype)
    view = _buffer(buf, "numpy value")
    if shape is None:  # a scalar
        _check_shape((), view.nbytes, dt.itemsize, "numpy scalar")
        return np.frombuffer(view, dtype=dt)[0]
    _check_shape(shape, view.nbytes, dt.itemsize, "numpy array")
    return np.frombuffer(view if not view.readonly else bytearray(view), dtype=dt).reshape(shape)


def _reduce_tensor(obj: torch.Tensor) -> tuple:
    if obj.layout != torch.strided or obj.is_quantized:
        raise UnsafeMessageError(f"cannot send a {obj.layout} tensor of {obj.dtype} on the "
                                 f"control plane: only dense tensors travel (use .to_dense() or "
                                 f".dequantize())")
    # Host synchronisation: the one place where a worker's device tensors move to the host
    # (replies to the controller and rows for another rank's data plane, both host bytes).
    t = obj.detach().cpu().contiguous()
    name = str(t.dtype).split(".")[-1]
    if name not in _TORCH_DTYPES:
        raise UnsafeMessageError(f"cannot send a tensor of {t.dtype} on the control plane")
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return _rebuild_tensor, (pickle.PickleBuffer(raw), name, tuple(t.shape))


def _reduce_numpy(obj: np.ndarray | np.generic) -> tuple:
    if not _NUMPY_DTYPE.fullmatch(obj.dtype.str):
        raise UnsafeMessageError(f"cannot send a numpy value of dtype {obj.dtype} on the "
                                 f"control plane: only bool and numeric dtypes travel")
    if isinstance(obj, np.generic):
        return _rebuild_numpy, (obj.tobytes(), obj.dtype.str, None)
    arr = obj if obj.flags.c_contiguous else obj.copy(order="C")
    return _rebuild_numpy, (pickle.PickleBuffer(arr.reshape(-1).view(np.uint8)), arr.dtype.str,
                            tuple(arr.shape))


for _obj in (*MESSAGES, _rebuild_tensor, _rebuild_numpy, torch.Size, torch.device, complex,
             datetime.date, datetime.datetime, datetime.time, datetime.timedelta,
             datetime.timezone, decimal.Decimal):
    allow(_obj)
for _name, _dtype in _TORCH_DTYPES.items():  # a dtype pickles as the global torch.<name>
    _GLOBALS[("torch", _name)] = _dtype
    _IDS.add(id(_dtype))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _ENCODABLE or id(obj) in _IDS:
            return NotImplemented
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        if isinstance(obj, (np.ndarray, np.generic)):
            return _reduce_numpy(obj)
        return _admit(obj)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _lookup(module, name)


# Frames -------------------------------------------------------------------------------------
def encode(obj: Any) -> tuple[int, bytes, list[memoryview]]:
    """Pickle ``obj``; returns its kind, the pickle bytes and the out-of-band tensor buffers.

    Raises:
        UnsafeMessageError: ``obj`` holds a value the receiver would refuse to decode.
    """
    kind = _KIND.get(type(obj), 0)
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    try:
        _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(
            astuple(obj) if kind else obj)
    except MessageError:
        raise
    except (pickle.PicklingError, TypeError) as exc:
        raise UnsafeMessageError(f"cannot encode {type(obj).__name__}: {exc}") from None
    return kind, out.getvalue(), [b.raw() for b in buffers]


def decode(kind: int, data: bytes | memoryview, buffers: list) -> Any:
    """The object that :func:`encode` gave ``(kind, data, buffers)`` for.

    Raises:
        UnsafeMessageError: the pickle names a class or function outside the allow-list.
        MessageError: anything else malformed (unknown kind, bad tensor metadata, ...).
    """
    try:
        obj = _Unpickler(io.BytesIO(data), buffers=buffers).load()
    except MessageError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a malformed pickle raises
        raise MessageError(f"malformed message: {type(exc).__name__}: {exc}") from None
    if not kind:
        return obj
    if kind > len(MESSAGES):
        raise MessageError(f"message kind {kind} is not one of the {len(MESSAGES)} known kinds")
    cls = MESSAGES[kind - 1]
    if type(obj) is not tuple:
        raise MessageError(f"a {cls.__name__} message holds a {type(obj).__name__}, not its "
                           f"field values")
    try:
        return cls(*obj)
    except TypeError as exc:
        raise MessageError(f"malformed {cls.__name__} message: {exc}") from None


@dataclass(slots=True)
class Frame:
    """One encoded message, ready to be written (see :func:`frame`)."""

    parts: list
    """Header, pickle bytes, then the raw tensor buffers."""
    total: int
    """Bytes of the whole frame."""
    payload: int
    """Of which raw tensor bytes."""


def frame(obj: Any, max_bytes: int | None = MAX_MESSAGE_BYTES) -> Frame:
    """Encode ``obj`` as one frame; MessageError if it is refused or larger than ``max_bytes``
    (None: no limit)."""
    kind, data, bufs = encode(obj)
    head = _HEAD.pack(len(data), len(bufs), kind) + b"".join(_LEN.pack(b.nbytes) for b in bufs)
    payload = sum(b.nbytes for b in bufs)
    total = len(head) + len(data) + payload
    if max_bytes is not None and total > max_bytes:
        raise MessageTooLargeError(
            f"a {type(obj).__name__} message of {total} bytes is larger than max_message_bytes="
            f"{max_bytes} (raise run(max_message_bytes=...) or HYBRIDFLOW_MAX_MESSAGE_BYTES on "
            f"every rank, or keep big values on the workers)")
    return Frame([head, data, *bufs], total, payload)


def dumps(obj: Any) -> bytes:
    """One frame as bytes (no size limit: the data plane sends batches this way)."""
    return b"".join(frame(obj, max_bytes=None).parts)


def loads(blob: bytes | bytearray | memoryview) -> Any:
    """The object of one frame held in memory (MessageError if it is malformed)."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _HEAD.size:
        raise MessageError(f"a frame of {view.nbytes} bytes is shorter than its header")
    n_data, n_bufs, kind = _HEAD.unpack_from(view, 0)
    pos = _HEAD.size + n_bufs * _LEN.size
    if pos + n_data > view.nbytes:
        raise MessageError(f"truncated frame: the header announces {n_bufs} buffers and "
                           f"{n_data} pickle bytes, the frame has {view.nbytes} bytes")
    lens = [_LEN.unpack_from(view, _HEAD.size + i * _LEN.size)[0] for i in range(n_bufs)]
    if pos + n_data + sum(lens) != view.nbytes:
        raise MessageError(f"frame of {view.nbytes} bytes, its header adds up to "
                           f"{pos + n_data + sum(lens)}")
    data = view[pos:pos + n_data]
    pos += n_data
    bufs = []
    for n in lens:
        bufs.append(bytearray(view[pos:pos + n]))  # own, writable memory for the tensors
        pos += n
    return decode(kind, data, bufs)


def send_frame(sock: socket.socket, f: Frame) -> tuple[int, int]:
    """Write one frame; returns (bytes written, of which raw tensor bytes)."""
    if f.total <= 65536:
        sock.sendall(b"".join(f.parts))
    else:
        sock.sendall(f.parts[0] + f.parts[1])
        for b in f.parts[2:]:
            sock.sendall(b)
    return f.total, f.payload


def send_msg(sock: socket.socket, obj: Any, max_bytes: int = MAX_MESSAGE_BYTES
             ) -> tuple[int, int]:
    """Send one message; returns (bytes written, of which raw tensor bytes).

    Raises:
        MessageError: ``obj`` would be refused by the receiver (nothing is written then).
    """
    return send_frame(sock, frame(obj, max_bytes))


def _recv_into(sock: socket.socket, buf: bytearray | memoryview) -> None:
    view = memoryview(buf)
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def recv_msg(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[Any, int, int]:
    """Receive one message; returns (object, bytes read, of which raw tensor bytes).

    Raises:
        ConnectionError: the peer closed the connection.
        MessageTooLargeError: the header announces more than ``max_bytes`` (nothing of the
            body is allocated or read: drop the connection).
        MessageError: the frame is malformed or names a class outside the allow-list.
    """
    head = bytearray(_HEAD.size)
    _recv_into(sock, head)
    n_data, n_bufs, kind = _HEAD.unpack(head)
    if _HEAD.size + n_bufs * _LEN.size + n_data > max_bytes:
        raise MessageTooLargeError(f"refused a frame announcing {n_bufs} buffers and {n_data} "
                                   f"pickle bytes: more than max_message_bytes={max_bytes}")
    lens_raw = bytearray(n_bufs * _LEN.size)
    _recv_into(sock, lens_raw)
    lens = [_LEN.unpack_from(lens_raw, i * _LEN.size)[0] for i in range(n_bufs)]
    total = _HEAD.size + len(lens_raw) + n_data + sum(lens)
    if total > max_bytes:
        raise MessageTooLargeError(f"refused a frame of {total} bytes: more than "
                                   f"max_message_bytes={max_bytes}")
    data = bytearray(n_data)
    _recv_into(sock, data)
    bufs = []
    for n in lens:
        b = bytearray(n)
        _recv_into(sock, b)
        bufs.append(b)
    return decode(kind, data, bufs), total, sum(lens)
