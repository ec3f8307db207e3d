"""Batch container: every operation against a direct per-row loop."""

import pytest
import torch

from rlhf.controller.batch import PAD_KEY, Batch


def _batch(n=5):
    return Batch({"x": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3),
                  "m": torch.arange(n) % 2 == 0},
                 {"uid": [f"u{i}" for i in range(n)]}, {"temp": 0.7})


def _rows_loop(b, idx):
    """Reference: rows picked one by one."""
    return ([b["x"][i].tolist() for i in idx], [bool(b["m"][i]) for i in idx],
            [b["uid"][i] for i in idx])


def _as_rows(b):
    return b["x"].tolist(), [bool(v) for v in b["m"]], list(b["uid"])


def test_sizes_and_errors():
    b = _batch()
    assert len(b) == 5 and set(b.keys()) == {"x", "m", "uid"}
    with pytest.raises(ValueError, match="batch size"):
        Batch({"x": torch.zeros(3)}, {"uid": [1, 2]})
    with pytest.raises(TypeError, match="'y'"):
        Batch({"y": [1, 2]})
    with pytest.raises(ValueError, match="0-d"):
        Batch({"y": torch.tensor(1.0)})
    with pytest.raises(KeyError, match="nope"):
        b.select(["nope"])


def test_select_union():
    b = _batch()
    s = b.select(["x"])
    assert s.keys() == ["x"] and s["x"].data_ptr() == b["x"].data_ptr()  # a view
    u = s.union(b.select(["uid"]))
    assert _as_rows(u.union(b.select(["m"]))) == _as_rows(b)
    bad = Batch({"x": b["x"] + 1})
    with pytest.raises(ValueError, match="'x' differs"):
        s.union(bad)


def test_chunk_concat_reorder_repeat():
    b = _batch(6)
    parts = b.chunk(3)
    assert [_as_rows(p) for p in parts] == [_rows_loop(b, range(2 * i, 2 * i + 2)) for i in range(3)]
    assert parts[1]["x"].untyped_storage().data_ptr() == b["x"].untyped_storage().data_ptr()
    assert _as_rows(Batch.concat(parts)) == _as_rows(b)
    with pytest.raises(ValueError, match="pad first"):
        b.chunk(4)
    order = [3, 0, 5, 1, 4, 2]
    assert _as_rows(b.reorder(order)) == _rows_loop(b, order)
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2, 3, 4])
    inter = [i for i in range(6) for _ in range(2)]
    assert _as_rows(b.repeat(2)) == _rows_loop(b, inter)
    assert _as_rows(b.repeat(2, interleave=False)) == _rows_loop(b, list(range(6)) * 2)


@pytest.mark.parametrize("n,k", [(5, 2), (5, 4), (7, 3), (6, 3), (1, 4)])
def test_pad_unpad(n, k):
    b = _batch(n)
    p = b.pad_to_multiple(k)
    assert len(p) % k == 0 and len(p) - n == (-n) % k and p.meta[PAD_KEY] == (-n) % k
    assert _as_rows(p) == _rows_loop(b, [i % n for i in range(len(p))])
    back = p.unpad()
    assert back.equal(b)


def test_serialization_roundtrip():
    b = _batch()
    b.tensors["bf"] = torch.randn(5, 2).to(torch.bfloat16)
    b.tensors["empty"] = torch.zeros(5, 0)
    b.tensors["strided"] = torch.arange(20).reshape(5, 4)[:, ::2]
    back = Batch.from_bytes(b.to_bytes())
    assert back.equal(b)
    assert back["bf"].dtype == torch.bfloat16
