"""Strided host-to-device copies (``cudaMemcpy2DAsync``) through the CUDA runtime torch loaded.

One layer of a run of page-major L2 pages is a strided copy: one row per page, a segment wide,
a page apart. torch has no such copy out of pinned host memory that stays asynchronous (it makes a
strided CPU source contiguous on the host first), so the runtime's ``cudaMemcpy2DAsync`` is called
through ctypes. It is the libcudart torch has already loaded into this process (found in
``/proc/self/maps``), never a second copy of the runtime with a state of its own. Per layer, K and V
apart, it runs near the speed of one flat DMA of the same bytes (``connector`` in docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import os
import threading

_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_SYMBOL = "cudaMemcpy2DAsync"

_lock = threading.Lock()
_runtime: ctypes.CDLL | None = None


def loaded_runtime_paths(maps_path: str = "/proc/self/maps") -> list[str]:
    """The paths of the libcudart libraries mapped into this process, in the order first seen."""
    paths: dict[str, None] = {}
    try:
        with open(maps_path) as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcudart"):
                    paths[fields[5].strip()] = None
    except OSError:
        pass
    return list(paths)


def find_runtime(paths: list[str] | None = None) -> ctypes.CDLL:
    """The loaded CUDA runtime that exports cudaMemcpy2DAsync; RuntimeError naming what was
    searched when none does. ``paths``: where to look (default: ``loaded_runtime_paths()``)."""
    paths = loaded_runtime_paths() if paths is None else paths
    for path in paths:
        try:
            library = ctypes.CDLL(path)     # already loaded: the same handle as torch's
        except OSError:
            continue
        if hasattr(library, _SYMBOL):
            return _declare(library)
    process = ctypes.CDLL(None)             # a runtime linked into a library loaded globally
    if hasattr(process, _SYMBOL):
        return _declare(process)
    raise RuntimeError(f"layer-by-layer loads need {_SYMBOL} from the CUDA runtime torch loaded, and no "
                       f"library of this process exports it (libcudart mapped: {paths or 'none'})")


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    copy = getattr(library, _SYMBOL)
    copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                     ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    library.cudaGetErrorString.argtypes = [ctypes.c_int]
    library.cudaGetErrorString.restype = ctypes.c_char_p
    library.cudaGetLastError.argtypes = []
    library.cudaGetLastError.restype = ctypes.c_int
    return library


def runtime() -> ctypes.CDLL:
    """The runtime, found once per process."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = find_runtime()
        return _runtime


def copy_2d_to_device(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                      stream: int) -> None:
    """Queue on ``stream`` (a cudaStream_t) the copy of ``height`` rows of ``width`` bytes from
    pinned host memory at ``src`` (rows ``src_pitch`` apart) to device memory at ``dst`` (rows
    ``dst_pitch`` apart). Raises RuntimeError with the runtime's message when it refuses."""
    library = runtime()
    error = library.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, _CUDA_MEMCPY_HOST_TO_DEVICE,
                                      stream)
    if error:
        library.cudaGetLastError()          # not left behind for torch's next check to report
        message = library.cudaGetErrorString(error).decode(errors="replace")
        raise RuntimeError(f"{_SYMBOL} of {height} rows of {width} bytes ({src:#x} pitch {src_pitch} -> "
                           f"{dst:#x} pitch {dst_pitch}) failed: {message} (cudaError {error})")
