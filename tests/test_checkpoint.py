"""Atomic checkpoints: round trip, RNG state, resume=auto skipping partial saves, and a save
killed with SIGKILL in the middle."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from rlhf.algos import AdaptiveKLController, LagrangeMultiplier
from rlhf.checkpoint import (capture_rng_state, complete_steps, is_complete, latest_complete,
                             load_checkpoint, remove_partial, resolve_resume, restore_rng_state,
                             save_checkpoint, step_dir)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_and_optim(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_roundtrip_full_state(tmp_path):
    model, opt = _model_and_optim(0)
    kl, lag = AdaptiveKLController(0.1, 1.0, 100.0), LagrangeMultiplier(0.5, 0.1, 0.2)
    kl.update(3.0, 10)
    lag.update(1.0)
    flat = torch.arange(10.0)
    tensors = {"actor": dict(model.state_dict()),
               "views": {"a": flat[2:5], "b": flat[2:5], "t": flat.view(2, 5).t()}}
    state = {"optim": {"actor": opt.state_dict()}, "rng": capture_rng_state(),
             "data": {"position": 48}, "kl_ctrl": kl.state_dict(), "lagrange": lag.state_dict()}
    path = save_checkpoint(str(tmp_path), 3, tensors, state)
    assert path == step_dir(str(tmp_path), 3) and is_complete(path)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]       # no temp folder left
    step, t2, s2 = load_checkpoint(path)
    assert step == 3
    for k, v in model.state_dict().items():
        assert torch.equal(t2["actor"][k], v)
    assert torch.equal(t2["views"]["t"], flat.view(2, 5).t())
    model2, opt2 = _model_and_optim(1)
    model2.load_state_dict(t2["actor"])
    opt2.load_state_dict(s2["optim"]["actor"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    kl2, lag2 = AdaptiveKLController(1.0, 2.0, 3.0), LagrangeMultiplier(1.0, 0.1, 0.0)
    kl2.load_state_dict(s2["kl_ctrl"])
    lag2.load_state_dict(s2["lagrange"])
    assert (kl2.value, lag2.value) == (kl.value, lag.value)
    assert s2["data"]["position"] == 48


def test_rng_state_restores_every_stream():
    state = capture_rng_state()
    a = (random.random(), torch.rand(3), np.random.rand(2))
    random.random(), torch.rand(5), np.random.rand(7)
    restore_rng_state(state)
    b = (random.random(), torch.rand(3), np.random.rand(2))
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_latest_complete_ignores_partial_and_keep_last(tmp_path):
    root = str(tmp_path)
    assert latest_complete(root) is None and resolve_resume("auto", root) is None
    for s in (1, 2, 3):
        save_checkpoint(root, s, {"m": {"w": torch.full((2,), float(s))}}, {"s": s}, keep_last=2)
    assert complete_steps(root) == [2, 3]
    # a save that died before its rename, one without meta.json, one with a truncated file
    os.makedirs(tmp_path / ".tmp-step_00000009-999999-abcdef12")
    os.makedirs(tmp_path / "step_00000008")
    (tmp_path / "step_00000008" / "m.safetensors").write_bytes(b"x")
    bad = save_checkpoint(root, 7, {"m": {"w": torch.zeros(2)}}, {})
    with open(os.path.join(bad, "m.safetensors"), "r+b") as f:
        f.truncate(10)
    assert latest_complete(root) == step_dir(root, 3)
    assert resolve_resume("never", root) is None
    assert resolve_resume(step_dir(root, 2), root) == step_dir(root, 2)
    with pytest.raises(ValueError, match="step_00000008' is not a complete checkpoint"):
        resolve_resume(step_dir(root, 8), root)
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(bad)
    # re-saving a step replaces it atomically
    save_checkpoint(root, 3, {"m": {"w": torch.full((2,), 33.0)}}, {"s": 33})
    assert load_checkpoint(step_dir(root, 3))[2] == {"s": 33}
    assert ".tmp-step_00000009-999999-abcdef12" not in os.listdir(root)  # dead pid: cleaned
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(root, -1, {}, {})
    with pytest.raises(ValueError, match="'a/b'"):
        save_checkpoint(root, 4, {"a/b": {}}, {})


_CHILD = textwrap.dedent("""
    import sys, time, torch
    import rlhf.checkpoint as ck
    root = sys.argv[1]
    ck.save_checkpoint(root, 1, {"actor": {"w": torch.ones(4)}}, {"step": 1})
    real = ck._fsync_file
    calls = []
    def slow_fsync(path):
        real(path)
        calls.append(path)
        if len(calls) == 2:           # the second file of step 2 is on disk, meta.json is not
            print("SAVING", flush=True)
            time.sleep(60)
    ck._fsync_file = slow_fsync
    ck.save_checkpoint(root, 2, {"actor": {"w": torch.full((4,), 2.0)},
                                 "critic": {"v": torch.zeros(3)}}, {"step": 2})
    print("NOT KILLED", flush=True)
""")


def test_sigkill_during_save_resumes_from_previous(tmp_path):
    root = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, root], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "SAVING"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    names = sorted(os.listdir(root))
    assert names[0].startswith(".tmp-step_00000002-") and names[1:] == ["step_00000001"]
    assert latest_complete(root) == step_dir(root, 1)
    step, tensors, state = load_checkpoint(latest_complete(root))
    assert step == 1 and torch.equal(tensors["actor"]["w"], torch.ones(4))
    time.sleep(0.05)
    assert remove_partial(root) == [os.path.join(root, names[0])]   # the killed save's folder
    assert os.listdir(root) == ["step_00000001"]
