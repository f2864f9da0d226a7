"""The prepared-weight path on CPU: it falls back to the public ops with the same results; the kernels the
``lowbit::w4a16_gemv`` triton_op launches survive Inductor's source pasting (their global constants are
rewritten into a triple-quoted string of generated code) and its mutation analysis finds the buffers they
write. The GPU behaviour is in tests/nn/test_prepared_gpu.py."""

import pytest
import torch

import lowbit
from lowbit.ops.prepared import PreparedWeight, prepare
from lowbit.nn import SCHEMES

triton = pytest.importorskip("triton")


def _gemv_kernels():
    from lowbit.kernels import _gemv_mma, _gemv_w4

    return [_gemv_w4.gemv_w4_fma_kernel, _gemv_w4.gemv_w4_dot_kernel, _gemv_mma.gemv_mma_kernel]


@pytest.mark.parametrize("i", range(3))
def test_inductor_pasted_kernel_source_compiles(i):
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    kernel = _gemv_kernels()[i]
    src = user_defined_triton_kernel_transitive_closure_source_code(kernel)
    # the wrapper writes async_compile.triton(name, '''<src>''') and the generated module is imported: the
    # string literal is evaluated, then the source inside it is compiled
    wrapped = "x = '''\n" + src + "\n'''"
    ns: dict = {}
    exec(compile(wrapped, "<wrapper>", "exec"), ns)
    compile(ns["x"], "<kernel module>", "exec")


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if SCHEMES[s].weight_only])
def test_cpu_prepared_call_equals_linear(scheme):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    layer = lowbit.nn.QuantLinear.from_linear(lin, scheme, activation="gelu")
    prep = prepare(layer.weight_qtensor, layer.scheme, "gelu")
    assert isinstance(prep, PreparedWeight) and prep.gemv is None and prep.facts is None  # no kernels on CPU
    for shape in [(1, 256), (3, 7, 256)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        b = layer.bias.to(x.dtype)
        assert torch.equal(prep(x, b), lowbit.linear(x, layer.weight_qtensor, b, "gelu"))
        assert torch.equal(layer(x), prep(x, b))
    xf = torch.randn(2, 256)
    assert layer(xf).dtype == torch.float32


def test_stale_after_in_place_update():
    torch.manual_seed(0)
    layer = lowbit.nn.QuantLinear.from_linear(torch.nn.Linear(128, 32).to(torch.bfloat16), "w4a16-int4")
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y = layer(x)
    prep = layer._prepared
    assert not prep.stale()
    with torch.no_grad():
        layer.weight_scale.mul_(2)
    assert prep.stale()
    y2 = layer(x)
    assert layer._prepared is not prep and not torch.equal(y, y2)
    with torch.inference_mode():  # inference tensors have no version counter: never stale, never an error
        q = lowbit.nn.QuantLinear.from_linear(torch.nn.Linear(128, 32).to(torch.bfloat16), "w4a16-nvfp4")
        q(x)
        assert q._prepared.versions == () and not q._prepared.stale()
    assert q(x).shape == (2, 32)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_scheme_compiles_fullgraph_and_runs_under_inference_mode(scheme):
    """torch.compile(fullgraph=True) of a QuantLinear equals its eager call for every scheme, and a layer made
    or called inside torch.inference_mode gives the same bits (CPU; the CUDA paths in test_prepared_gpu.py)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128).to(torch.bfloat16)
    layer = lowbit.nn.QuantLinear.from_linear(lin, scheme)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    want = layer(x)
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), want)
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
        inside = lowbit.nn.QuantLinear.from_linear(lin, scheme)
        assert torch.equal(inside(x), want)
    assert torch.equal(inside(x), want)


def test_pickle_and_deepcopy_drop_the_prepared_launches(tmp_path):
    import copy

    torch.manual_seed(0)
    layer = lowbit.nn.QuantLinear.from_linear(torch.nn.Linear(128, 32).to(torch.bfloat16), "w4a16-nvfp4")
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y = layer(x)
    assert layer._prepared is not None
    twin = copy.deepcopy(layer)
    assert twin._prepared is None and torch.equal(twin(x), y)
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert loaded._prepared is None and torch.equal(loaded(x), y)
    assert layer._prepared is not None  # the original keeps its own


def test_attribute_edits_re_prepare():
    torch.manual_seed(0)
    layer = lowbit.nn.QuantLinear.from_linear(torch.nn.Linear(128, 32).to(torch.bfloat16), "w4a16-int4")
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert torch.equal(layer(x), lowbit.linear(x, layer.weight_qtensor, layer.bias))
    layer.activation = "silu"
    assert torch.equal(layer(x), lowbit.linear(x, layer.weight_qtensor, layer.bias, "silu"))
    assert layer._prepared.activation == "silu"


class _TraceOnly(Exception):
    """Raised by the test backend instead of running the graph (the CUDA layouts are traced on CPU)."""


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-int4", "w8a8-fp8-block"])
def test_compiled_layers_share_scratch_and_plans_without_per_layer_guards(monkeypatch, scheme):
    """Under torch.compile every prepared layer of a device passes the same split-K scratch and placeholders.
    Read through each layer's own attributes, the same tensor reached by many paths costs the compiled step
    one identity guard (evaluated in Python) per layer and tensor on every call, which grew the host time of a
    compiled decode step with the layer count. Read through one table, they are one graph input each and
    leave no such guard. Likewise the static facts a traced call reads (shape, format codes, the tensor-core
    rule, device) come from a plan shared by equal layers and are guarded once, not once per layer. The CUDA
    preparation is forced on CPU; the graph is traced, never run."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from lowbit.kernels import scratch
    from lowbit.ops import policy

    monkeypatch.setattr(policy, "kernels_ready", lambda device, backend: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(scratch, "_TRACED", {})
    torch.manual_seed(0)
    layers = [lowbit.nn.QuantLinear.from_linear(torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16), scheme)
              for _ in range(4)]
    for layer in layers:
        layer._prepare()
        prep = layer._prepared
        assert prep.facts is not None or prep.fp8_traced is not None, "the traced path was not prepared"
    model = torch.nn.Sequential(*layers)

    def backend(gm, example_inputs):
        def run(*args):
            raise _TraceOnly
        return run

    def step(x):
        return model(x)

    torch._dynamo.reset()
    with pytest.raises(_TraceOnly):
        torch.compile(step, backend=backend, fullgraph=True)(torch.randn(1, 256, dtype=torch.bfloat16))
    entries = _debug_get_cache_entry_list(step.__code__)
    assert len(entries) == 1
    guards = str(entries[0].guard_manager)
    identity = [line for line in guards.splitlines() if "LAMBDA_GUARD" in line and "._prepared." in line.split("#")[0]]
    assert not identity, identity[:3]
    # and the shared tensors are read: the table is in the guards
    assert "_TRACED" in guards
    # the layers' static facts come from one shared plan: one key per layer, the plan's values once
    keys = {layer._prepared.gemv_plan if layer._prepared.gemv_plan >= 0 else layer._prepared.fp8_plan
            for layer in layers}
    assert len(keys) == 1
    assert "_prepared.facts" not in guards and "_prepared.k " not in guards
    plans = {line.split("PLANS[")[1].split("]")[0] for line in guards.splitlines() if "PLANS[" in line.split("#")[0]}
    assert len(plans) == 1
    torch._dynamo.reset()
