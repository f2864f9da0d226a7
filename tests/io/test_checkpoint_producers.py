"""load_quantized on checkpoints written by the real producers, run on CPU in tiny synthetic models:

- compressed-tensors 0.20 (llm-compressor's save path): ``apply_quantization_config`` + qparams from CT's own
  ``calculate_qparams`` / ``generate_gparam`` + ``ModelCompressor.compress_model`` + ``save_pretrained`` +
  ``update_config``, for the NVFP4A16, NVFP4, W4A16 (sym), W4A16_ASYM, MXFP4A16, MXFP4, MXFP8 and FP8_BLOCK presets;
- bitsandbytes 0.50.2: ``Linear4bit`` / ``Params4bit`` NF4 (plain and double quant) state dicts with the
  ``quantization_config`` of transformers' ``BitsAndBytesConfig``;
- AutoAWQ 0.2.9: ``WQLinear_GEMM.from_linear`` packing (``awq.utils.utils`` imports accelerate at module level
  only, so a stub module stands in for it) and ``packing_utils.unpack_reorder_pack`` for the GPTQ layout;
- transformers' fine-grained FP8 quantizer (``Fp8Quantize``) for the DeepSeek/HF ``weight_scale_inv`` layout;
- ModelOpt NVFP4 tensors from torchao's NVFP4 (its ``per_tensor_scale`` divisor is ModelOpt's ``weight_scale_2``),
  cross-checked with compressed-tensors' ``ModelOptNvfp4Converter``.

Each loaded QuantLinear must decode to exactly what the producer's own dequantizer gives.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.nn import QuantLinear

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
IDS = torch.arange(10).reshape(1, 10)


def _bits(t):
    return t.contiguous().view(INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def _llama(dtype=torch.bfloat16, hidden=128, inter=256, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()


def _linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def _qlinears(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _write(model_or_sd, d: Path, qc: dict, config) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    sd = model_or_sd if isinstance(model_or_sd, dict) else model_or_sd.state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, d / "model.safetensors")
    cfg = json.loads(config.to_json_string(use_diff=False))
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ---------------------------------------------------------------------------------------------- compressed-tensors


def _ct_checkpoint(preset: str, d: Path, act_absmax: float = 3.0):
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    model = _llama()
    ref = {n: m.weight.detach().clone() for n, m in _linears(model).items()}
    qc = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, qc)
    for mod in _linears(model).values():
        args = mod.quantization_scheme.weights
        w = mod.weight.data
        gs = None
        if args.strategy == "block":
            bn, bk = args.block_structure
            blocks = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
            mins, maxs = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        else:
            groups = w.reshape(w.shape[0], -1, args.group_size)
            mins, maxs = groups.amin(-1), groups.amax(-1)
        if args.strategy == "tensor_group":
            gs = generate_gparam(w.amin(), w.amax())
            mod.weight_global_scale.data.copy_(gs.reshape(mod.weight_global_scale.shape))
        scale, zp = calculate_qparams(mins, maxs, args, global_scale=gs)
        mod.weight_scale.data.copy_(scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape))
        if hasattr(mod, "weight_zero_point") and not args.symmetric:
            mod.weight_zero_point.data.copy_(
                zp.to(mod.weight_zero_point.dtype).reshape(mod.weight_zero_point.shape)
            )
        if hasattr(mod, "input_global_scale"):
            a = torch.tensor(act_absmax)
            mod.input_global_scale.data.copy_(generate_gparam(-a, a).reshape(mod.input_global_scale.shape))
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(d)
    comp.update_config(d)
    return model, ref


def _ct_decompressed(d: Path) -> dict[str, torch.Tensor]:
    """Each module's weight as compressed-tensors' own compressor decodes the saved tensors."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    comp = BaseCompressor.get_value_from_registry(group["format"] or qc["format"])
    sd = load_file(d / "model.safetensors")
    mods = {k.rpartition(".")[0] for k in sd if k.endswith(("weight_packed", "weight_scale"))}
    out = {}
    for m in mods:
        local = {k[len(m) + 1 :]: v for k, v in sd.items() if k.startswith(m + ".")}
        out[m] = comp.decompress(local, scheme)["weight"]
    return out


