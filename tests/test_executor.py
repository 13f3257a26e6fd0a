"""Device executors and device-setup advice."""

from __future__ import annotations

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the advice of a machine without CUDA")
def test_cuda_on_a_cpu_build_gives_advice():
    with pytest.raises(DeviceError, match="nvidia-smi"):
        parse_device("cuda")


def test_cuda_error_advice_names_the_fix():
    old = cuda_advice("CUDA driver version is insufficient for CUDA runtime version")
    assert "nvidia-smi" in old and "driver" in old and "torch build" in old
    arch = cuda_advice("CUDA error: no kernel image is available for execution on the device")
    assert "compute_cap" in arch and "torch build" in arch
