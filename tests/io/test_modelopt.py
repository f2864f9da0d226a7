"""ModelOpt NVFP4 checkpoint tensors <-> nvfp4 QTensor (lowbit.io.modelopt)."""

import pytest
import torch

import lowbit
from lowbit.formats import codecs
from lowbit.formats.packing import unpack_fp4
from lowbit.formats.spec import E2M1
from lowbit.io.modelopt import from_modelopt_nvfp4, to_modelopt_nvfp4


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _weight(rows: int = 24, k: int = 128, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    x[0, :16] = 0
    x[1, 16:32] = 1e-30
    return x.to(dtype)


def _modelopt_dequant(t: dict) -> torch.Tensor:
    """ModelOpt's NVFP4QTensor.dequantize written out: e2m1 * (fp32(weight_scale) * weight_scale_2)."""
    values = codecs.decode_minifloat(unpack_fp4(t["weight"]), E2M1)
    block = t["weight_scale"].float() * t["weight_scale_2"]
    return (values.reshape(*block.shape, 16) * block.unsqueeze(-1)).reshape(values.shape)


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_to_modelopt_layout_and_scales(layout):
    w = _weight()
    q = lowbit.quantize(w, "nvfp4", scale_layout=layout)
    lin = lowbit.quantize(w, "nvfp4")
    igs = torch.tensor([300.0])
    t = to_modelopt_nvfp4(q, input_global_scale=igs)
    assert set(t) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (24, 64)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (24, 8)
    assert torch.equal(_u8(t["weight_scale"]), _u8(lin.scale))
    assert torch.equal(t["weight"], lin.data)
    # ModelOpt stores the divisors as fp32 scalars
    assert t["weight_scale_2"].dtype == torch.float32 and t["weight_scale_2"].shape == ()
    assert t["weight_scale_2"].item() == (1.0 / q.global_scale).item()
    assert t["input_scale"].shape == () and t["input_scale"].item() == torch.tensor(1 / 300.0).item()
    assert all(v.is_contiguous() for v in t.values())
    assert "input_scale" not in to_modelopt_nvfp4(q)


def test_to_modelopt_keeps_an_exact_divisor():
    # torchao's per-tensor scale already is ModelOpt's divisor amax/2688: it is written unchanged
    w = _weight(dtype=torch.float32)
    q = lowbit.quantize(w, "nvfp4", convention="torchao")
    t = to_modelopt_nvfp4(q)
    assert torch.equal(t["weight_scale_2"], q.params["per_tensor_scale"])
    assert t["weight_scale_2"].item() == torch.tensor(w.abs().max().item() / 2688, dtype=torch.float32).item()
    assert torch.equal(_modelopt_dequant(t), lowbit.dequantize(q))
    single = lowbit.quantize(w, "nvfp4", global_scale="none")
    assert to_modelopt_nvfp4(single)["weight_scale_2"].item() == 1.0


def test_from_modelopt_global_scale_and_dequant():
    w = _weight()
    t = to_modelopt_nvfp4(lowbit.quantize(w, "nvfp4"), input_global_scale=torch.tensor([50.0]))
    t["weight_scale_2"] = torch.tensor(0.0123456789)  # any divisor, not one lowbit produced
    q = from_modelopt_nvfp4(t)
    assert q.fmt == "nvfp4" and q.shape == (24, 128) and q.dtype == torch.bfloat16
    assert q.global_scale.shape == (1,) and torch.equal(q.global_scale, (1 / t["weight_scale_2"]).reshape(1))
    assert q.data.data_ptr() == t["weight"].data_ptr()
    # lowbit decodes ModelOpt's own product sf * weight_scale_2, bit for bit
    assert torch.equal(lowbit.dequantize(q), _modelopt_dequant(t))
    assert torch.equal(lowbit.dequantize(q, torch.bfloat16), _modelopt_dequant(t).to(torch.bfloat16))
    # and writes the same tensors back
    back = to_modelopt_nvfp4(q, input_global_scale=1 / t["input_scale"])
    for k in ("weight", "weight_scale", "weight_scale_2"):
        assert torch.equal(_u8(back[k]), _u8(t[k])), k
    prefixed = {f"model.layers.3.self_attn.q_proj.{k}": v for k, v in t.items()}
    assert torch.equal(from_modelopt_nvfp4(prefixed, dtype=torch.float16).data, q.data)
    assert from_modelopt_nvfp4(prefixed, dtype=torch.float16).dtype == torch.float16
    shaped = dict(t, weight_scale_2=t["weight_scale_2"].reshape(1))
    assert torch.equal(from_modelopt_nvfp4(shaped).global_scale, q.global_scale)


def test_modelopt_errors_name_the_rule():
    w = _weight()
    t = to_modelopt_nvfp4(lowbit.quantize(w, "nvfp4"))
    for missing in ("weight", "weight_scale", "weight_scale_2"):
        with pytest.raises(ValueError, match=missing):
            from_modelopt_nvfp4({k: v for k, v in t.items() if k != missing})
    with pytest.raises(TypeError, match="weight must be a 2-D uint8"):
        from_modelopt_nvfp4({**t, "weight": t["weight"].to(torch.int32)})
    with pytest.raises(TypeError, match="weight_scale must be a 2-D float8_e4m3fn"):
        from_modelopt_nvfp4({**t, "weight_scale": t["weight_scale"].float()})
    with pytest.raises(ValueError, match=r"weight must be \[out, in/2\]"):
        from_modelopt_nvfp4({**t, "weight": t["weight"][:, 1:]})
    with pytest.raises(TypeError, match="weight_scale_2 must be float32"):
        from_modelopt_nvfp4({**t, "weight_scale_2": t["weight_scale_2"].double()})
    with pytest.raises(ValueError, match="weight_scale_2 must hold one value"):
        from_modelopt_nvfp4({**t, "weight_scale_2": torch.ones(2)})
    with pytest.raises(ValueError, match="finite and > 0"):
        from_modelopt_nvfp4({**t, "weight_scale_2": torch.tensor(float("inf"))})
    with pytest.raises(ValueError, match="one module"):
        from_modelopt_nvfp4({"a.weight": t["weight"], "b.weight_scale": t["weight_scale"]})
    with pytest.raises(TypeError, match="tensors must be a mapping"):
        from_modelopt_nvfp4([t["weight"]])
    with pytest.raises(ValueError, match="nvfp4 QTensor"):
        to_modelopt_nvfp4(lowbit.quantize(w, "mxfp4"))
    with pytest.raises(ValueError, match="2-D weight"):
        to_modelopt_nvfp4(lowbit.quantize(w.reshape(2, 12, 128), "nvfp4"))
    with pytest.raises(ValueError, match="input_global_scale must be finite and > 0"):
        to_modelopt_nvfp4(lowbit.quantize(w, "nvfp4"), input_global_scale=torch.tensor([0.0]))
    with pytest.raises(TypeError, match="q must be a QTensor"):
        to_modelopt_nvfp4(t)


@pytest.mark.interop
def test_compressed_tensors_modelopt_converter_agrees():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    from lowbit.io.compressed_tensors import from_compressed_tensors, to_compressed_tensors

    q0 = lowbit.quantize(_weight(dtype=torch.float32), "nvfp4", scale_layout="swizzled")
    mo = to_modelopt_nvfp4(q0, input_global_scale=torch.tensor([77.0]))
    name = "model.layers.0.mlp.down_proj"
    converted = ModelOptNvfp4Converter().process({f"{name}.{k}": v.clone() for k, v in mo.items()})
    ct = {k.rpartition(".")[2]: v for k, v in converted.items()}
    assert set(ct) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
    ours = from_modelopt_nvfp4(mo)
    theirs = from_compressed_tensors(ct)
    assert torch.equal(ours.data, theirs.data) and torch.equal(_u8(ours.scale), _u8(theirs.scale))
    assert torch.equal(ours.global_scale, theirs.global_scale.reshape(1))
    mine = to_compressed_tensors(ours, input_global_scale=1 / mo["input_scale"])
    for k, v in ct.items():
        assert torch.equal(_u8(mine[k]), _u8(v.reshape(mine[k].shape))), k


@pytest.mark.interop
def test_torchao_nvfp4_tensor_through_modelopt_layout():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    w = _weight(dtype=torch.bfloat16)
    pts = per_tensor_amax_to_scale(torch.max(torch.abs(w)))
    t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=pts)
    mo = {"weight": t.qdata, "weight_scale": t.scale, "weight_scale_2": t.per_tensor_scale}
    q = from_modelopt_nvfp4(mo)
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(lowbit.dequantize(q, dt), t.dequantize(dt))
    lq = lowbit.quantize(w, "nvfp4", convention="torchao")
    assert all(torch.equal(_u8(a), _u8(b)) for a, b in zip(to_modelopt_nvfp4(lq).values(), mo.values()))
