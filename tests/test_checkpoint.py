"""Checkpoints: the atomic folder (round trip, RNG state, resume=auto skipping partial saves, a
save killed with SIGKILL in the middle); sharded DCP saves of a model's blocks (the boxes tile
every global tensor; on 4 gloo ranks: save on one layout, load on another and back, bit-exact
against the full state gathered the old way, each rank reading only the saved chunks that
overlap its shards; the asynchronous save holds the state of its start while training goes
on); the streaming HF export equals the gathered one and loads in transformers."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import contextlib
import json
import math
import threading
from itertools import product

import numpy as np
import pytest
import torch

from engine.hf_interop import (full_to_hf_state_dict, gather_full_state_dict,
                               save_hf_checkpoint, stream_hf_checkpoint)
from engine.hf_shards import hf_reads
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_full_state_dict
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.layout import ParallelLayout
from hybridflow_comm.shard_spec import train_shard
from rlhf.algos import AdaptiveKLController, LagrangeMultiplier
from rlhf.checkpoint import (MOMENTS, Block, ShardedSave, begin_checkpoint, capture_rng_state,
                             commit_checkpoint, complete_steps, is_complete, latest_complete,
                             load_checkpoint, read_sharded, read_state, remove_partial,
                             resolve_resume, restore_rng_state, save_checkpoint, step_dir)
from rlhf.workers.common import ShardCheckpoint, model_blocks

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


# Sharded checkpoints ---------------------------------------------------------------------------
CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=8, num_kv_heads=4, tie_word_embeddings=False)
CFG_TIED = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=8, num_kv_heads=4, tie_word_embeddings=True, qkv_bias=True,
                       model_type="qwen2")
# layouts (pp, tp, dp) of world size 1, 2 and 4 that CFG can take
LAYOUTS = [(pp, tp, dp) for pp, tp, dp in product((1, 2, 4), repeat=3) if pp * tp * dp <= 4]


def _boxes(config: LlamaConfig, layout: tuple, rank: int) -> dict[str, tuple]:
    """HF name -> (offsets, sizes) of ``rank``'s box (pure layout maths, as the workers use)."""
    train = ParallelLayout(*layout)
    out = {}
    for spec in llama_shard_specs(config, train.pp):
        for r in hf_reads(spec, train, rank) or ():
            out[r.hf_name] = (tuple(s.start for s in r.index),
                              tuple(s.stop - s.start for s in r.index))
    return out


def _overlap(a: tuple, b: tuple) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(*a, *b))


@pytest.mark.parametrize("config", [CFG, CFG_TIED], ids=["untied", "tied_qkv_bias"])
def test_boxes_tile_every_global_tensor(config):
    """For every layout of up to 4 ranks, the distinct boxes of all ranks cover each HF tensor
    exactly once (what DCP's dedup keeps), and replicas name identical boxes."""
    shapes = {}
    for spec in llama_shard_specs(config, 1):
        for r in hf_reads(spec, ParallelLayout(1, 1, 1), 0):
            shapes[r.hf_name] = r.hf_shape
    for layout in LAYOUTS:
        try:
            config.check_parallel(layout[0], layout[1])
        except ValueError:
            continue
        distinct: dict[str, set] = {}
        for rank in range(math.prod(layout)):
            for name, box in _boxes(config, layout, rank).items():
                distinct.setdefault(name, set()).add(box)
        assert sorted(distinct) == sorted(shapes), layout
        for name, boxes in distinct.items():
            assert sum(math.prod(s) for _, s in boxes) == math.prod(shapes[name]), (layout, name)
            assert not any(_overlap(a, b) for a in boxes for b in boxes if a != b), (layout, name)


def test_block_rejects_bad_boxes():
    with pytest.raises(ValueError, match="outside the global shape"):
        Block(torch.zeros(2, 3), (4, 3), (3, 0), (2, 3))
    with pytest.raises(ValueError, match="does not hold"):
        Block(torch.zeros(2, 3), (4, 3), (0, 0), (3, 3))


