"""``lowbit quantize --algorithm gptq``: which calibration sentences a run uses (no model is run)."""

from __future__ import annotations

import pytest

from lowbit.cli import build_parser
from lowbit.eval.data import load_sentences
from lowbit.eval.quality import calibration_sentences


def test_calibration_sentences(tmp_path):
    es = load_sentences()
    assert calibration_sentences(es, None, None, "rtn") == []
    assert calibration_sentences(es, None, None, "gptq") == list(es.calibration)
    assert calibration_sentences(es, 5, None, "gptq") == list(es.calibration[:5])
    f = tmp_path / "calib.txt"
    f.write_text("one sentence.\n\n  another one  \nthird\n", encoding="utf-8")
    assert calibration_sentences(es, None, f, "gptq") == ["one sentence.", "another one", "third"]
    assert calibration_sentences(es, 2, f, "rtn") == ["one sentence.", "another one"]
    with pytest.raises(ValueError, match="needs calibration"):
        calibration_sentences(es, 0, None, "gptq")
    with pytest.raises(ValueError, match="--calib"):
        calibration_sentences(es, 380, None, "gptq")
    with pytest.raises(ValueError, match="algorithm"):
        calibration_sentences(es, None, None, "awq")
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="--calib-file"):
        calibration_sentences(es, None, tmp_path / "empty.txt", "gptq")
    with pytest.raises(ValueError, match="--calib-file"):
        calibration_sentences(es, None, tmp_path / "missing.txt", "gptq")


def test_parser():
    args = build_parser().parse_args(["quantize", "--scheme", "w4a16-nvfp4", "--algorithm", "gptq"])
    assert args.algorithm == "gptq" and args.calib is None and args.calib_file is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--scheme", "w4a16-nvfp4", "--algorithm", "best"])
