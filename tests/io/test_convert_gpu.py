"""convert_checkpoint on CUDA writes the CPU conversion's bytes: the reader thread's copies to the GPU on its own
stream, the writer's copies back through page-locked chunks and its pwrites change nothing, on one rank and on two
(one GPU each where there are two, else both on one), with pieces small enough that the ranks share files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import lowbit
import lowbit.io.convert as conv
import lowbit.io.convert_layout as layout
import lowbit.io.convert_writer as writer
from lowbit.testing import tree_digest, write_tiny_llama

pytestmark = pytest.mark.gpu

SCHEMES = ["w4a16-nvfp4", "w8a8-fp8-block", "w4a8-mxfp4", "w4a16-int4", "w4a16-nf4"]


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "model", hidden=512, intermediate=1536, layers=3,
                            vocab=512, max_shard_size="3MB")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_conversion_writes_the_cpu_bytes(tmp_path, llama_src, monkeypatch, scheme):
    ref = tree_digest(lowbit.convert_checkpoint(llama_src, tmp_path / "cpu", scheme, device="cpu", progress=False))
    assert tree_digest(lowbit.convert_checkpoint(llama_src, tmp_path / "gpu", scheme, device="cuda:0",
                                           progress=False)) == ref
    monkeypatch.setattr(layout, "PIECE_BYTES", 1 << 20)  # several pieces per shard: the ranks share files
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    errors: list[BaseException | None] = [None, None]

    def run(r: int) -> None:
        try:
            lowbit.convert_checkpoint(llama_src, tmp_path / "two", scheme, device=devices, rank=r, world_size=2,
                                      progress=False, timeout=120)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [None, None]
    assert tree_digest(tmp_path / "two") == ref


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w8a8-fp8-block"])
def test_small_staging_chunks_write_the_same_bytes(tmp_path, llama_src, monkeypatch, scheme):
    """Weights and outputs many times the staging chunk, read and written through a ring of few chunks: the
    bytes of the CPU conversion still."""
    ref = tree_digest(lowbit.convert_checkpoint(llama_src, tmp_path / "cpu", scheme, device="cpu", progress=False))
    monkeypatch.setattr(conv, "STAGING_CHUNK_BYTES", 40_000)
    monkeypatch.setattr(writer, "STAGING_CHUNK_BYTES", 24_576)
    monkeypatch.setattr(conv, "READ_THREADS", 3)
    monkeypatch.setattr(writer, "WRITE_THREADS", 1)
    assert tree_digest(lowbit.convert_checkpoint(llama_src, tmp_path / "gpu", scheme, device="cuda:0",
                                           progress=False)) == ref


def test_fp8_block_quantize_under_a_bfloat16_default_dtype():
    """The kernel's plan and result templates name their dtypes: a caller (or transformers, while it builds a
    model) that set the default dtype to bfloat16 still gets float32 block scales."""
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    ref = lowbit.quantize(w, "fp8_block")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        q = lowbit.quantize(w, "fp8_block")
    finally:
        torch.set_default_dtype(old)
    assert q.scale.dtype == torch.float32
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