def test_single_process_sharded_roundtrip(tmp_path):
    """One rank, no process group: the DCP folder holds the HF-named global tensors; a grouped
    (fused q/k/v) block and a strided gate/up view load back in place."""
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout

    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG_TIED, groups)
    load_full_state_dict(model, init_full_state_dict(CFG_TIED, seed=1, std=0.2))
    blocks = model_blocks(model, model.params)
    assert blocks["model.layers.0.self_attn.q_proj.weight"].grouped
    assert not blocks["model.layers.0.mlp.up_proj.weight"].grouped  # a strided view
    pending = begin_checkpoint(str(tmp_path), 5, {"step": 5})
    save = ShardedSave(os.path.join(pending.tmp, "m"), blocks, None)
    assert latest_complete(str(tmp_path)) is None  # written, not committed
    save.finish()
    path = commit_checkpoint(pending)
    assert latest_complete(str(tmp_path)) == path and read_state(path) == {"step": 5}
    assert sorted(os.listdir(os.path.join(path, "m"))) == [".metadata", "__0_0.distcp"]
    full = read_sharded(os.path.join(path, "m"))
    want = full_to_hf_state_dict({n: p.detach() for n, p in model.params.items()}, model.specs)
    assert sorted(full) == sorted(want)
    assert all(torch.equal(full[k], want[k]) for k in want)
    other = ParallelLlama(CFG_TIED, groups)
    load_full_state_dict(other, init_full_state_dict(CFG_TIED, seed=2, std=0.2))
    ShardCheckpoint(other).load(os.path.join(path, "m"))
    assert all(torch.equal(other.params[n], p) for n, p in model.params.items())
    # a shard file cut short makes the whole checkpoint incomplete
    with open(os.path.join(path, "m", "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    assert not is_complete(path) and latest_complete(str(tmp_path)) is None
    with pytest.raises(ValueError, match="holds no sharded checkpoint"):
        ShardCheckpoint(other).load(str(tmp_path / "nothing"))


def test_full_tensor_checkpoints_are_refused_with_the_fix(tmp_path):
    path = save_checkpoint(str(tmp_path), 2, {"actor": {"w": torch.ones(2)}}, {"step": 2})
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta | {"format": 1}, f)   # as written before sharded checkpoints
    assert is_complete(path)
    with pytest.raises(ValueError, match="format 1 .*checkpoint.resume=never"):
        read_state(path)


def _micro_batches(step: int) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    return [{"input_ids": torch.randint(0, 64, (2, 8), generator=g)} for _ in range(2)]


def _loss(outputs: dict, mb: dict) -> torch.Tensor:
    return -outputs["log_probs"].mean()


def _groups(layout: tuple):
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout

    return build_hybrid_groups(HybridLayout(ParallelLayout(*layout), 1, 1),
                               pool=list(range(math.prod(layout))))


def _model(config, groups, seed):
    model = ParallelLlama(config, groups)
    load_full_state_dict(model, init_full_state_dict(config, seed=seed, std=0.2))
    return model, TrainEngine(model, OptimConfig(lr=1e-2))


def _check_against(model, engine, ref: dict, step: int) -> None:
    """Every local shard (weights, Adam moments) equals the reference full tensor's cut."""
    tied = model.config.tie_word_embeddings
    assert engine.step_count == step
    for spec in model.local_specs:
        name = "embed_tokens" if spec.name == "lm_head" and tied else spec.name
        p = model.params[spec.name]
        cut = {k: train_shard(ref[k][name], spec, model.layout, model.groups.rank)
               for k in ("weights", *MOMENTS)}
        assert torch.equal(p.detach(), cut["weights"]), spec.name
        st = engine.optimizer.state[p]
        assert float(st["step"]) == step, spec.name
        for m in MOMENTS:
            assert torch.equal(st[m], cut[m]), (m, spec.name)


@contextlib.contextmanager
def _held_writes():
    """Hold every DCP file write of this process until ``release()`` is called (so a test can
    change the weights between the start and the write of a save)."""
    from torch.distributed.checkpoint import FileSystemWriter

    gate, real, seen = threading.Event(), FileSystemWriter.write_data, []

    def held(self, plan, planner):
        seen.append(gate.wait(timeout=60))
        return real(self, plan, planner)

    FileSystemWriter.write_data = held
    try:
        yield gate.set
    finally:
        FileSystemWriter.write_data = real
    assert seen and all(seen), "a write ran before release(): the save was not asynchronous"


def reshard_chain(rank: int, world: int, folder: str, config, chain: list) -> list:
    """``chain[0]`` trains 2 steps and saves asynchronously (a third step runs between the
    start and the write of the save); every later layout loads the previous checkpoint (over
    a fresh or a stepped optimizer), is checked against the full state gathered on
    ``chain[0]`` before the third step, and saves its own.  Returns this rank's bytes read per
    load (0 outside the layout)."""
    import torch.distributed as dist

    groups = [_groups(layout) for layout in chain]  # group creation: every rank, same order
    ref_path = os.path.join(folder, "ref.pt")
    if groups[0] is not None:
        model, engine = _model(config, groups[0], seed=3)
        for s in range(2):
            engine.train_step(_micro_batches(s), _loss, temperature=1.0)
        weights = gather_full_state_dict(model)
        moments = {m: gather_full_state_dict(model, {n: engine.optimizer.state[p][m] for n, p
                                                     in model.params.items()}) for m in MOMENTS}
        if weights is not None:
            torch.save({"weights": weights, **moments}, ref_path)
        ckpt = ShardCheckpoint(model, engine)
        with _held_writes() as release:
            ckpt.start_save(os.path.join(folder, "0"))  # returns while the write is held
            engine.train_step(_micro_batches(2), _loss, temperature=1.0)  # training goes on
            release()
            ckpt.finish_save()
    reads = []
    for i, g in enumerate(groups[1:], 1):
        dist.barrier()
        if g is None:
            reads.append(0)
            continue
        model, engine = _model(config, g, seed=4)
        if i % 2:  # load over existing Adam state (in place) or into a fresh engine
            engine.train_step(_micro_batches(5), _loss, temperature=1.0)
        ckpt = ShardCheckpoint(model, engine)
        reads.append(ckpt.load(os.path.join(folder, str(i - 1))))
        _check_against(model, engine, torch.load(ref_path), step=2)
        ckpt.start_save(os.path.join(folder, str(i)))
        ckpt.finish_save()
    dist.barrier()
    return reads


def _expected_read_bytes(config, src: tuple, dst: tuple, rank: int) -> int:
    """Bytes of the saved chunks of layout ``src`` that overlap ``rank``'s boxes in ``dst``
    (weights and two moments, float32; plus the int64 optimizer step)."""
    saved: dict[str, set] = {}
    for r in range(math.prod(src)):
        for name, box in _boxes(config, src, r).items():
            saved.setdefault(name, set()).add(box)
    mine = _boxes(config, dst, rank)
    n = sum(math.prod(b[1]) for name, box in mine.items() for b in saved[name]
            if _overlap(box, b))
    return 3 * 4 * n + 8


CHAINS = {"tp2dp2-tp1dp2-tp2dp2": (CFG, [(1, 2, 2), (1, 1, 2), (1, 2, 2)]),
          "tied-pp2tp2-single-tp4-pp2dp2": (CFG_TIED, [(2, 2, 1), (1, 1, 1), (1, 4, 1),
                                                         (2, 1, 2)])}


@pytest.mark.parametrize("name", list(CHAINS))
def test_reshard_on_load(pool4, tmp_path, name):
    config, chain = CHAINS[name]
    reads = pool4.run(reshard_chain, str(tmp_path), config, chain)
    for i, (src, dst) in enumerate(zip(chain, chain[1:])):
        for rank in range(4):
            want = (_expected_read_bytes(config, src, dst, rank)
                    if rank < math.prod(dst) else 0)
            assert reads[rank][i] == want, (src, dst, rank)
    # the first save: every rank wrote its own file, none of them the whole model
    files = sorted(f for f in os.listdir(tmp_path / "0") if f.endswith(".distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(math.prod(chain[0]))]
    sizes = [os.path.getsize(tmp_path / "0" / f) for f in files]
    assert max(sizes) < 0.75 * sum(sizes)
    # the whole-checkpoint reader sees the same tensors in every folder of the chain
    first = read_sharded(str(tmp_path / "0"))
    for i in range(1, len(chain)):
        again = read_sharded(str(tmp_path / str(i)))
        assert sorted(again) == sorted(first)
        assert all(torch.equal(again[k], first[k]) for k in first), i


def hf_exports(rank: int, world: int, folder: str, config, layout: tuple) -> None:
    g = _groups(layout)
    if g is None:
        return
    model, engine = _model(config, g, seed=5)
    engine.train_step(_micro_batches(0), _loss, temperature=1.0)
    save_hf_checkpoint(model, os.path.join(folder, "gathered"))
    stream_hf_checkpoint(model, os.path.join(folder, "streamed"))


CFG_QWEN3 = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                        num_heads=8, num_kv_heads=4, head_dim=8, tie_word_embeddings=True,
                        qk_norm=True, model_type="qwen3")


@pytest.mark.parametrize("config,layout", [(CFG, (1, 2, 2)), (CFG_TIED, (2, 2, 1)),
                                           (CFG_QWEN3, (1, 4, 1))],
                         ids=["tp2dp2", "tied_pp2tp2", "qwen3_tp4"])
def test_streamed_hf_export(pool4, tmp_path, config, layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    pool4.run(hf_exports, str(tmp_path), config, layout)
    a = load_file(str(tmp_path / "gathered" / "model.safetensors"))
    b = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "streamed"))
    sd = hf.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in b.items())
