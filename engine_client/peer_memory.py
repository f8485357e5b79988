"""What peer restores map (``engine_client.peer``): another engine's KV storages, through the
handles the daemon relays ("cuda": CUDA IPC; "host": shared memory opened through /proc/<pid>/fd),
and a registration's epoch file (``proto.epochs``)."""

from __future__ import annotations

import mmap
import os
import stat
import struct
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from proto import epochs as epoch_format
from proto import procfs


class PeerError(Exception):
    """A registration that cannot be made, opened or used here; the message says why."""


def device_identity(device: torch.device) -> tuple[str, str]:
    """(transport, device id) of KV tensors on ``device``: the GPU's UUID; for CPU tensors this
    boot of this machine and this pid namespace (what /proc/<pid>/fd can be opened within)."""
    if device.type == "cuda":
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is None:
            raise PeerError(f"torch {torch.__version__} does not say the GPU's UUID")
        return "cuda", str(uuid)
    if device.type == "cpu":
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return "host", f"{boot_id}:{procfs.pid_namespace_id()}"
    raise PeerError(f"no peer transport for KV tensors on {device}")


def share_host_tensors(kv_caches) -> None:
    """Move CPU KV tensors into shared memory (in place: the tensors stay the engine's), so that
    other engines can open them; before the layout takes their addresses. CUDA tensors: nothing."""
    values = kv_caches.values() if isinstance(kv_caches, Mapping) else (
        [kv_caches] if isinstance(kv_caches, torch.Tensor) else kv_caches)
    for tensor in values:
        if tensor.device.type == "cpu" and not tensor.untyped_storage().is_shared():
            tensor.share_memory_()


# ---- handles ----------------------------------------------------------------------------------


def _export_storage(storage: torch.UntypedStorage, transport: str) -> dict[str, Any]:
    if transport == "cuda":
        (_, handle, size, offset, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = storage._share_cuda_()
        return {"handle": bytes(handle), "size": int(size), "offset": int(offset),
                "ref_counter_handle": bytes(ref_counter_handle), "ref_counter_offset": int(ref_counter_offset),
                "event_handle": bytes(event_handle or b""), "event_sync_required": bool(event_sync_required)}
    if not storage.is_shared():
        raise PeerError("CPU KV tensors must be in shared memory (share_host_tensors) to be shared")
    fd, size = storage._share_fd_cpu_()
    return {"fd": int(fd), "size": int(size)}


def _field(handle: dict, name: str, kind: type) -> Any:
    value = handle.get(name)
    if type(value) is not kind:
        raise PeerError(f"a storage handle's {name!r} is not {kind.__name__}")
    return value


def _open_storage(handle: dict, transport: str, device: torch.device, pid: int) -> torch.UntypedStorage:
    """Map another engine's storage into this process (read only where the transport allows)."""
    if transport == "cuda":
        with torch.cuda.device(device):
            return torch.UntypedStorage._new_shared_cuda(
                device.index, _field(handle, "handle", bytes), _field(handle, "size", int),
                _field(handle, "offset", int), _field(handle, "ref_counter_handle", bytes),
                _field(handle, "ref_counter_offset", int), _field(handle, "event_handle", bytes),
                _field(handle, "event_sync_required", bool))
    fd_number, size = _field(handle, "fd", int), _field(handle, "size", int)
    try:
        fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PeerError(f"cannot open the shared memory of process {pid}: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size < size or size < 1:
            raise PeerError(f"process {pid}'s fd {fd_number} is not a shared memory file of ours of {size} bytes")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():             # read only: this engine never writes a peer's blocks
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()


# ---- the epoch file ----------------------------------------------------------------------------


class EpochFile:
    """A registration's epoch file (``proto.epochs``), mapped read-write (its owner) or read-only."""

    def __init__(self, path: str, offset_bytes: int, num_blocks: int, *, writable: bool, daemon_uid: int):
        if offset_bytes != epoch_format.EPOCHS_OFFSET:
            raise PeerError(f"epochs at byte {offset_bytes}, this engine reads them at {epoch_format.EPOCHS_OFFSET}")
        size = epoch_format.file_bytes(num_blocks)
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != daemon_uid or info.st_size < size:
                raise PeerError(f"{path} is not an epoch file of the daemon's user of {size} bytes")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        header = self._mapping[:epoch_format.EPOCHS_OFFSET]
        if header[:len(epoch_format.MAGIC)] != epoch_format.MAGIC or \
                struct.unpack_from("<Q", header, epoch_format.NUM_BLOCKS_OFFSET)[0] != num_blocks:
            self._mapping.close()
            raise PeerError(f"{path} is not the epoch file of a registration of {num_blocks} blocks")
        self.path = path
        self.num_blocks = num_blocks
        self.epochs = np.frombuffer(self._mapping, dtype="<i8", count=num_blocks, offset=epoch_format.EPOCHS_OFFSET)
        self._closed_word = np.frombuffer(self._mapping, dtype="<i8", count=1, offset=epoch_format.CLOSED_OFFSET)

    @property
    def closed(self) -> bool:
        return bool(self._closed_word[0])

    def mark_closed(self) -> None:
        """The owner: nothing it writes from now on is reflected here, so readers must stop."""
        self._closed_word[0] = 1

    def close(self) -> None:
        del self.epochs, self._closed_word       # the mapping closes once no array views it
        self._mapping.close()
