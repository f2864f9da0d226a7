"""DeepSeek-V3 FP8 checkpoint interop: weight / weight_scale_inv tensors and the HF quantization_config."""

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lowbit.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from lowbit.io.deepseek import deepseek_quantization_config, from_deepseek_fp8, to_deepseek_fp8


def _weight(n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** (torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=g) * 6 - 4)
    mag = mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (torch.randn(n, k, generator=g) * mag).to(dtype)


def _weight_dequant(weight, scale, dtype):
    """DeepSeek ``weight_dequant``: each 128x128 tile times its fp32 scale, then stored in ``dtype``."""
    out = torch.empty(weight.shape, dtype=dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile * scale[i, j]).to(dtype)
    return out


def test_quantization_config_is_deepseeks():
    cfg = deepseek_quantization_config()
    assert cfg == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]
    }
    assert json.dumps(cfg, sort_keys=True) == (
        '{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", '
        '"weight_block_size": [128, 128]}'
    )
    cfg["weight_block_size"].append(1)
    assert deepseek_quantization_config()["weight_block_size"] == [128, 128], "each call returns a fresh dict"


def test_golden_weight_scale_inv_is_a_multiplier():
    # bytes 0x38 = 1.0, 0xC0 = -2.0, 0x7E = 448, 0x01 = 2^-9; weight_scale_inv multiplies (README_WEIGHTS.md)
    weight = torch.tensor([[0x38, 0xC0], [0x7E, 0x01]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = from_deepseek_fp8(weight, torch.tensor([[0.5]]), dtype=torch.float32)
    assert dequantize_fp8_block(q).tolist() == [[0.5, -1.0], [224.0, 2.0**-10]]


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (1, 1), (129, 7)])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_round_trip_through_checkpoint_tensors(shape, scale_fmt):
    w = _weight(*shape, seed=shape[0] + shape[1])
    before = w.clone()
    q = quantize_fp8_block(w, block=(128, 128), scale_fmt=scale_fmt)
    tensors = to_deepseek_fp8(q)
    assert sorted(tensors) == ["weight", "weight_scale_inv"]
    weight, sinv = tensors["weight"], tensors["weight_scale_inv"]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == shape and weight.is_contiguous()
    assert sinv.dtype == torch.float32
    assert sinv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(weight.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(sinv.view(torch.int32), q.scale.view(torch.int32))

    back = from_deepseek_fp8(weight, sinv, scale_fmt=scale_fmt)
    assert back.fmt == "fp8_block" and back.shape == shape and back.dtype == torch.bfloat16
    assert back.params == {"block": (128, 128), "scale_fmt": scale_fmt}
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back.scale.view(torch.int32), q.scale.view(torch.int32))
    got = dequantize_fp8_block(back, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), _weight_dequant(weight, sinv, torch.bfloat16).view(torch.int16))
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))


def test_round_trip_through_safetensors_bytes():
    w = _weight(200, 300, seed=1)
    q = quantize_fp8_block(w, block=(128, 128))
    prefix = "model.layers.0.mlp.down_proj."
    blob = st_save({prefix + k: v for k, v in to_deepseek_fp8(q).items()})
    loaded = st_load(blob)
    assert loaded[prefix + "weight"].dtype == torch.float8_e4m3fn
    back = from_deepseek_fp8(loaded[prefix + "weight"], loaded[prefix + "weight_scale_inv"])
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back.scale, q.scale)
    assert torch.equal(dequantize_fp8_block(back), dequantize_fp8_block(q))


def test_empty_and_non_contiguous_weights():
    q = from_deepseek_fp8(torch.empty(0, 300, dtype=torch.float8_e4m3fn), torch.empty(0, 3))
    assert dequantize_fp8_block(q).shape == (0, 300)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2)
    codes[codes == 0x7F] = 0x00
    codes[codes == 0xFF] = 0x00
    base = codes.reshape(2, 256).view(torch.float8_e4m3fn)
    weight = base.t()  # [256, 2], not contiguous
    q = from_deepseek_fp8(weight, torch.tensor([[2.0], [0.25]]), dtype=torch.float32)
    want = torch.cat([weight[:128].float() * 2.0, weight[128:].float() * 0.25])
    assert torch.equal(dequantize_fp8_block(q), want)
    assert to_deepseek_fp8(q)["weight"].is_contiguous()


def test_ue8m0_flag_checks_powers_of_two():
    weight = torch.zeros(2, 2, dtype=torch.float8_e4m3fn)
    assert from_deepseek_fp8(weight, torch.tensor([[0.5]]), scale_fmt="ue8m0").params["scale_fmt"] == "ue8m0"
    with pytest.raises(ValueError, match="weight_scale_inv must hold positive normal powers of two"):
        from_deepseek_fp8(weight, torch.tensor([[0.3]]), scale_fmt="ue8m0")
    with pytest.raises(ValueError, match="scale_fmt must be None or 'ue8m0'"):
        from_deepseek_fp8(weight, torch.tensor([[0.5]]), scale_fmt="e8m0")


def test_from_deepseek_fp8_bad_inputs():
    w = torch.zeros(130, 300, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 3)
    with pytest.raises(TypeError, match="weight must be float8_e4m3fn"):
        from_deepseek_fp8(w.view(torch.uint8), s)
    with pytest.raises(TypeError, match="weight must be float8_e4m3fn"):
        from_deepseek_fp8(torch.zeros(130, 300, dtype=torch.bfloat16), s)
    with pytest.raises(TypeError, match="weight_scale_inv must be float32"):
        from_deepseek_fp8(w, s.bfloat16())
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        from_deepseek_fp8([[0.0]], s)
    with pytest.raises(TypeError, match="weight_scale_inv must be a torch.Tensor"):
        from_deepseek_fp8(w, 1.0)
    with pytest.raises(ValueError, match=r"weight must be 2-D \[N, K\]"):
        from_deepseek_fp8(w.reshape(2, 65, 300), s)
    with pytest.raises(ValueError, match=r"must have shape \[ceil\(N/128\), ceil\(K/128\)\] = \[2, 3\]"):
        from_deepseek_fp8(w, torch.ones(1, 2))  # floor(N/128) x floor(K/128): the edge blocks are missing
    with pytest.raises(ValueError, match="weight_scale_inv must have shape"):
        from_deepseek_fp8(w, torch.ones(3, 2))  # transposed
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        from_deepseek_fp8(w, s, dtype=torch.int8)


def test_to_deepseek_fp8_bad_inputs():
    act = quantize_fp8_block(torch.randn(4, 256))
    with pytest.raises(ValueError, match=r"q must use block \(128, 128\)"):
        to_deepseek_fp8(act)
    with pytest.raises(TypeError, match="q must be a QTensor"):
        to_deepseek_fp8({"weight": act.data})
    q = quantize_fp8_block(torch.randn(130, 256), block=(128, 128))
    # an inconsistent QTensor is refused where it is built
    with pytest.raises(TypeError, match=r"QTensor\(mxfp8_e4m3\): scale must be float8_e8m0fnu"):
        to_deepseek_fp8(replace(q, fmt="mxfp8_e4m3"))
    with pytest.raises(ValueError, match="q.scale must have shape"):
        to_deepseek_fp8(replace(q, scale=q.scale[:1]))
