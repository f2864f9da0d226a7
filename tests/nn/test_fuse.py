"""fuse_projections: q/k/v and gate/up of a quantized model run as one GEMM each, give each member's own
projection whatever the call order or input, come back unchanged with unfuse_projections, and are refused by
checkpoint writers and tensor-parallel plans."""

import pytest
import torch

import lowbit
from lowbit.bench.decoder import Decoder, DecoderShape, clear_cache
from lowbit.nn import FusedProjection, GatedMLP, QuantLinear, fuse_projections, unfuse_projections
from lowbit.nn.fuse import gated_activation

# head_dim 128 so that k and v start on a multiple of 128 rows (the nvfp4 / mxfp4 row alignment)
SHAPE = DecoderShape(hidden=256, intermediate=256, heads=2, kv_heads=1, head_dim=128, vocab=512, layers=2)
SCHEMES = ["w4a16-nvfp4", "w4a16-mxfp4", "w4a16-int4", "w4a16-nf4", "w4a16-fp4b32", "w4a4-nvfp4", "w4a8-mxfp4"]


def _model(scheme, seed=0):
    torch.manual_seed(seed)
    m = Decoder(SHAPE, max_len=16, device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return lowbit.quantize_model(m.eval(), scheme)


def _step(m, ids, pos):
    with torch.no_grad():
        clear_cache(m)
        return m(ids, pos).float()


def _reference_and_copy(scheme):
    """Two equal quantized decoders, a 5-token step's input and the first one's output."""
    ref, other = _model(scheme), _model(scheme)
    ids, pos = torch.randint(0, SHAPE.vocab, (1, 5)), torch.arange(5)
    return ref, other, ids, pos, _step(ref, ids, pos)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_model_computes_the_same_and_unfuses_to_the_same_weights(scheme):
    ref, fused, ids, pos, want = _reference_and_copy(scheme)
    groups = fuse_projections(fused, gated_mlp=False)
    assert len(groups) == 2 * SHAPE.layers
    assert {g[0].rpartition(".")[2] for g in groups} == {"q_proj", "gate_proj"}
    layer = fused.layers[0]
    assert all(isinstance(layer.get_submodule(n), FusedProjection)
               for n in ("q_proj", "k_proj", "v_proj", "mlp.up_proj"))
    assert isinstance(layer.mlp.down_proj, QuantLinear)
    got = _step(fused, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unfuse_projections(fused)
    assert not any(isinstance(m, FusedProjection) for m in fused.modules())
    _assert_same_state(ref.state_dict(), fused.state_dict())


def test_one_gemm_per_group_and_nothing_kept_after_the_group():
    m = _model("w4a16-nvfp4")
    fuse_projections(m, gated_mlp=False)
    calls = []
    fused_layers = {id(mod._group[0]): mod._group[0] for mod in m.modules() if isinstance(mod, FusedProjection)}
    for layer in fused_layers.values():
        layer.register_forward_hook(lambda mod, inp, out: calls.append(mod.out_features))
    _step(m, torch.randint(0, SHAPE.vocab, (1, 3)), torch.arange(3))
    assert calls == [512, 512] * SHAPE.layers      # q+k+v = 256+128+128 rows, gate+up = 256+256
    for mod in m.modules():
        if isinstance(mod, FusedProjection):
            assert mod._out.x is None and mod._out.y is None


def test_any_order_and_other_inputs_give_each_members_own_projection():
    m = _model("w4a16-int4")
    attn = m.layers[0]
    x = torch.randn(2, 3, SHAPE.hidden)
    other = torch.randn(2, 3, SHAPE.hidden)
    with torch.no_grad():
        want = {n: getattr(attn, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
        want_other = getattr(attn, "k_proj")(other)
        fuse_projections(m, gated_mlp=False)
        got_v = attn.v_proj(x)                        # members called out of order
        got_k_other = attn.k_proj(other)              # cross-attention: another input
        got_q = attn.q_proj(x)
        got_k = attn.k_proj(x)
    torch.testing.assert_close(got_v, want["v_proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_q, want["q_proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want["k_proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k_other, want_other, rtol=1e-5, atol=1e-5)


def test_groups_that_cannot_share_a_weight_are_left_alone():
    # fp8_block weights: no row stacking (yet)
    assert fuse_projections(_model("w8a8-fp8-block")) == []
    torch.manual_seed(0)
    shape = DecoderShape(hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32, vocab=64, layers=1)
    m = lowbit.quantize_model(Decoder(shape, max_len=8, device="cpu").eval(), "w4a16-nvfp4")
    groups = fuse_projections(m, gated_mlp=False)          # k (64 rows) would start v at row 192: not a multiple of 128
    assert [g[0].rpartition(".")[2] for g in groups] == ["gate_proj"]
    assert isinstance(m.layers[0].q_proj, QuantLinear)


def test_checkpoints_and_parallel_plans_refuse_a_fused_model(tmp_path):
    m = _model("w4a16-nvfp4")
    fuse_projections(m, gated_mlp=False)
    with pytest.raises(ValueError, match="unfuse_projections"):
        lowbit.save_quantized(m, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    from lowbit.parallel.api import parallelize

    with pytest.raises(ValueError, match="unfuse_projections"):
        parallelize(m, device_mesh=None)


def test_compiled_step_traces_the_fused_members_in_one_graph():
    m = _model("w4a16-nvfp4")
    ids, pos = torch.randint(0, SHAPE.vocab, (1, 4)), torch.arange(4)
    want = _step(m, ids, pos)
    fuse_projections(m, gated_mlp=False)
    torch._dynamo.reset()
    fn = torch.compile(lambda i, p: m(i, p), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        clear_cache(m)
        got = fn(ids, pos).float()
        with torch._dynamo.config.patch(error_on_recompile=True):
            fn(ids, pos)                               # a second call: no recompile
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mod in m.modules():
        if isinstance(mod, FusedProjection):
            assert mod._out.x is None


def test_bad_model_argument():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fuse_projections("model")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        unfuse_projections(3)


# ------------------------------------------------------------------------------------------ gated MLPs

W4A16 = [s for s in SCHEMES if s.startswith("w4a16-")]


@pytest.mark.parametrize("scheme", W4A16)
def test_gated_mlp_runs_one_layer_with_the_product_inside_and_unfuses_to_the_same_weights(scheme):
    ref, fused, ids, pos, want = _reference_and_copy(scheme)
    groups = fuse_projections(fused, gated_mlp=True)
    assert sorted(g[0].rpartition(".")[2] for g in groups) == ["gate_proj"] * SHAPE.layers + ["q_proj"] * SHAPE.layers
    mlp = fused.layers[0].mlp
    assert isinstance(mlp, GatedMLP) and mlp.gate_up_proj.activation == "silu_and_mul"
    assert mlp.gate_up_proj.out_features == 2 * SHAPE.intermediate
    x = torch.randn(3, SHAPE.hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        assert mlp.gate_up_proj(x).shape == (3, SHAPE.intermediate)
        # the layer gives act(gate) * up of the stacked weight, formed in fp32 and rounded once
        gate, up = ref.layers[0].mlp.gate_proj, ref.layers[0].mlp.up_proj
        g32 = lowbit.ops.linear_reference(x, gate.weight_qtensor, out_dtype=torch.float32)
        u32 = lowbit.ops.linear_reference(x, up.weight_qtensor, out_dtype=torch.float32)
        exact = (torch.nn.functional.silu(g32) * u32).to(torch.bfloat16)
        torch.testing.assert_close(mlp.gate_up_proj(x), exact, rtol=0, atol=0)
    got = _step(fused, ids, pos)
    # the unfused block rounds gate, up, SiLU and the product to bf16 each: close, not equal
    assert ((got - want).norm() / want.norm()) < 2e-2
    assert unfuse_projections(fused)
    assert not any(isinstance(m, GatedMLP | FusedProjection) for m in fused.modules())
    _assert_same_state(ref.state_dict(), fused.state_dict())
    torch.testing.assert_close(_step(fused, ids, pos), want, rtol=0, atol=0)


def test_gated_mlp_only_for_weight_only_schemes_and_known_activations():
    for scheme in ("w4a4-nvfp4", "w4a8-mxfp4"):      # activation-quantized: sibling fusion only
        m = _model(scheme)
        fuse_projections(m, gated_mlp=True)
        assert not any(isinstance(mod, GatedMLP) for mod in m.modules())
        assert isinstance(m.layers[0].mlp.gate_proj, FusedProjection)
    m = _model("w4a16-int4")
    m.layers[0].mlp.act_fn = torch.nn.ReLU()          # no gated form of ReLU: left to the sibling fusion
    fuse_projections(m, gated_mlp=True)
    assert isinstance(m.layers[1].mlp, GatedMLP) and not isinstance(m.layers[0].mlp, GatedMLP)
    assert gated_activation(torch.nn.SiLU()) == "silu_and_mul"
    assert gated_activation(torch.nn.GELU()) == "gelu_and_mul"
    assert gated_activation(torch.nn.GELU(approximate="tanh")) == "gelu_tanh_and_mul"
    assert gated_activation(torch.nn.ReLU()) is None and gated_activation(None) is None
    with pytest.raises(ValueError, match="unfuse_projections"):
        lowbit.save_quantized(m, "/nonexistent/never-written")


def test_gated_mlp_compiles_fullgraph_without_recompiles():
    m = _model("w4a16-nvfp4")
    fuse_projections(m, gated_mlp=True)
    ids, pos = torch.randint(0, SHAPE.vocab, (1, 4)), torch.arange(4)
    want = _step(m, ids, pos)
    torch._dynamo.reset()
    fn = torch.compile(lambda i, p: m(i, p), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        clear_cache(m)
        got = fn(ids, pos).float()
        with torch._dynamo.config.patch(error_on_recompile=True):
            clear_cache(m)
            fn(ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gated_activation_of_lowbit_linear():
    q = lowbit.quantize(torch.randn(48, 64), "nvfp4")
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = x.float() @ lowbit.dequantize(q).T
    for act, f in (("silu_and_mul", torch.nn.functional.silu),
                   ("gelu_tanh_and_mul", lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        got = lowbit.linear(x, q, activation=act)
        assert got.shape == (2, 3, 24)
        want = (f(y[..., :24]) * y[..., 24:]).to(torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="even number of rows"):
        lowbit.linear(x, lowbit.quantize(torch.randn(47, 64), "nvfp4"), activation="silu_and_mul")
    with pytest.raises(ValueError, match="weight-only"):
        QuantLinear(64, 48, bias=False, scheme="w4a4-nvfp4", weight=lowbit.quantize(torch.randn(48, 64), "nvfp4"),
                    activation="silu_and_mul")


def test_gated_mlp_of_a_transformers_llama():
    # transformers' own LlamaMLP (its act_fn a transformers activation class): gated, computes within bf16
    # rounding of the unfused model, unfuses to the same weights
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300)
    torch.manual_seed(0)
    m = lowbit.quantize_model(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), "w4a16-int4")
    ref_state = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 300, (1, 7))
    with torch.no_grad():
        want = m(ids).logits.float()
        groups = fuse_projections(m, gated_mlp=True)
        assert ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj") in groups
        assert all(isinstance(layer.mlp, GatedMLP) for layer in m.model.layers)
        got = m(ids).logits.float()
    assert ((got - want).norm() / want.norm()) < 2e-2
    unfuse_projections(m)
    assert type(m.model.layers[0].mlp).__name__ == "LlamaMLP"
    _assert_same_state(ref_state, m.state_dict())


def test_members_share_their_group_holder_copies_get_their_own_and_the_registry_forgets_dead_groups():
    import copy
    import gc

    from lowbit.nn.fuse import FUSED_OUTPUTS

    m = _model("w4a16-nvfp4")
    fuse_projections(m, gated_mlp=False)
    attn = m.layers[0]
    keys = {n: getattr(attn, n)._out_key for n in ("q_proj", "k_proj", "v_proj")}
    assert len(set(keys.values())) == 1 and FUSED_OUTPUTS[keys["q_proj"]] is attn.q_proj._out
    ids, pos = torch.randint(0, SHAPE.vocab, (1, 3)), torch.arange(3)
    want = _step(m, ids, pos)
    for make in (copy.deepcopy, lambda model: torch.load(_saved(model), weights_only=False)):
        clone = make(m)
        c = clone.layers[0]
        ckeys = {getattr(c, n)._out_key for n in ("q_proj", "k_proj", "v_proj")}
        assert len(ckeys) == 1 and ckeys.isdisjoint(keys.values())   # one new holder for the copied group
        assert FUSED_OUTPUTS[next(iter(ckeys))] is c.q_proj._out is c.v_proj._out
        # interleaved calls of the original and the copy on the same input: each group serves its own output
        x = torch.randn(1, 2, SHAPE.hidden)
        with torch.no_grad():
            q = attn.q_proj(x)
            cq, ck = c.q_proj(x), c.k_proj(x)
            k = attn.k_proj(x)
        torch.testing.assert_close(ck, k, rtol=0, atol=0)
        torch.testing.assert_close(cq, q, rtol=0, atol=0)
        torch.testing.assert_close(_step(clone, ids, pos), want, rtol=0, atol=0)
        held = sorted(ckeys)
        del clone, c, make
        gc.collect()
        assert all(k not in FUSED_OUTPUTS for k in held)
    before = len(FUSED_OUTPUTS)
    del m, attn
    gc.collect()
    assert len(FUSED_OUTPUTS) == before - 2 * SHAPE.layers


def _saved(m):
    import io

    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return buf


def test_compiled_fused_members_leave_no_identity_guards():
    """The members of a fused group reach their shared output holder by the group's key in one table: reached
    through each member's own attribute, the holder cost two identity guards per group, evaluated in Python on
    every call of the compiled step."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    m = _model("w4a16-int4")
    fuse_projections(m, gated_mlp=False)

    def step(ids, pos):
        return m(ids, pos)

    torch._dynamo.reset()
    with torch.no_grad():
        clear_cache(m)
        torch.compile(step, backend="eager", fullgraph=True)(torch.randint(0, SHAPE.vocab, (1, 1)),
                                                              torch.tensor([0]))
    guards = str(_debug_get_cache_entry_list(step.__code__)[0].guard_manager)
    identity = [g for g in guards.splitlines() if "LAMBDA_GUARD" in g and "_out" in g.split("#")[0]]
    assert not identity, identity[:2]
    torch._dynamo.reset()
