"""Plumbing of the end-to-end decoder benchmark (lowbit.bench.e2e) on CPU with a tiny decoder: the model
computes what a plain implementation computes, configs quantize the linears, every mode records a number or
an error, and the JSON and table carry the ratios to bf16. Timings here mean nothing."""

import json

import pytest
import torch
import torch.nn.functional as F

from lowbit.bench import decoder, e2e
from lowbit.nn import QuantLinear


def _plain_forward(m: e2e.Decoder, ids: torch.Tensor) -> torch.Tensor:
    """The decoder without a cache: causal attention over the sequence, the same weights."""
    s = m.s
    t = ids.shape[1]
    pos = torch.arange(t)
    h = m.embed(ids)
    cos, sin = m.cos[pos], m.sin[pos]
    for layer in m.layers:
        x = layer.attn_norm(h)
        q = layer.q_proj(x).view(1, t, s.heads, s.head_dim).transpose(1, 2)
        k = layer.k_proj(x).view(1, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = layer.v_proj(x).view(1, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = decoder._rope(q, cos, sin), decoder._rope(k, cos, sin)
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(h.dtype)
        h = h + layer.o_proj(a.transpose(1, 2).reshape(1, t, -1))
        x = layer.mlp_norm(h)
        mlp = layer.mlp
        h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return m.lm_head(m.norm(h[:, -1]))


def test_cached_decode_matches_a_plain_forward():
    m = e2e.build_decoder(e2e.SHAPES["tiny"], max_len=24, device="cpu")
    ids = torch.randint(0, m.s.vocab, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _plain_forward(m, ids).float()
        m(ids[:, :6], torch.arange(6))                        # prefill 6 into the cache
        for i in range(6, 9):                                 # then one token at a time
            got = m(ids[:, i:i + 1], torch.tensor([i])).float()
    assert torch.allclose(got, want, rtol=0.05, atol=0.05), (got - want).abs().max()


def test_each_layer_has_its_own_cache_and_a_step_writes_only_its_position():
    # one tensor per layer (as transformers' StaticCache): a compiled step then updates the cache in place
    # instead of copying one stacked buffer back every token
    m = e2e.build_decoder(e2e.SHAPES["tiny"], max_len=8, device="cpu")
    caches = [decoder.layer_cache(m, i) for i in range(m.s.layers)]
    ptrs = {t.data_ptr() for pair in caches for t in pair}
    assert len(ptrs) == 2 * m.s.layers
    assert all(k.shape == (1, m.s.kv_heads, 8, m.s.head_dim) for k, _ in caches)
    with torch.no_grad():
        m(torch.tensor([[3]]), torch.tensor([5]))
    for k, v in caches:
        written = (k != 0).any(dim=(0, 1, 3)) | (v != 0).any(dim=(0, 1, 3))
        assert written.tolist() == [i == 5 for i in range(8)]
    decoder.clear_cache(m)
    assert all(not k.any() and not v.any() for k, v in caches)


def test_configs_quantize_every_linear_but_lm_head():
    m = e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w4a16-nvfp4")
    assert all(isinstance(b.get_submodule(n), QuantLinear) for b in m.layers
               for n in ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert type(m.lm_head) is torch.nn.Linear
    assert e2e.weight_bytes(m) < e2e.weight_bytes(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"))
    with pytest.raises(ValueError, match="unknown config"):
        e2e.apply_config(m, "nope")


def test_fused_config_fuses_siblings_and_computes_the_same():
    from lowbit.nn import FusedProjection

    plain = e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w4a16-int4")
    fused = e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w4a16-int4+fused")
    assert all(isinstance(b.get_submodule(n), FusedProjection) for b in fused.layers
               for n in ("q_proj", "k_proj", "v_proj", "mlp.gate_proj", "mlp.up_proj"))
    assert e2e.weight_bytes(fused) == e2e.weight_bytes(plain)
    ids = torch.randint(0, e2e.SHAPES["tiny"].vocab, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, torch.arange(4)), plain(ids, torch.arange(4)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown config"):
        e2e.apply_config(plain, "lowbit:w4a16-int4+nope")
    # fp8_block weights do not stack: the config says so instead of running unfused under its name
    with pytest.raises(ValueError, match="could be fused"):
        e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w8a8-fp8-block+fused")


def test_run_writes_json_with_ratios_and_errors(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--steps", "2", "--prefill", "8",
                   "--modes", "eager,prefill,host,generate", "--configs", "bf16,lowbit:w4a16-nvfp4,bogus:x",
                   "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert result["shape"]["layers"] == 1 and result["settings"]["prefill"] == 8
    for name in ("bf16", "lowbit:w4a16-nvfp4"):
        r = rows[name]
        assert r["errors"] == {}, r["errors"]
        assert r["eager"] > 0 and r["prefill"] > 0 and r["generate"] > 0 and r["weight_gb"] > 0
        assert r["host"]["us"] > 0 and r["host"]["f_linear_us"] > 0
        assert set(r["ratio"]) == {"host_vs_f_linear", "eager", "prefill", "generate"}
    q = rows["lowbit:w4a16-nvfp4"]
    assert q["ratio"]["eager"] == pytest.approx(q["eager"] / rows["bf16"]["eager"])
    assert q["ratio"]["prefill"] == pytest.approx(rows["bf16"]["prefill"] / q["prefill"])
    assert "unknown config" in rows["bogus:x"]["errors"]["build"]
    table = capsys.readouterr().out
    assert "lowbit:w4a16-nvfp4" in table and "errors:" in table and "bogus:x build" in table


def test_bad_modes_and_missing_gpu_exit_2(capsys):
    assert e2e.main(["--modes", "eager,warp"]) == 2
    if not torch.cuda.is_available():
        assert e2e.main(["--shape", "tiny"]) == 2
    assert "lowbit e2e" in capsys.readouterr().err


def test_compare_against_a_curated_baseline(tmp_path, capsys):
    """--compare prints each ratio of the new run against the newest baseline run holding that config."""
    from pathlib import Path

    curated = json.loads((Path(__file__).parents[2] / "benchmarks/results/h100_e2e.json").read_text())
    newest = {}  # each ratio from the newest run that has it
    for run in curated["runs"]:
        for row in run["rows"]:
            newest.setdefault(row["config"], {}).update(row["ratio"])
    result = {"rows": [{"config": "bf16", "ratio": {"eager": 1.0, "host_vs_f_linear": 1.2}},
                       {"config": "lowbit:w4a16-nvfp4", "ratio": {"eager": 2 * newest["lowbit:w4a16-nvfp4"]["eager"]}},
                       {"config": "lowbit:new-scheme", "ratio": {"eager": 0.5}}]}
    table = e2e.compare(result, curated)
    lines = table.splitlines()
    assert "lowbit:w4a16-nvfp4 | eager | " in table and "| 2.00x" in table
    assert any(line.startswith("lowbit:new-scheme | eager | 0.500 | - | -") for line in lines)
    assert not any(line.startswith("bf16 | eager") for line in lines)  # 1.0 by definition
    assert any(line.startswith("bf16 | host_vs_f_linear") for line in lines)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert e2e.main(["--compare", str(bad)]) == 2
    assert e2e.main(["--compare", str(tmp_path / "missing.json")]) == 2
    assert "--compare" in capsys.readouterr().err


def test_interleaved_rounds_alternate_configs_and_report_errors():
    """Each round measures every built config in turn (not one config's rounds back to back); a config whose
    build or warm-up fails gets its error and the others still run."""
    calls = []

    def build(config):
        if config == "broken":
            raise RuntimeError("no kernel")
        return config

    def warm(model):
        if model == "cold":
            raise ValueError("warm-up failed")

    def measure(model):
        calls.append(model)
        return len(calls)

    out = e2e.interleaved_rounds(["bf16", "a", "broken", "cold", "b"], build, warm, measure, 0, "cpu", rounds=2)
    assert calls == ["bf16", "a", "b", "bf16", "a", "b"]
    assert out["bf16"] == [1, 4] and out["a"] == [2, 5] and out["b"] == [3, 6]
    assert out["broken"].startswith("RuntimeError") and out["cold"].startswith("ValueError")


def test_a_prompt_longer_than_the_cache_is_refused_before_any_kernel():
    s = e2e.SHAPES["tiny"]
    model = decoder.build_decoder(s, 8, "cpu")
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 9, dtype=torch.long), torch.arange(9))
    assert model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)).shape == (1, s.vocab)


def test_default_configs_measure_fused_projections_too():
    assert {"lowbit:w4a16-nvfp4+fused", "lowbit:w4a16-int4+fused"} <= set(e2e.DEFAULT_CONFIGS)
    for config in e2e.DEFAULT_CONFIGS:
        if config.startswith("lowbit:"):
            e2e.apply_config(decoder.build_decoder(e2e.SHAPES["tiny"], 8, "cpu"), config)


def test_gated_config_runs_the_mlp_as_one_gated_layer():
    from lowbit.nn import GatedMLP

    plain = e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w4a16-nvfp4")
    gated = e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w4a16-nvfp4+gated")
    assert all(isinstance(b.mlp, GatedMLP) for b in gated.layers)
    # the same codes and scales; gate and up shared one nvfp4 global scale, now held once (4 bytes a layer)
    assert e2e.weight_bytes(plain) - e2e.weight_bytes(gated) == 4 * len(gated.layers)
    ids = torch.randint(0, e2e.SHAPES["tiny"].vocab, (1, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = plain(ids, torch.arange(4)).float(), gated(ids, torch.arange(4)).float()
    assert ((got - want).norm() / want.norm()) < 2e-2     # the product rounded once instead of four times
    with pytest.raises(ValueError, match="could be gated|could be fused"):
        e2e.apply_config(e2e.build_decoder(e2e.SHAPES["tiny"], 8, device="cpu"), "lowbit:w4a4-nvfp4+gated")


def test_compiled_steps_have_a_code_object_each_and_are_timed_in_rounds():
    from lowbit.bench import e2e_timing

    s = e2e.SHAPES["tiny"]
    a, b = (decoder.build_decoder(s, 16, "cpu") for _ in range(2))
    fa, fb = (e2e_timing._compiled_step(m, 1, None) for m in (a, b))
    ca, cb = (f.compiled._torchdynamo_orig_callable.__code__ for f in (fa, fb))
    assert ca is not cb and ca.co_name != cb.co_name   # one Dynamo cache per model, no shared guards
    out = e2e_timing.compiled_rounds(s, ["lowbit:w4a16-int4", "nope"], 1, 16, 4, 1, "cpu", rounds=2)
    row = out["lowbit:w4a16-int4"]
    assert row["tok_s"] == max(row["rounds"]) > 0 and len(row["rounds"]) == 2 and row["compile_s"] > 0
    assert row["layers"] == 1
    assert isinstance(out["nope"], str)             # a config that cannot be built is reported, not raised
