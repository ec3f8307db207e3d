"""Wire format of the control plane: pickle protocol 5 with tensors as raw out-of-band buffers.

One message on a stream socket::

    +----------------+---------------+----------+------------------+--------------+-----+
    | u64 pickle len | u32 n_buffers | u16 kind | u64 len x n_bufs | pickle bytes | buf | ...
    +----------------+---------------+----------+------------------+--------------+-----+

``kind`` 0: the pickle is the object.  ``kind`` k > 0: the object is a message of class
``messages.MESSAGES[k - 1]`` and the pickle holds its field values (a pickled class reference
costs an import lookup on each side, more than the rest of a small command or reply).

Tensors are not pickled through torch.save: each tensor becomes (dtype, shape) in the pickle
plus its bytes as one out-of-band buffer that is written straight from the tensor's memory and
read straight into the receiving tensor's memory (``torch.frombuffer`` over the receive buffer,
no extra copy).  :func:`dumps`/:func:`loads` give the same format as one bytes object.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
from typing import Any

import torch

from rlhf.controller.messages import MESSAGES, astuple

_HEAD = struct.Struct("<QIH")
_LEN = struct.Struct("<Q")
_KIND = {cls: k for k, cls in enumerate(MESSAGES, start=1)}


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not shape or 0 not in shape:
        flat = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf)) else None
        if flat is not None:
            return flat.view(dt).reshape(shape)
    return torch.empty(shape, dtype=dt)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_quantized:
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            return _rebuild_tensor, (pickle.PickleBuffer(raw), str(t.dtype).split(".")[-1],
                                     tuple(t.shape))
        return NotImplemented


def encode(obj: Any) -> tuple[int, bytes, list[memoryview]]:
    """Pickle ``obj``; returns its kind, the pickle bytes and the out-of-band tensor buffers."""
    kind = _KIND.get(type(obj), 0)
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(
        astuple(obj) if kind else obj)
    return kind, out.getvalue(), [b.raw() for b in buffers]


def decode(kind: int, data: bytes | memoryview, buffers: list) -> Any:
    """The object that :func:`encode` gave ``(kind, data, buffers)`` for."""
    obj = pickle.loads(data, buffers=buffers)
    if not kind:
        return obj
    if kind > len(MESSAGES):
        raise ValueError(f"message kind {kind} is not one of the {len(MESSAGES)} known kinds")
    return MESSAGES[kind - 1](*obj)


def _head(kind: int, data: bytes, bufs: list[memoryview]) -> bytes:
    return _HEAD.pack(len(data), len(bufs), kind) + b"".join(_LEN.pack(b.nbytes) for b in bufs)


def dumps(obj: Any) -> bytes:
    kind, data, bufs = encode(obj)
    return b"".join([_head(kind, data, bufs), data, *bufs])


def loads(blob: bytes | bytearray | memoryview) -> Any:
    view = memoryview(blob)
    n_data, n_bufs, kind = _HEAD.unpack_from(view, 0)
    pos = _HEAD.size
    lens = [_LEN.unpack_from(view, pos + i * _LEN.size)[0] for i in range(n_bufs)]
    pos += n_bufs * _LEN.size
    data = view[pos:pos + n_data]
    pos += n_data
    bufs = []
    for n in lens:
        bufs.append(bytearray(view[pos:pos + n]))  # own, writable memory for the tensors
        pos += n
    return decode(kind, data, bufs)


def send_msg(sock: socket.socket, obj: Any) -> tuple[int, int]:
    """Send one message; returns (bytes written, of which raw tensor bytes)."""
    kind, data, bufs = encode(obj)
    head = _head(kind, data, bufs)
    total = len(head) + len(data) + sum(b.nbytes for b in bufs)
    if total <= 65536:
        sock.sendall(b"".join([head, data, *bufs]))
    else:
        sock.sendall(head + data)
        for b in bufs:
            sock.sendall(b)
    return total, sum(b.nbytes for b in bufs)


def _recv_into(sock: socket.socket, buf: bytearray | memoryview) -> None:
    view = memoryview(buf)
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def recv_msg(sock: socket.socket) -> tuple[Any, int, int]:
    """Receive one message; returns (object, bytes read, of which raw tensor bytes).

    ConnectionError on EOF.
    """
    head = bytearray(_HEAD.size)
    _recv_into(sock, head)
    n_data, n_bufs, kind = _HEAD.unpack(head)
    lens_raw = bytearray(n_bufs * _LEN.size)
    _recv_into(sock, lens_raw)
    lens = [_LEN.unpack_from(lens_raw, i * _LEN.size)[0] for i in range(n_bufs)]
    data = bytearray(n_data)
    _recv_into(sock, data)
    bufs = []
    for n in lens:
        b = bytearray(n)
        _recv_into(sock, b)
        bufs.append(b)
    return decode(kind, data, bufs), _HEAD.size + len(lens_raw) + n_data + sum(lens), sum(lens)
