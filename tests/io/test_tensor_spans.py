"""Positional reads of safetensors tensors (``TensorSource.span`` / ``read_into``, what a conversion reads its
Linear weights with): the bytes safetensors itself returns, for every dtype, chunked over threads or not, and
a clear error or safetensors' own path for headers it does not take as they are."""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from lowbit.io import files as io_files
from lowbit.io.files import TensorSource, tensor_spans

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def _random(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)
    return (t != 0) if dtype == torch.bool else t.clone()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "7-byte-chunks"])
def test_read_into_returns_what_safetensors_returns(tmp_path, monkeypatch, chunk):
    if chunk is not None:
        monkeypatch.setattr(io_files, "READ_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(1234)
    shapes = [(), (0,), (1,), (3, 5), (17, 33), (2, 0, 4), (4, 3, 2, 5)]
    state = {f"t{i}.{str(d).split('.')[-1]}": _random(d, shapes[(i + j) % len(shapes)], g)
             for j, d in enumerate(DTYPES) for i in range(3)}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    src = TensorSource(tmp_path)
    with ThreadPoolExecutor(3) as pool:
        for key, want in state.items():
            span = src.span(key)
            assert span is not None and span.dtype == want.dtype and span.shape == tuple(want.shape)
            for p in (None, pool):
                got = src.read_into(key, torch.empty(span.nbytes, dtype=torch.uint8), p)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert _bytes(got) == _bytes(want) == _bytes(src.get(key)), key
    src.close()


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize(
    "header",
    [
        {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}},  # 12 bytes for 16
        {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 32]}},  # past the file's end
        {"a": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}},
        {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16.0]}},
        {"a": {"dtype": "F4", "shape": [2, 2], "data_offsets": [0, 16]}},  # a dtype torch does not have
        {"a": {"dtype": "F32", "shape": [2, True], "data_offsets": [0, 8]}},
        {"a": [1, 2]},
    ],
)
def test_headers_not_taken_as_they_are_have_no_span(tmp_path, header):
    path = tmp_path / "x.safetensors"
    _write_raw(path, header, bytes(16))
    assert tensor_spans(path) is None


def test_header_length_past_the_file_has_no_span(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert tensor_spans(path) is None
    path.write_bytes(b"\x01")
    assert tensor_spans(path) is None


def test_a_file_cut_after_planning_is_a_clear_error(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    src = TensorSource(tmp_path)
    span = src.span("w")
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(span.offset + 100)
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: .* missing at offset"):
        src.read_into("w", torch.empty(span.nbytes, dtype=torch.uint8))
    src.close()


def test_read_into_checks_its_buffer(tmp_path):
    save_file({"w": torch.randn(4, 4)}, str(tmp_path / "model.safetensors"))
    src = TensorSource(tmp_path)
    for bad in (torch.empty(63, dtype=torch.uint8), torch.empty(16, dtype=torch.float32),
                torch.empty(128, dtype=torch.uint8)[::2]):
        with pytest.raises(ValueError, match="out must be a contiguous uint8 CPU tensor of 64 bytes"):
            src.read_into("w", bad)
    with pytest.raises(KeyError):
        src.span("missing")
    src.close()


def test_without_preadv_safetensors_reads(tmp_path, monkeypatch):
    save_file({"w": torch.randn(4, 4)}, str(tmp_path / "model.safetensors"))
    monkeypatch.delattr(io_files.os, "preadv")
    src = TensorSource(tmp_path)
    assert src.span("w") is None
    src.close()
