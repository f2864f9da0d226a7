"""AWQ scale search for w4a16-int4: folding keeps the float model, the search never loses to round-to-nearest,
and it helps on activations with outlier channels."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from lowbit.nn.awq_search import apply_awq, find_groups

transformers = pytest.importorskip("transformers")


def _llama(kv_heads=4, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=kv_heads, tie_word_embeddings=False,
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight[:, :4] *= 30  # a few outlier channels, as real LLM activations have
    return m


@pytest.fixture(scope="module")
def llama():
    return _llama()


CALIB = [torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(2)]
TEST = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(9))


def _targets(m):
    return {n: x for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and n != "lm_head"}


def test_groups_llama_and_gqa(llama):
    names = [(g.prev.split(".")[-1], [n.split(".")[-1] for n in g.linears]) for g in find_groups(llama)]
    assert names == [
        ("input_layernorm", ["q_proj", "k_proj", "v_proj"]),
        ("v_proj", ["o_proj"]),
        ("post_attention_layernorm", ["gate_proj", "up_proj"]),
        ("up_proj", ["down_proj"]),
    ]
    assert "v_proj" not in [g.prev.split(".")[-1] for g in find_groups(_llama(kv_heads=2))]


def test_groups_bert_only_value_to_output():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128)  # fmt: skip
    groups = find_groups(transformers.BertModel(cfg))
    assert [(g.prev, g.linears) for g in groups] == [
        (f"encoder.layer.{i}.attention.self.value", (f"encoder.layer.{i}.attention.output.dense",))
        for i in (0, 1)
    ]


@torch.no_grad()
def test_folding_keeps_the_float_model_and_search_beats_rtn(llama):
    m = copy.deepcopy(llama)
    ref = m(TEST).logits
    report = apply_awq(m, _targets(m), lambda k: 128, lambda: [m(c) for c in CALIB])
    assert len(report) == 4
    torch.testing.assert_close(m(TEST).logits, ref, rtol=1e-4, atol=1e-5)
    for name, r in report.items():
        assert r["loss"] <= r["rtn_loss"], name
    assert (
        report["model.layers.0.self_attn.q_proj"]["loss"]
        < 0.6 * report["model.layers.0.self_attn.q_proj"]["rtn_loss"]
    )


@torch.no_grad()
def test_quantize_model_awq_lowers_the_error(tmp_path, llama):
    m = llama
    ref = m(TEST).logits
    rtn = lowbit.quantize_model(copy.deepcopy(m), "w4a16-int4", calibration=CALIB, awq=False)
    awq = lowbit.quantize_model(copy.deepcopy(m), "w4a16-int4", calibration=CALIB)
    err = {k: ((q(TEST).logits - ref) ** 2).mean().item() for k, q in (("rtn", rtn), ("awq", awq))}
    assert err["awq"] < 0.95 * err["rtn"], err
    # the folded norms travel in the checkpoint: a reload gives the same outputs
    back = lowbit.load_quantized(lowbit.save_quantized(awq, tmp_path / "awq"))
    assert torch.equal(back(TEST).logits, awq(TEST).logits)


def test_awq_argument_errors(llama):
    with pytest.raises(ValueError, match="awq=True needs scheme w4a16-int4"):
        lowbit.quantize_model(copy.deepcopy(llama), "w4a16-int4", awq=True)
    with pytest.raises(ValueError, match="awq=True needs scheme w4a16-int4"):
        lowbit.quantize_model(copy.deepcopy(llama), "w4a16-nvfp4", calibration=CALIB, awq=True)
