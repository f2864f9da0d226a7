"""Plumbing of the DiT block benchmark (lowbit.bench.dit) on CPU with a tiny shape: the block computes what a
plain implementation computes, configs quantize its 10 linears, every mode records a number or an error, and
the JSON and table carry the ratios to bf16 and the output error against bf16. Timings here mean nothing."""

import json

import pytest
import torch
import torch.nn.functional as F

from lowbit.bench import dit
from lowbit.nn import QuantLinear


def _plain_block(b: dit.DiTBlock, x, ctx, temb, cos, sin):
    """The block written out with fp32 attention, per head, from the same weights."""
    s = b.s
    shift, scale, gate, c_shift, c_scale, c_gate = (b.scale_shift_table + temb).chunk(6, dim=1)

    def attn(a, q_in, kv_in, rope):
        q = a.norm_q(a.to_q(q_in)).unflatten(2, (s.heads, -1)).transpose(1, 2)
        k = a.norm_k(a.to_k(kv_in)).unflatten(2, (s.heads, -1)).transpose(1, 2)
        v = a.to_v(kv_in).unflatten(2, (s.heads, -1)).transpose(1, 2)
        if rope:
            q, k = dit._rope(q, cos, sin), dit._rope(k, cos, sin)
        w = torch.softmax(q.float() @ k.float().transpose(-1, -2) / s.head_dim**0.5, dim=-1)
        return a.to_out((w @ v.float()).to(x.dtype).transpose(1, 2).flatten(2))

    h = F.layer_norm(x, (s.hidden,), eps=1e-6) * (1 + scale) + shift
    x = x + attn(b.attn1, h, h, True) * gate
    n2 = b.norm2(x)
    x = x + attn(b.attn2, n2, ctx, False)
    h = F.layer_norm(x, (s.hidden,), eps=1e-6) * (1 + c_scale) + c_shift
    return x + b.ffn_down(F.gelu(b.ffn_up(h), approximate="tanh")) * c_gate


def test_block_matches_a_plain_implementation():
    s = dit.SHAPES["tiny"]
    m = dit.build_dit(s, device="cpu")
    x, ctx, temb, (cos, sin) = dit.make_inputs(s, 24, "cpu")
    assert x.shape == (1, 24, 128) and ctx.shape == (1, 16, 128) and cos.shape == (24, 16)
    with torch.no_grad():
        got = m(x, ctx, temb, (cos, sin)).float()
        want = _plain_block(m.blocks[0], x, ctx, temb, cos, sin).float()
    assert torch.allclose(got, want, rtol=0.05, atol=0.05), (got - want).abs().max()
    assert got.std() > 0.5  # the block's output is not the residual alone


def test_wan_shape_and_quantized_linears():
    s = dit.SHAPES["wan2.1-14b"]
    assert (s.hidden, s.heads, s.head_dim, s.ffn, s.text_len) == (5120, 40, 128, 13824, 512)
    assert dit.DEFAULT_TOKENS == (8190, 32760)
    m = dit.apply_config(dit.build_dit(dit.SHAPES["tiny"], device="cpu"), "lowbit:w4a16-nvfp4")
    b = m.blocks[0]
    linears = [b.attn1.to_q, b.attn1.to_k, b.attn1.to_v, b.attn1.to_out, b.attn2.to_q, b.attn2.to_k,
               b.attn2.to_v, b.attn2.to_out, b.ffn_up, b.ffn_down]
    assert all(isinstance(lin, QuantLinear) for lin in linears)
    assert dit.weight_bytes(m) < dit.weight_bytes(dit.build_dit(dit.SHAPES["tiny"], device="cpu")) / 2
    assert "lowbit:w8a8-mxfp8" in dit.default_configs() and dit.default_configs()[0] == "bf16"
    assert "lowbit:w4a4-nvfp4+fp8" in dit.default_configs()
    with pytest.raises(ValueError, match="unknown config"):
        dit.apply_config(m, "nope")


def test_run_writes_json_with_ratios_quality_and_errors(tmp_path, capsys):
    out = tmp_path / "dit.json"
    rc = dit.main(["--shape", "tiny", "--device", "cpu", "--tokens", "32,48", "--repeats", "1",
                   "--modes", "eager", "--configs", "lowbit:w8a8-fp8-block,bf16,lowbit:w4a16-nvfp4,bogus:x",
                   "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["shape"]["hidden"] == 128 and result["settings"]["tokens"] == [32, 48]
    rows = {r["config"]: r for r in result["rows"]}
    assert result["rows"][0]["config"] == "bf16"  # runs first: the quality reference
    for name in ("bf16", "lowbit:w8a8-fp8-block", "lowbit:w4a16-nvfp4"):
        r = rows[name]
        assert r["errors"] == {}, r["errors"]
        assert r["weight_gb"] > 0
        assert all(r["tokens"][t]["eager"] > 0 for t in ("32", "48"))
        assert set(r["ratio"]) == {"32", "48"}
    q = rows["lowbit:w4a16-nvfp4"]
    bf16_ms = rows["bf16"]["tokens"]["48"]["eager"]
    assert q["ratio"]["48"]["eager"] == pytest.approx(bf16_ms / q["tokens"]["48"]["eager"])
    fp8, nv = rows["lowbit:w8a8-fp8-block"]["quality"], q["quality"]
    assert fp8["tokens"] == 32 and 0.99 < nv["cosine"] < fp8["cosine"] < 1.0
    assert fp8["sqnr_db"] > nv["sqnr_db"] + 6
    assert "quality" not in rows["bf16"]
    assert "unknown config" in rows["bogus:x"]["errors"]["build"]
    table = capsys.readouterr().out
    assert "eager ms @48" in table and "bogus:x build" in table and "x)" in table


def test_compile_mode_records_a_number_or_an_error(tmp_path):
    out = tmp_path / "c.json"
    assert dit.main(["--shape", "tiny", "--device", "cpu", "--tokens", "16", "--repeats", "1",
                     "--modes", "compile", "--configs", "bf16", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["rows"][0]
    cell = r["tokens"]["16"]
    assert ("compile" in cell and cell["compile"]["ms"] > 0) or "16/compile" in r["errors"]


def test_bad_arguments_exit_2(capsys):
    assert dit.main(["--modes", "eager,warp"]) == 2
    assert dit.main(["--shape", "tiny", "--device", "cpu", "--repeats", "0"]) == 2
    if not torch.cuda.is_available():
        assert dit.main(["--shape", "tiny"]) == 2
    assert "lowbit dit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dit.main(["--tokens", "8190,abc"])


def test_fp8_compute_config_switches_the_w4a4_layers():
    m = dit.apply_config(dit.build_dit(dit.SHAPES["tiny"], device="cpu"), "lowbit:w4a4-nvfp4+fp8")
    assert all(q.compute == "fp8_block" for q in m.modules() if isinstance(q, QuantLinear))
    with pytest.raises(ValueError, match=r"\+fp8 is for w4a4-nvfp4"):
        dit.apply_config(dit.build_dit(dit.SHAPES["tiny"], device="cpu"), "lowbit:w4a16-nvfp4+fp8")
    with pytest.raises(ValueError, match="unknown config"):
        dit.apply_config(dit.build_dit(dit.SHAPES["tiny"], device="cpu"), "lowbit:w4a4-nvfp4+fast")
