"""``lowbit inspect`` on malformed input: headers the safetensors library rejects, missing shards, FIFOs,
configs of the wrong JSON type, and the one-folder-per-scheme output of ``lowbit quantize``. Each gives one
line on stderr and exit 2, never a traceback, a hang or a made-up summary."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from torch import nn

import lowbit

from ._helpers import run_cli


def _one_line_error(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def _write_raw(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD_HEADERS = {
    # name: (header, data bytes, expected message part)
    "overlap": (
        {"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 8, 24)}, b"\0" * 24, "overlaps",
    ),
    "gap": ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 16, 24)}, b"\0" * 24, "gap"),
    "negative_shape": ({"a": _entry("F32", [-4], 0, 16)}, b"\0" * 16, "not a list of integers >= 0"),
    "huge_shape": ({"a": _entry("F32", [2**40, 2**40], 0, 16)}, b"\0" * 16, "needs"),
    "float_shape": ({"a": _entry("F32", [4.0], 0, 16)}, b"\0" * 16, "not a list of integers"),
    "unknown_dtype": ({"a": _entry("F12", [4], 0, 16)}, b"\0" * 16, "unknown dtype 'F12'"),
    "wrong_size": ({"a": _entry("F32", [4], 0, 12)}, b"\0" * 12, "needs 16 bytes"),
    "reversed_offsets": ({"a": _entry("U8", [0], 8, 0)}, b"\0" * 8, "data_offsets"),
    "trailing_bytes": ({"a": _entry("F32", [4], 0, 16)}, b"\0" * 20, "file has"),
    "bad_metadata": ({"__metadata__": {"k": 1}, "a": _entry("F32", [4], 0, 16)}, b"\0" * 16, "__metadata__"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_headers_the_loader_rejects(tmp_path, case):
    header, data, msg = BAD_HEADERS[case]
    f = tmp_path / "d" / "model.safetensors"
    _write_raw(f, header, data)
    err = _one_line_error(*run_cli("inspect", str(f.parent))[::2])
    assert str(f) in err and msg in err, err
    # the same rules as the loader: safetensors itself refuses every one of these files
    from safetensors import safe_open

    with pytest.raises(Exception):  # noqa: B017 (safetensors raises its own error types)
        with safe_open(str(f), framework="pt") as h:
            [h.get_tensor(k) for k in h.keys()]


def test_valid_header_variants_still_accepted(tmp_path):
    """Zero-sized tensors, F4 packing and metadata strings are valid safetensors: not refused."""
    f = tmp_path / "model.safetensors"
    _write_raw(
        f,
        {"__metadata__": {"format": "pt"}, "e": _entry("F32", [0, 3], 0, 0), "w": _entry("F32", [2, 2], 0, 16)},
        b"\0" * 16,
    )
    rc, out, err = run_cli("inspect", str(f))
    assert rc == 0, err


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256)


def test_index_missing_shards_and_tensors(tmp_path):
    out = lowbit.save_quantized(lowbit.quantize_model(Tiny(), "w4a16-nf4"), tmp_path / "c", max_shard_size="40KB")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert run_cli("inspect", str(out))[0] == 0
    (out / shards[-1]).rename(tmp_path / "moved")
    err = _one_line_error(*run_cli("inspect", str(out))[::2])
    assert "shards listed are missing" in err and shards[-1] in err
    (tmp_path / "moved").rename(out / shards[-1])
    index["weight_map"]["up.ghost"] = shards[0]
    index_path.write_text(json.dumps(index))
    err = _one_line_error(*run_cli("inspect", str(out))[::2])
    assert "in none of the shards" in err and "up.ghost" in err


def test_fifo_is_not_opened(tmp_path):
    """A FIFO named like a checkpoint file would block ``open`` until a writer comes: refused from os.stat."""
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "model.safetensors")
    p = subprocess.run(
        [sys.executable, "-m", "lowbit.cli", "inspect", str(d)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "not a regular file" in p.stderr and "Traceback" not in p.stderr
    err = _one_line_error(*run_cli("inspect", str(d / "model.safetensors"))[::2])
    assert "not a regular file" in err
    e = tmp_path / "e"
    lowbit.save_quantized(lowbit.quantize_model(Tiny(), "w4a16-nf4"), e)
    (e / "config.json").unlink()
    os.mkfifo(e / "config.json")
    err = _one_line_error(*run_cli("inspect", str(e))[::2])
    assert "config.json" in err and "not a regular file" in err


@pytest.mark.parametrize(
    ("config", "msg"),
    [
        ([1, 2], "config.json must hold a JSON object, got list"),
        ({"quantization_config": "fp8"}, "quantization_config must be a JSON object, got str"),
        ({"quantization_config": {"quant_method": 4}}, "quant_method must be a string"),
    ],
)
def test_config_of_the_wrong_type(tmp_path, config, msg):
    out = lowbit.save_quantized(lowbit.quantize_model(Tiny(), "w4a16-nf4"), tmp_path / "c")
    (out / "config.json").write_text(json.dumps(config))
    err = _one_line_error(*run_cli("inspect", str(out))[::2])
    assert msg in err


def test_multi_scheme_output_names_its_folders(tmp_path):
    for scheme in ("w4a16-nf4", "w4a16-int4"):
        lowbit.save_quantized(lowbit.quantize_model(Tiny(), scheme), tmp_path / "out" / scheme)
    (tmp_path / "out" / "report.txt").write_text("table\n")
    err = _one_line_error(*run_cli("inspect", str(tmp_path / "out"))[::2])
    assert "w4a16-nf4" in err and "w4a16-int4" in err and "inspect one of them" in err
    assert run_cli("inspect", str(tmp_path / "out" / "w4a16-int4"))[0] == 0