CT_PRESETS = {
    "NVFP4A16": "w4a16-nvfp4",
    "NVFP4": "w4a4-nvfp4",
    "W4A16": "w4a16-int4",
    "W4A16_ASYM": "w4a16-int4",
    "MXFP4A16": "w4a16-mxfp4",
    "MXFP4": "w4a4-mxfp4",
    "MXFP8": "w8a8-mxfp8",
    "FP8_BLOCK": "w8a8-fp8-block",
}


@pytest.mark.parametrize("preset", list(CT_PRESETS))
def test_load_compressed_tensors_checkpoint(tmp_path, preset):
    pytest.importorskip("compressed_tensors")
    _, ref = _ct_checkpoint(preset, tmp_path / "ct")
    theirs = _ct_decompressed(tmp_path / "ct")
    model = lowbit.load_quantized(tmp_path / "ct")
    q = _qlinears(model)
    assert set(q) == set(ref) == set(theirs) and type(model.lm_head) is torch.nn.Linear
    for name, m in q.items():
        assert m.scheme.name == CT_PRESETS[preset], name
        t = theirs[name]
        assert torch.equal(_bits(m.dequantize_weight(t.dtype)), _bits(t)), name
        # and the quantized weight is close to the original one
        cos = torch.nn.functional.cosine_similarity(
            m.dequantize_weight().flatten(), ref[name].float().flatten(), dim=0
        )
        assert cos > 0.98, (name, cos)
    if preset == "NVFP4":
        assert all(m.input_global_scale is not None for m in q.values())
        assert torch.equal(q["model.layers.0.mlp.up_proj"].input_global_scale, torch.tensor([2688.0 / 3.0]))
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


# ---------------------------------------------------------------------------------------------- bitsandbytes


@pytest.mark.parametrize("double_quant", [False, True])
def test_load_bitsandbytes_nf4_checkpoint(tmp_path, double_quant, bnb_dequantize_4bit):
    bnb = pytest.importorskip("bitsandbytes")

    model = _llama()
    parents = dict(model.named_modules())
    for name, lin in _linears(model).items():
        new = bnb.nn.Linear4bit(
            lin.in_features, lin.out_features, bias=lin.bias is not None, quant_type="nf4",
            compress_statistics=double_quant, compute_dtype=torch.bfloat16,
        )  # fmt: skip
        new.weight = bnb.nn.Params4bit(
            lin.weight.data.clone(), requires_grad=False, quant_type="nf4", compress_statistics=double_quant
        )
        new = new.to("cpu")
        parent, _, child = name.rpartition(".")
        setattr(parents[parent], child, new)
    qc = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=["lm_head"],
    ).to_dict()  # fmt: skip
    d = _write(model, tmp_path / "bnb", qc, model.config)
    loaded = lowbit.load_quantized(d)
    q = _qlinears(loaded)
    bnb_mods = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert set(q) == set(bnb_mods)
    for name, m in q.items():
        assert m.scheme.name == "w4a16-nf4" and (m.weight_nested_scale is not None) == double_quant
        w = bnb_mods[name].weight
        theirs = bnb_dequantize_4bit(w.data, w.quant_state)
        assert torch.equal(_bits(m.dequantize_weight(torch.bfloat16)), _bits(theirs)), name
    with torch.no_grad():
        assert torch.isfinite(loaded(IDS).logits).all()


# ---------------------------------------------------------------------------------------------- AutoAWQ and GPTQ


