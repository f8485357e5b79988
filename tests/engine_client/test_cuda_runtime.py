"""The CUDA runtime calls the transfer engine makes itself: found in the process, bit-exact copies,
errors raised once and cleared, and the transfer engine's DMAs going through them (or through torch
when there is no runtime to use)."""

from __future__ import annotations

import pytest
import torch

from engine_client import cuda_runtime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch maps a runtime")
def test_without_a_cuda_runtime_in_the_process_there_is_nothing_to_load():
    assert cuda_runtime.loaded_library_path() is None
    assert cuda_runtime.load() is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["D2H", "H2D"])
def test_memcpy_async_copies_bit_exact_on_the_given_stream(kind):
    """The copy is queued on the stream it names: behind that stream's work (nothing lands while
    the stream is still busy), then bit for bit."""
    runtime = cuda_runtime.load()
    assert runtime is not None and "libcudart" in runtime.path
    generator = torch.Generator().manual_seed(1)
    host = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=generator).pin_memory()
    device_bytes = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=generator).cuda()
    source, destination = (host, device_bytes) if kind == "H2D" else (device_bytes, host)
    before = destination[5:5 + (2 << 20)].cpu().clone()
    expected = source[1000:1000 + (2 << 20)].cpu().clone()
    assert not torch.equal(before, expected)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)      # keeps the stream busy for a while
    runtime.memcpy_async(destination.data_ptr() + 5, source.data_ptr() + 1000, 2 << 20,
                         cuda_runtime.HOST_TO_DEVICE if kind == "H2D" else cuda_runtime.DEVICE_TO_HOST,
                         stream.cuda_stream)
    # Read on another stream (the default one), which does not wait for `stream`.
    assert torch.equal(destination[5:5 + (2 << 20)].cpu(), before), "the copy did not wait for its stream"
    stream.synchronize()
    assert torch.equal(destination[5:5 + (2 << 20)].cpu(), expected)


@pytest.mark.gpu
@needs_cuda
def test_a_failed_copy_raises_once_and_torch_does_not_see_it_again():
    """An invalid copy raises with the runtime's message; the error is cleared, so the next torch
    call that checks the runtime's last error does not fail for it."""
    runtime = cuda_runtime.load()
    assert runtime is not None
    device_bytes = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="cudaMemcpyAsync of 4096 bytes .*failed: .*cudaError"):
        runtime.memcpy_async(device_bytes.data_ptr(), 0, 4096, cuda_runtime.HOST_TO_DEVICE,
                             torch.cuda.current_stream().cuda_stream)
    device_bytes.fill_(3)                  # a kernel launch: torch checks the last error after it
    torch.cuda.synchronize()
    assert int(device_bytes.sum()) == 3 << 20
