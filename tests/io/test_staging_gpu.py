"""The page-locked staging chunks a GPU conversion copies through (lowbit.io.staging): every byte arrives, in
any chunking, with fewer buffers than chunks (each buffer reused only after its copy is done), and an error in
one chunk's read or write is raised only once no chunk is still running."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lowbit.io.staging import PinnedRing, download, upload

pytestmark = pytest.mark.gpu

CASES = [(1, 7, 1), (2, 1000, 3), (3, 4096, 2), (8, 1 << 16, 8)]  # (buffers, chunk bytes, pool threads)


@pytest.mark.parametrize("count,chunk,threads", CASES)
@pytest.mark.parametrize("n", [0, 1, 6999, 1 << 18])
def test_upload_puts_every_byte_on_the_device(count, chunk, threads, n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    raw = memoryview(data.numpy()).cast("B")
    ring, stream = PinnedRing(torch.device("cuda:0"), count, chunk), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dst = torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda")

    def fill(start: int, out: memoryview) -> None:
        out[:] = raw[start:start + len(out)]

    with ThreadPoolExecutor(threads) as pool:
        for _ in range(2):  # the second pass reuses buffers whose copies may still run
            dst.fill_(0xAB)
            upload(ring, stream, dst, fill, pool)
            torch.cuda.current_stream().wait_stream(stream)
            assert torch.equal(dst.cpu(), data)
    ring.close()


@pytest.mark.parametrize("count,chunk,threads", CASES)
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (37, 129)), (torch.float32, (5000,)),
                                          (torch.float8_e4m3fn, (3, 1 << 15)), (torch.int32, (1,))])
def test_download_writes_every_byte_once(count, chunk, threads, dtype, shape):
    src = torch.randn(shape, device="cuda").to(dtype)
    ready = torch.cuda.Event()
    ready.record()
    want = src.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    got = bytearray(len(want))
    written = [0]
    lock = threading.Lock()

    def write(start: int, data: memoryview) -> None:
        got[start:start + len(data)] = data
        with lock:
            written[0] += len(data)

    ring = PinnedRing(torch.device("cuda:0"), count, chunk)
    with ThreadPoolExecutor(threads) as pool:
        download(ring, torch.cuda.Stream(), src, ready, write, pool)
    ring.close()
    assert bytes(got) == want and written[0] == len(want)


def test_download_waits_for_the_work_that_makes_the_tensor():
    """The copies wait for ``ready``: a tensor still being written by a long kernel on another stream arrives
    complete."""
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):
            a = a @ a / 2048 ** 0.5
        src = a.to(torch.bfloat16)
        ready = torch.cuda.Event()
        ready.record(producer)
    got = bytearray(src.numel() * 2)
    ring = PinnedRing(torch.device("cuda:0"), 2, 1 << 16)
    with ThreadPoolExecutor(2) as pool:
        download(ring, torch.cuda.Stream(), src, ready,
                 lambda s, d: got.__setitem__(slice(s, s + len(d)), d), pool)
    ring.close()
    torch.cuda.synchronize()
    assert bytes(got) == src.cpu().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_an_error_in_one_chunk_is_raised_after_the_others_settle(direction):
    ring, stream = PinnedRing(torch.device("cuda:0"), 2, 1000), torch.cuda.Stream()
    running, calls = [0], []
    lock = threading.Lock()

    def step(start: int, buf: memoryview) -> None:
        with lock:
            running[0] += 1
            calls.append(start)
        try:
            if start == 3000:
                raise OSError("disk full")
        finally:
            with lock:
                running[0] -= 1

    t = torch.zeros(10_000, dtype=torch.uint8, device="cuda")
    with ThreadPoolExecutor(3) as pool, pytest.raises(OSError, match="disk full"):
        if direction == "upload":
            upload(ring, stream, t, step, pool)
        else:
            download(ring, stream, t, None, step, pool)
    assert running[0] == 0 and 3000 in calls
    # the buffers all came back: the ring still serves a whole pass
    with ThreadPoolExecutor(3) as pool:
        upload(ring, stream, t, lambda s, out: out.__setitem__(slice(None), b"\x01" * len(out)), pool)
    torch.cuda.synchronize()
    assert bool((t == 1).all())
    ring.close()


def test_ring_rejects_empty_sizes():
    with pytest.raises(ValueError, match="count and nbytes"):
        PinnedRing(torch.device("cuda:0"), 0, 16)
    with pytest.raises(ValueError, match="count and nbytes"):
        PinnedRing(torch.device("cuda:0"), 2, 0)