def _awq_modules():
    """AutoAWQ's ``gemm`` and ``packing_utils`` modules (``import awq`` needs accelerate, which only
    ``awq.utils.utils`` imports at module level; a stub stands in for it while loading)."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed")
    saved = {k: v for k, v in sys.modules.items() if k == "accelerate" or k == "awq" or k.startswith("awq.")}
    try:
        if "accelerate" not in sys.modules:
            sys.modules["accelerate"] = types.ModuleType("accelerate")
        root = Path(next(iter(spec.submodule_search_locations)))
        for pkg in ("awq", "awq.modules", "awq.modules.linear", "awq.utils"):
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
            sys.modules[pkg] = mod
        gemm = importlib.import_module("awq.modules.linear.gemm")
        packing = importlib.import_module("awq.utils.packing_utils")
        return gemm, packing
    finally:
        for k in [k for k in sys.modules if k == "accelerate" or k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    gemm, packing = _awq_modules()
    model = _llama(torch.float16)
    group = 64
    sd = {}
    parents = dict(model.named_modules())
    wq = {}
    for name, lin in _linears(model).items():
        # AutoAWQ quantizes with pseudo_quantize_tensor (lowbit's int4_awq reproduces it bit for bit, see
        # tests/io/test_int4_interop.py), then packs the fake-quantized weight with WQLinear_GEMM.from_linear
        q = lowbit.quantize(lin.weight.detach(), "int4_awq", group_size=group)
        zeros = packing.unpack_awq(q.zeros, q.zeros, 4)[1]
        zeros = packing.reverse_awq_order(zeros, zeros, 4)[1] & 0xF
        fake = torch.nn.Linear(lin.in_features, lin.out_features, bias=False, dtype=torch.float16)
        fake.weight.data = lowbit.dequantize(q, torch.float16)
        awq_lin = gemm.WQLinear_GEMM.from_linear(fake, 4, group, scales=q.scale, zeros=zeros)
        wq[name] = awq_lin
        for k in ("qweight", "qzeros", "scales"):
            sd[f"{name}.{k}"] = getattr(awq_lin, k)
        parent, _, child = name.rpartition(".")
        setattr(parents[parent], child, torch.nn.Identity())
    sd.update(model.state_dict())
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}  # fmt: skip
    d = _write(sd, tmp_path_factory.mktemp("awq") / "awq", qc, model.config)
    return d, wq, packing


def test_load_autoawq_checkpoint(awq_checkpoint):
    d, wq, packing = awq_checkpoint
    loaded = lowbit.load_quantized(d)
    q = _qlinears(loaded)
    assert set(q) == set(wq)
    for name, m in q.items():
        a = wq[name]
        assert m.scheme.name == "w4a16-int4" and m.group_size == 64
        assert torch.equal(m.weight_data, a.qweight) and torch.equal(m.weight_zeros, a.qzeros)
        theirs = packing.dequantize_gemm(a.qweight, a.qzeros, a.scales, 4, 64).t()
        assert torch.equal(_bits(m.dequantize_weight(torch.float16)), _bits(theirs)), name
    with torch.no_grad():
        assert torch.isfinite(loaded(IDS).logits).all()


def test_load_gptq_checkpoint_from_autoawq_converter(tmp_path, awq_checkpoint):
    """AutoAWQ's own AWQ -> GPTQ/exllama repacker writes the GPTQ v1 checkpoint."""
    from safetensors.torch import load_file

    d, wq, packing = awq_checkpoint
    sd = load_file(d / "model.safetensors")
    for name, a in wq.items():
        qweight, qzeros = packing.unpack_reorder_pack(a.qweight, a.qzeros, 4)
        del sd[f"{name}.qweight"], sd[f"{name}.qzeros"]
        sd[f"{name}.qweight"], sd[f"{name}.qzeros"] = qweight, qzeros
        sd[f"{name}.g_idx"] = torch.arange(a.in_features, dtype=torch.int32) // 64
    cfg = transformers.AutoConfig.from_pretrained(d)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
          "checkpoint_format": "gptq"}  # fmt: skip
    gptq = lowbit.load_quantized(_write(sd, tmp_path / "gptq", qc, cfg))
    awq = lowbit.load_quantized(d)
    qa, qg = _qlinears(awq), _qlinears(gptq)
    for name in qa:
        for f in ("weight_data", "weight_zeros", "weight_scale"):
            assert torch.equal(getattr(qa[name], f), getattr(qg[name], f)), (name, f)
    # GPTQModel's v2 format stores the raw zero points
    v2 = dict(sd)
    for name in wq:
        v2[f"{name}.qzeros"] = (v2[f"{name}.qzeros"].to(torch.int64) + 0x11111111).remainder(2**32)
        v2[f"{name}.qzeros"] = torch.where(
            v2[f"{name}.qzeros"] >= 2**31, v2[f"{name}.qzeros"] - 2**32, v2[f"{name}.qzeros"]
        ).to(torch.int32)
    gptq2 = lowbit.load_quantized(_write(v2, tmp_path / "gptq2", dict(qc, checkpoint_format="gptq_v2"), cfg))
    for name, m in _qlinears(gptq2).items():
        assert torch.equal(m.weight_zeros, qa[name].weight_zeros), name
    qc["desc_act"] = True
    d2 = _write(sd, tmp_path / "gptq-act", qc, cfg)
    with pytest.raises(ValueError, match="desc_act=true"):
        lowbit.load_quantized(d2)


