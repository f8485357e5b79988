"""Asynchronous copies straight through the CUDA runtime that torch has loaded.

Why. A transfer's DMAs are queued while the device waits for them, so every microsecond of host
time before the copy engine starts adds to the transfer. A torch `copy_` from a packed buffer into
a slice of the pool costs the views and a TensorIterator: 32 µs median (86 µs p90) for 146 MB on
the H200 machine, against 9 µs (12 µs p90) for the cudaMemcpyAsync it ends in, called through
ctypes with a stream handle (same run, bench/results/h200/submit.json); queued on the engine's
copy stream, torch also needs that stream made current around it (11 µs per switch there). The
transfer engine knows the addresses already (its packed buffers, the pool's mapping), so it calls
the runtime itself.

Only the library torch already loaded is used (dlopen with RTLD_NOLOAD): the same runtime, the same
contexts, no second CUDA runtime in the process. Where none is loaded (a torch linked statically
against the runtime, or no CUDA), `load()` returns None and callers keep to torch's copies.

An error is raised here as a RuntimeError (torch's own copies raise its AcceleratorError, a
RuntimeError too) and then cleared from the runtime's last-error slot, so that it is not reported
a second time by whichever torch call checks that slot next.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# cudaMemcpyKind
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2


class CudaRuntime:
    """The few runtime calls the transfer engine makes itself: copies, event records and waits,
    and launches of captured graphs, all by handle on an explicit stream."""

    def __init__(self, library: ctypes.CDLL, path: str):
        self.path = path
        self._memcpy_async = library.cudaMemcpyAsync
        self._memcpy_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_void_p]
        self._memcpy_async.restype = ctypes.c_int
        self._event_record = library.cudaEventRecord
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._event_record.restype = ctypes.c_int
        self._stream_wait_event = library.cudaStreamWaitEvent
        self._stream_wait_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._stream_wait_event.restype = ctypes.c_int
        self._graph_launch = library.cudaGraphLaunch
        self._graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._graph_launch.restype = ctypes.c_int
        self._get_last_error = library.cudaGetLastError
        self._get_last_error.argtypes = []
        self._get_last_error.restype = ctypes.c_int
        self._get_error_string = library.cudaGetErrorString
        self._get_error_string.argtypes = [ctypes.c_int]
        self._get_error_string.restype = ctypes.c_char_p

    def memcpy_async(self, destination: int, source: int, num_bytes: int, kind: int, stream: int) -> None:
        """cudaMemcpyAsync(destination, source, num_bytes, kind, stream); RuntimeError if it fails.
        The stream must belong to the current device."""
        error = self._memcpy_async(destination, source, num_bytes, kind, stream)
        if error:
            self._get_last_error()      # clear it: torch's next check must not report it again
            raise RuntimeError(f"cudaMemcpyAsync of {num_bytes} bytes ({_KIND_NAMES.get(kind, kind)}) "
                               f"failed: {self.error_string(error)} (cudaError {error})")

    def event_record(self, event: int, stream: int) -> None:
        """cudaEventRecord(event, stream); RuntimeError if it fails."""
        error = self._event_record(event, stream)
        if error:
            self._raise("cudaEventRecord", error)

    def stream_wait_event(self, stream: int, event: int) -> None:
        """cudaStreamWaitEvent(stream, event, 0): work queued on stream after this waits for the
        event's last record; RuntimeError if it fails."""
        error = self._stream_wait_event(stream, event, 0)
        if error:
            self._raise("cudaStreamWaitEvent", error)

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        """cudaGraphLaunch(graph_exec, stream); RuntimeError if it fails."""
        error = self._graph_launch(graph_exec, stream)
        if error:
            self._raise("cudaGraphLaunch", error)

    def _raise(self, call: str, error: int) -> None:
        self._get_last_error()      # clear it, as in memcpy_async
        raise RuntimeError(f"{call} failed: {self.error_string(error)} (cudaError {error})")

    def error_string(self, error: int) -> str:
        text = self._get_error_string(error)
        return text.decode(errors="replace") if text else "unknown error"


_KIND_NAMES = {HOST_TO_DEVICE: "host to device", DEVICE_TO_HOST: "device to host"}


def loaded_library_path(major_version: str | None = None) -> str | None:
    """The path of the CUDA runtime library mapped into this process (of that major version, when
    given), if any."""
    prefix = "libcudart.so" if major_version is None else f"libcudart.so.{major_version}"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(prefix):
                    return fields[5].strip()
    except OSError:
        return None
    return None


def load() -> CudaRuntime | None:
    """The CUDA runtime torch loaded (call once CUDA is initialized), or None if there is none to use.

    By soname first (``libcudart.so.<torch's CUDA major>``), which names the copy torch linked even
    when another package maps a runtime of its own; else by the mapped file of that major version.
    """
    import torch

    if torch.version.cuda is None:
        return None
    major = torch.version.cuda.split(".")[0]
    path = loaded_library_path(major)
    for name in (f"libcudart.so.{major}", path):
        if name is None:
            continue
        try:
            return CudaRuntime(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW), path or name)
        except (OSError, AttributeError):
            continue
    logger.info("no shared CUDA runtime %s library is loaded: DMAs are queued through torch", major)
    return None
