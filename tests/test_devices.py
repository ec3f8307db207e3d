"""Device and precision resolution (hybridflow_comm.devices, Config.device/precision): every
request the machine cannot meet is one ValueError naming it, before any process group."""

import pytest
import torch

from hybridflow_comm import devices
from rlhf.config import load_config, resolve_devices


def test_auto_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert devices.resolve_device("auto") == torch.device("cuda", 5)
    assert devices.resolve_device("cuda", rank_on_node=2) == torch.device("cuda", 2)
    assert devices.resolve_device("cpu") == torch.device("cpu")


def test_requests_the_machine_cannot_meet(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device=cuda but this machine has no usable CUDA"):
        devices.resolve_device("cuda")
    with pytest.raises(ValueError, match="device='tpu' must be one of"):
        devices.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="local rank 3 has no GPU: this node has 2"):
        devices.resolve_device("cuda", rank_on_node=3)
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        devices.resolve_device("cuda")


def test_precision_defaults_and_refusals(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert devices.resolve_precision("auto", cpu) is devices.FP32
    assert devices.resolve_precision("bf16", cpu) is devices.BF16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: True)
    assert devices.resolve_precision("auto", gpu) is devices.BF16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (7, 0))
    with pytest.raises(ValueError, match="Tesla V100 has no native bf16"):
        devices.resolve_precision("auto", gpu)
    assert devices.resolve_precision("fp32", gpu) is devices.FP32
    with pytest.raises(ValueError, match="precision='fp16'"):
        devices.resolve_precision("fp16", cpu)
    assert devices.precision_dtype("bf16") is torch.bfloat16
    assert devices.backend_for(gpu) == "cpu:gloo,cuda:nccl"
    assert devices.backend_for(cpu) == "gloo"


def test_run_config_resolves_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg, device = resolve_devices(load_config(["algo=grpo"]))
    assert (cfg.device, cfg.precision, device) == ("cpu", "fp32", torch.device("cpu"))
    cfg, _ = resolve_devices(load_config(["algo=grpo", "precision=bf16"]))
    assert cfg.precision == "bf16"
    with pytest.raises(ValueError, match="device=cuda but"):
        resolve_devices(load_config(["algo=grpo", "device=cuda"]))
    with pytest.raises(ValueError, match="precision='half' must be one of"):
        load_config(["algo=grpo", "precision=half"])