# ---------------------------------------------------------------------------------------------- HF / DeepSeek FP8


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_load_transformers_fp8_block_checkpoint(tmp_path, scale_fmt):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    model = _llama()
    config = transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt=scale_fmt)
    op = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    sd = dict(model.state_dict())
    produced = {}
    for name in _linears(model):
        out = op.convert({f"{name}.weight": sd.pop(f"{name}.weight")})
        sd.update(out)
        produced[name] = out
    qc = config.to_dict()
    qc["modules_to_not_convert"] = ["lm_head"]
    loaded = lowbit.load_quantized(_write(sd, tmp_path / "fp8", qc, model.config))
    q = _qlinears(loaded)
    assert set(q) == set(produced)
    for name, m in q.items():
        w, s = produced[name][f"{name}.weight"], produced[name][f"{name}.weight_scale_inv"]
        assert m.scheme.name == "w8a8-fp8-block"
        # DeepSeek/transformers dequantization: fp32(weight) * weight_scale_inv per 128x128 block
        theirs = (w.float().reshape(w.shape[0] // 128, 128, -1, 128) * s.float()[:, None, :, None]).reshape(
            w.shape
        )
        assert torch.equal(m.dequantize_weight(torch.float32), theirs), name
    with torch.no_grad():
        assert torch.isfinite(loaded(IDS).logits).all()


# ---------------------------------------------------------------------------------------------- ModelOpt NVFP4


def test_load_modelopt_nvfp4_checkpoint_and_ct_converter_agree(tmp_path):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    model = _llama()
    sd = dict(model.state_dict())
    act_amax = torch.tensor(5.0)
    ref = {}
    for name in _linears(model):
        w = sd.pop(f"{name}.weight")
        pts = per_tensor_amax_to_scale(w.abs().amax().float())
        t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=pts)
        sd[f"{name}.weight"] = t.qdata.view(torch.uint8)
        sd[f"{name}.weight_scale"] = t.scale.view(torch.float8_e4m3fn).reshape(w.shape[0], -1)
        sd[f"{name}.weight_scale_2"] = pts.reshape(())
        sd[f"{name}.input_scale"] = per_tensor_amax_to_scale(act_amax).reshape(())
        ref[name] = t.dequantize(torch.float32)
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"],
          "kv_cache_quant_algo": None}  # fmt: skip
    d = _write(sd, tmp_path / "mo", qc, model.config)
    (d / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": qc})
    )
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]  # older ModelOpt exports only write hf_quant_config.json
    (d / "config.json").write_text(json.dumps(cfg))
    loaded = lowbit.load_quantized(d)
    q = _qlinears(loaded)
    for name, m in q.items():
        assert m.scheme.name == "w4a4-nvfp4"
        assert torch.equal(m.dequantize_weight(torch.float32), ref[name]), name
        assert torch.equal(m.input_global_scale, (1.0 / per_tensor_amax_to_scale(act_amax)).reshape(1))
    with torch.no_grad():
        assert torch.isfinite(loaded(IDS).logits).all()
