"""Device executors and device-setup advice."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from meshinfer.core.errors import DeviceError
from meshinfer.engine.executor import DeviceExecutor, cuda_advice, parse_device


async def test_every_call_runs_on_the_one_device_thread():
    ex = DeviceExecutor("cpu")
    try:
        idents = {await ex.run(threading.get_ident) for _ in range(20)}
        assert len(idents) == 1 and idents != {threading.get_ident()}
        assert await ex.run(ex.on_thread) and not ex.on_thread()
    finally:
        ex.close()
        ex.close()  # safe twice


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "", "cpu:0"])
def test_malformed_device_is_refused(spec):
    with pytest.raises(DeviceError, match="is not one of cpu, cuda, cuda:N, mps"):
        parse_device(spec)


def test_cuda_on_a_cpu_build_gives_advice(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build, on any machine (a GPU one too)
    with pytest.raises(DeviceError, match="it is a CPU build.*nvidia-smi"):
        parse_device("cuda")


def test_cuda_without_a_visible_device_gives_advice(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError, match="no CUDA device is visible.*nvidia-smi"):
        parse_device("cuda")


def test_cuda_error_advice_names_the_fix():
    old = cuda_advice("CUDA driver version is insufficient for CUDA runtime version")
    assert "nvidia-smi" in old and "driver" in old and "torch build" in old
    arch = cuda_advice("CUDA error: no kernel image is available for execution on the device")
    assert "compute_cap" in arch and "torch build" in arch


@pytest.mark.parametrize("spec, index", [("cuda", 0), ("cuda:1", 1)])
async def test_a_cuda_thread_binds_to_a_device_index(spec, index, monkeypatch):
    """torch 2.11 raises ValueError for ``torch.cuda.set_device(torch.device("cuda"))`` (no index),
    which broke every ``--device cuda`` peer on an H200 (docs/benchmarks.md, GPU): the device
    thread passes an index, the current device's for a bare ``cuda``. torch.cuda is stood in
    for here (CI has no GPU), keeping that version's rule."""
    bound = []

    def set_device(device):
        if not isinstance(device, int) and getattr(device, "index", None) is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        bound.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    ex = DeviceExecutor(spec)
    try:
        assert await ex.run(lambda: 42) == 42
        assert bound == [index]
    finally:
        ex.close()
