"""Controller/worker messages: every class round-trips through the wire, field by field; the
controller package imports form a DAG."""

import ast
import dataclasses
import os

import pytest
import torch

from rlhf.controller import Batch, wire
from rlhf.controller.messages import (MESSAGES, Abort, Bye, Call, Challenge, Create, Done,
                                      Failed, Fetch, GetOutput, Heartbeat, Hello, Send, SendOnly,
                                      Shutdown, Value, Welcome)
from tests.values import same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "rlhf.controller"


def _batch() -> Batch:
    return Batch({"x": torch.arange(12, dtype=torch.float32).reshape(4, 3),
                  "bf": torch.randn(4, 2).to(torch.bfloat16)},
                 {"uid": ["a", "b", "c", "d"]}, {"temp": 0.7})


FETCH = Fetch(11, ((2, 0, 3), (3, 0, 1)), ((2, 40), (3, 42)))
SEND = Send(1, 11, ((0, 3), (5, 7)), 40)
CALL = Call(7, 4, "add_one", (FETCH, _batch(), 3), {"scale": torch.ones(2), "b": FETCH}, True,
            False, (SEND,), (1, 2))
EXAMPLES = [
    FETCH,
    SEND,
    Challenge(bytes(range(32))),
    Hello(3, "cmd", b"n" * 32, b"m" * 32),
    Welcome(b"w" * 32),
    Abort("the controller failed: RuntimeError: boom"),
    Heartbeat(2, 4242, "node-a"),
    Create(5, 4, "tests.controller_jobs:Probe", "actor", (0, 1, 2, 3), (1, 2, 2), (1, 2),
           (0.5, None), {"offset": 0.5}, 2.0),
    Create(6, 4, "bench.dispatch:Bench", "critic", (2, 3), (1, 1, 2), (1, 1), (), {}, None),
    CALL,
    SendOnly(8, (SEND, Send(0, 11, ((1, 2),), 44)), ()),
    GetOutput(9, 7, (3,)),
    Shutdown(),
    Done(7, 2, {"kind": "batch", "size": 4, "shape": (4, 3)}, True, _batch()),
    Done(7, 3, None, True, None),
    Done(8, 1, None, False, None),
    Value(9, 0, [torch.arange(5), {"loss": 1.5}]),
    Failed(7, 2, "RuntimeError: deliberate", "Traceback (most recent call last):\n  ..."),
    Bye(1),
]


def test_every_message_class_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_message_roundtrips_field_by_field(msg):
    back = wire.loads(wire.dumps(msg))
    assert type(back) is type(msg) and back is not msg
    names = [f.name for f in dataclasses.fields(msg)]
    assert [f.name for f in dataclasses.fields(back)] == names
    for name in names:
        assert same(getattr(back, name), getattr(msg, name)), name


def test_messages_inside_other_objects_roundtrip():
    """Messages nested in containers are pickled by their own reduction, not the frame kind."""
    obj = {"plans": [FETCH, SEND], "call": CALL}
    back = wire.loads(wire.dumps(obj))
    assert same(back, obj)


def test_unknown_message_kind_is_refused():
    blob = bytearray(wire.dumps(Bye(1)))
    blob[12:14] = (len(MESSAGES) + 1).to_bytes(2, "little")  # the u16 kind after u64, u32
    with pytest.raises(ValueError, match="kind"):
        wire.loads(blob)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_messages_are_frozen_slotted_and_documented(cls):
    msg = next(m for m in EXAMPLES if type(m) is cls)
    assert not hasattr(msg, "__dict__")
    for f in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, f.name, None)
    source = ast.parse(open(os.path.join(ROOT, "rlhf", "controller", "messages.py")).read())
    body = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    documented = {a.target.id for a, doc in zip(body.body, body.body[1:])
                  if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr)
                  and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}
    assert documented == {f.name for f in dataclasses.fields(cls)}


def _controller_imports() -> dict[str, set[str]]:
    """Module -> the rlhf.controller modules it imports (type-checking imports included)."""
    folder = os.path.join(ROOT, "rlhf", "controller")
    mods = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(folder, f"{m}.py")).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {f"{PKG}.{a.name}" if node.module == PKG and a.name in mods
                         else node.module for a in node.names}
        name = PKG if m == "__init__" else f"{PKG}.{m}"
        graph[name] = {d for d in deps if d == PKG or d.startswith(PKG + ".")} - {name}
    return graph


def test_controller_imports_form_a_dag():
    graph = _controller_imports()
    assert graph[f"{PKG}.worker_group"].isdisjoint({f"{PKG}.controller", PKG})
    assert graph[f"{PKG}.futures"].isdisjoint({f"{PKG}.controller", f"{PKG}.worker_group", PKG})
    order: list[str] = []
    left = dict(graph)
    while left:  # Kahn: peel off modules whose imports are all placed
        ready = sorted(m for m, deps in left.items() if deps <= set(order))
        assert ready, f"import cycle among {sorted(left)}"
        order += ready
        for m in ready:
            del left[m]
