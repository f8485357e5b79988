"""Finding the CUDA runtime torch loaded, and its strided host-to-device copy (on a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine_client import cudart


def test_the_runtimes_mapped_are_read_from_the_process_maps(tmp_path):
    """Every libcudart* path of a maps file, each once, in the order first seen; other lines
    (other libraries, anonymous mappings, paths with spaces) are not taken."""
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 11 /usr/lib/libc.so.6\n"
        "7f01-7f02 r-xp 00001000 08:01 12 /site/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f03-7f04 r--p 00002000 08:01 12 /site/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f04-7f05 r--p 00000000 08:01 13 /opt/my libs/libcudart.so.11.0\n"
        "7f05-7f06 r--p 00000000 08:01 14 /site/torch/lib/libtorch_cuda.so\n")
    assert cudart.loaded_runtime_paths(str(maps)) == ["/site/nvidia/cuda_runtime/lib/libcudart.so.12",
                                                     "/opt/my libs/libcudart.so.11.0"]
    assert cudart.loaded_runtime_paths(str(tmp_path / "none")) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA process may export the symbol globally")
def test_without_a_runtime_that_exports_the_copy_the_error_says_what_was_searched(tmp_path):
    """No library given exports cudaMemcpy2DAsync (one does not load, none is a runtime) and the
    process does not either: RuntimeError naming the symbol and the paths looked at."""
    not_a_library = tmp_path / "libcudart.so.12"
    not_a_library.write_bytes(b"not an ELF file")
    with pytest.raises(RuntimeError, match=r"cudaMemcpy2DAsync.*libcudart\.so\.12"):
        cudart.find_runtime([str(not_a_library)])


@pytest.mark.gpu
def test_gpu_a_strided_copy_moves_every_row_bit_for_bit_and_a_refused_one_raises(seed):
    """Rows of 96 bytes 1,000 bytes apart in pinned host memory land 256 bytes apart on the device,
    bit for bit, the gaps untouched; a copy whose source pitch is below its width is refused with
    the runtime's message, and leaves no error for torch's next call to report."""
    generator = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (7 * 1000,), generator=generator, dtype=torch.uint8).pin_memory()
    device = torch.full((7 * 256,), 7, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    cudart.copy_2d_to_device(device.data_ptr(), 256, host.data_ptr(), 1000, 96, 7, stream.cuda_stream)
    stream.synchronize()
    rows = device.view(7, 256).cpu()
    assert torch.equal(rows[:, :96], host.view(7, 1000)[:, :96]), f"seed {seed}"
    assert bool((rows[:, 96:] == 7).all()), f"seed {seed}"
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):
        cudart.copy_2d_to_device(device.data_ptr(), 256, host.data_ptr(), 50, 96, 7, stream.cuda_stream)
    torch.cuda.synchronize()
    gaps = device.view(7, 256)[:, 96:].int() + 1        # a kernel launch: torch checks the last error
    assert int(gaps.sum()) == 7 * 160 * 8
