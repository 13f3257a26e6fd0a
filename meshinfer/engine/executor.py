"""Context-bound executors: one thread per device owns every torch call for that device.

Forward passes and KV-cache frees for a device all run on its thread, so CUDA state
(current device, stream) is bound once and never raced, and the asyncio loop only does I/O.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from typing import Any, Callable, TypeVar

import torch

from meshinfer.core.config import check_device_spec
from meshinfer.core.errors import DeviceError

log = logging.getLogger(__name__)
T = TypeVar("T")


def parse_device(spec: str) -> torch.device:
    """Validate ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` and check the device is usable.

    Raises:
        DeviceError: malformed spec, or the device is missing, with advice on what to install.
    """
    check_device_spec(spec)
    device = torch.device(spec)
    if device.type == "cuda":
        _check_cuda(device)
    elif device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise DeviceError("device mps is not available: it needs Apple silicon, macOS 12.3+ and an arm64 "
                          "build of torch (pip install torch on an arm64 Python)")
    return device


def _check_cuda(device: torch.device) -> None:
    """Turn the CUDA setup errors users meet into advice."""
    if torch.version.cuda is None:
        raise DeviceError("this torch build has no CUDA support (it is a CPU build). Install a CUDA build "
                          "matching your driver: run `nvidia-smi` to see the highest CUDA version the driver "
                          "supports, then `pip install torch --index-url <PyTorch's cuXYZ wheel index>`")
    try:
        count = torch.cuda.device_count()
        if count == 0 or not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible")
        index = device.index or 0
        if index >= count:
            raise DeviceError(f"device cuda:{index} does not exist; this machine has {count} CUDA device(s)")
        torch.zeros(1, device=f"cuda:{index}").add_(1)  # surfaces "no kernel image" and driver errors
    except DeviceError:
        raise
    except Exception as exc:
        raise DeviceError(cuda_advice(str(exc))) from exc


def cuda_advice(message: str) -> str:
    """Advice for a CUDA initialisation error ``message``."""
    built = torch.version.cuda
    if "driver" in message.lower() and ("old" in message.lower() or "insufficient" in message.lower()):
        return (f"the NVIDIA driver is older than CUDA {built}, which this torch build needs ({message}). "
                f"Run `nvidia-smi`: its 'CUDA Version' is the newest the driver supports. Either update the "
                f"driver, or install a torch build for that CUDA version or older (e.g. a cu121 or cu118 wheel)")
    if "no kernel image" in message.lower() or "not compatible" in message.lower():
        return (f"this torch build (CUDA {built}) has no kernels for this GPU's architecture ({message}). "
                f"Install a torch build that lists your GPU's compute capability "
                f"(`nvidia-smi --query-gpu=compute_cap --format=csv`), usually the newest cuXYZ wheel")
    return (f"CUDA is not usable: {message}. Check `nvidia-smi` works; torch here was built for CUDA {built}")


class DeviceExecutor:
    """A single worker thread bound to ``device``.

    Args:
        device: the torch device this thread owns.
        threads: CPU threads torch may use for intra-op parallelism (None leaves torch's default).

    ``await run(fn, *args)`` runs ``fn`` on the thread. Cancelling the awaiting coroutine does
    not stop a pass already running; the result is dropped. :meth:`close` is safe to call twice.
    """

    def __init__(self, device: torch.device | str = "cpu", *, threads: int | None = None) -> None:
        self.device = torch.device(device)
        self._threads = threads
        self._stream = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"meshinfer-{self.device}", initializer=self._bind)
        self._thread_id: int | None = None

    def _bind(self) -> None:
        self._thread_id = threading.get_ident()
        if self._threads:
            torch.set_num_threads(self._threads)
        if self.device.type == "cuda":
            # torch 2.11 refuses set_device(torch.device("cuda")) without an index (seen on an H200)
            torch.cuda.set_device(self.device.index if self.device.index is not None else torch.cuda.current_device())
            self._stream = torch.cuda.Stream(self.device)

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                out = fn(*args, **kwargs)
                self._stream.synchronize()
                return out
        return fn(*args, **kwargs)

    def on_thread(self) -> bool:
        """True when called from this executor's thread."""
        return threading.get_ident() == self._thread_id

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the device thread and return its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(self._call, fn, *args, **kwargs))

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future:
        """Fire-and-forget variant of :meth:`run` (used for cache frees from sync code)."""
        return self._pool.submit(self._call, fn, *args)

    def close(self) -> None:
        """Finish queued work and stop the thread."""
        self._pool.shutdown(wait=True)
