"""Deep equality for values that travel on the wire (what the wire tests compare)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rlhf.controller import Batch


def same(a, b) -> bool:
    """Equal values, tensors and arrays bit-exact with their dtype, of the same types all the
    way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, Batch):
        return a.equal(b)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b
