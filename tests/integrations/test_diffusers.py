"""lowbit on diffusers transformers (CPU, tiny models with random weights built from configs, nothing
downloaded): quantization with the DiT defaults, the error of a quantized denoising step against bf16,
calibration over denoising timesteps (static NVFP4 activation scales, the AWQ search), checkpoints in
diffusers' layout loaded back, and a real WanPipeline (no text encoder: prompt embeddings given) quantized
and calibrated by its own call."""

import copy
import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import lowbit  # noqa: E402
from lowbit.integrations import diffusers as lbd  # noqa: E402
from lowbit.nn import QuantLinear  # noqa: E402
from lowbit.nn.awq_search import find_groups  # noqa: E402

EIGHT_BIT = ("w8a8-fp8-block", "w8a8-mxfp8")
W4A16 = ("w4a16-nvfp4", "w4a16-mxfp4", "w4a16-nf4", "w4a16-bnb-fp4", "w4a16-int4", "w4a16-fp4b32")
W4A4 = ("w4a4-nvfp4", "w4a4-mxfp4", "w4a8-mxfp4")


def tiny_wan(seed: int = 0, gate_std: float = 0.5) -> torch.nn.Module:
    """A 2-block Wan transformer, 128 wide (4 heads of 32), FFN 256, text 64, in bf16.

    diffusers initialises each block's ``scale_shift_table`` (shift, scale and gate of the AdaLN modulation)
    at N(0, 1/dim): the blocks' outputs, gated by it, would vanish in the residual stream and any quantization
    error with them (w4a16 cosine 0.9998). At ``gate_std`` 0.5 the blocks carry weight, as in a trained model,
    and the quantization error shows (fp8 0.9998, nvfp4 0.9986, mxfp4 0.9983)."""
    torch.manual_seed(seed)
    m = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=64, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    with torch.no_grad():
        for b in m.blocks:
            b.scale_shift_table.normal_(0.0, gate_std)
            b.norm2.weight.uniform_(0.5, 1.5)  # an affine cross-attention norm AWQ can fold a scale into
    return to_bf16(m)


def to_bf16(m: torch.nn.Module) -> torch.nn.Module:
    """bf16 as ``from_pretrained(torch_dtype=torch.bfloat16)`` makes it: the modules of the class's
    ``_keep_in_fp32_modules`` (Wan: rope, time embedder, norms, modulation tables) stay fp32."""
    keep = set(getattr(m, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if keep & set(name.split(".")) else torch.bfloat16)
    return m.eval()


def wan_inputs(seed: int = 1, timestep: float = 500.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g).bfloat16(),  # 2 x 4 x 4 = 32 tokens
        "timestep": torch.tensor([timestep]),
        "encoder_hidden_states": torch.randn(1, 16, 64, generator=g).bfloat16(),
        "return_dict": False,
    }


def tiny_sd3(seed: int = 0) -> torch.nn.Module:
    """A 2-block SD3 transformer, 128 wide. The AdaLN-Zero modulation weights are scaled by 10 so the gates
    are of order one (at diffusers' init every scheme's cosine is above 0.9999: the residual stream
    drowns the blocks)."""
    torch.manual_seed(seed)
    m = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=64, caption_projection_dim=128, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=16,
    )  # fmt: skip
    with torch.no_grad():
        for n, mod in m.named_modules():
            if n.endswith(("norm1.linear", "norm1_context.linear")):
                mod.weight.mul_(10.0)
    return to_bf16(m)


def sd3_inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g).bfloat16(),
        "encoder_hidden_states": torch.randn(1, 12, 64, generator=g).bfloat16(),
        "pooled_projections": torch.randn(1, 64, generator=g).bfloat16(),
        "timestep": torch.tensor([500.0]),
        "return_dict": False,
    }


def _quantized_names(m):
    return {n for n, x in m.named_modules() if isinstance(x, QuantLinear)}


# ---------------------------------------------------------------------------------------------- quantize


def test_dit_defaults_quantize_the_blocks_only():
    m = lbd.quantize_transformer(tiny_wan(), "w4a16-nvfp4")
    q = _quantized_names(m)
    assert len(q) == 2 * 10  # q, k, v, out of two attentions + two FFN linears, per block
    assert all(n.startswith("blocks.") for n in q)
    assert type(m.proj_out) is torch.nn.Linear
    assert type(m.condition_embedder.time_proj) is torch.nn.Linear


@pytest.mark.parametrize("scheme", EIGHT_BIT + W4A16 + W4A4)
def test_wan_denoising_step_error(scheme):
    ref = tiny_wan()
    inputs = wan_inputs()
    q = lbd.quantize_transformer(copy.deepcopy(ref), scheme)
    err = lbd.denoise_step_error(ref, q, inputs)
    # measured on this model (CPU reference path): 8-bit 0.99981-0.99982 (34.3 dB), w4a16 0.99814-0.99922
    # (24.3-28.0 dB), w4a4-nvfp4 0.99769 (23.3 dB), w4a4-mxfp4 0.99632 (21.3 dB), w4a8-mxfp4 0.9982 (24.4 dB)
    floor = 0.999 if scheme in EIGHT_BIT else 0.99
    assert err["cosine"] >= floor, err
    assert err["cosine"] < 1.0 and math_finite(err["sqnr_db"])  # the step really ran quantized
    assert err["sqnr_db"] > (30 if scheme in EIGHT_BIT else 18), err


def math_finite(x):
    return x == x and abs(x) != float("inf")


def test_eight_bit_error_is_far_below_four_bit():
    """The metric separates the schemes: fp8 keeps about 10 dB more of the signal than nvfp4 weights, and a
    corrupted quantized weight drops the cosine below the 4-bit floor."""
    ref, inputs = tiny_wan(), wan_inputs()
    errs = lbd.compare_schemes(ref, ["w8a8-fp8-block", "w4a16-nvfp4"], inputs)
    assert errs["w8a8-fp8-block"]["sqnr_db"] > errs["w4a16-nvfp4"]["sqnr_db"] + 6, errs
    broken = lbd.quantize_transformer(copy.deepcopy(ref), "w4a16-nvfp4")
    with torch.no_grad():
        data = broken.blocks[0].ffn.net[2].weight_data
        data.copy_(data.flip(0))  # rows swapped: a wrong layout
    assert lbd.denoise_step_error(ref, broken, inputs)["cosine"] < 0.99


def test_sd3_denoising_step_error():
    ref, inputs = tiny_sd3(), sd3_inputs()
    errs = lbd.compare_schemes(ref, ["w8a8-fp8-block", "w4a16-nvfp4", "w4a4-nvfp4"], inputs)
    # measured: fp8 0.99944 (29.5 dB), w4a16-nvfp4 0.99616 (21.2 dB), w4a4-nvfp4 0.99531 (20.3 dB)
    assert errs["w8a8-fp8-block"]["cosine"] >= 0.999, errs
    assert errs["w4a16-nvfp4"]["cosine"] >= 0.99, errs
    assert errs["w4a4-nvfp4"]["cosine"] >= 0.99, errs
    assert errs["w8a8-fp8-block"]["sqnr_db"] > errs["w4a16-nvfp4"]["sqnr_db"] + 6, errs
    q = lbd.quantize_transformer(copy.deepcopy(ref), "w4a16-nvfp4")
    names = _quantized_names(q)
    assert names and all(n.startswith("transformer_blocks.") for n in names)
    assert type(q.context_embedder) is torch.nn.Linear and type(q.proj_out) is torch.nn.Linear


def test_output_error_values_and_inputs():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    e = lbd.output_error(r, torch.tensor([1.0, 0.1, 0.0, 0.0]))
    assert e["sqnr_db"] == pytest.approx(20.0) and e["max_abs_err"] == pytest.approx(0.1)
    assert e["cosine"] == pytest.approx(1 / (1.01**0.5))
    assert lbd.output_error(r, r.clone())["sqnr_db"] == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        lbd.output_error(r, torch.zeros(3))
    with pytest.raises(TypeError, match="inputs must be a dict"):
        lbd.denoise_step_error(torch.nn.Identity(), torch.nn.Identity(), [1])


# ---------------------------------------------------------------------------------------------- calibration


def test_denoising_calibration_runs_a_flow_matching_trajectory():
    m = tiny_wan()
    inputs = {k: v for k, v in wan_inputs().items() if k != "timestep"}
    cal = lbd.DenoisingCalibration(inputs, num_steps=4)
    seen = []
    h = m.register_forward_pre_hook(lambda mod, a, kw: seen.append(float(kw["timestep"][0])), with_kwargs=True)
    final = cal(m)
    h.remove()
    assert seen == [1000.0, 750.0, 500.0, 250.0] == cal.timesteps_run
    # Euler steps: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v_i; replayed here by hand
    x = inputs["hidden_states"].clone()
    with torch.no_grad():
        for t, t_next in zip(seen, seen[1:] + [0.0]):
            v = m(hidden_states=x, timestep=torch.tensor([t]), **{k: v for k, v in inputs.items()
                                                                   if k != "hidden_states"})[0]
            x = (x.float() + (t_next - t) / 1000 * v.float()).to(x.dtype)
    assert torch.equal(final, x)
    assert not torch.equal(final, inputs["hidden_states"])


def test_denoising_calibration_with_a_diffusers_scheduler():
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    inputs = {k: v for k, v in wan_inputs().items() if k != "timestep"}
    cal = lbd.DenoisingCalibration(inputs, num_steps=3, scheduler=sched)
    cal(tiny_wan())
    sched.set_timesteps(3)
    assert cal.timesteps_run == [float(t) for t in sched.timesteps]
    assert cal.timesteps_run[0] > 900 and len(set(cal.timesteps_run)) == 3


def test_denoising_calibration_rejects_bad_arguments():
    inputs = {k: v for k, v in wan_inputs().items() if k != "timestep"}
    with pytest.raises(ValueError, match="num_steps"):
        lbd.DenoisingCalibration(inputs, num_steps=0)
    with pytest.raises(ValueError, match="timesteps must be"):
        lbd.DenoisingCalibration(inputs, timesteps=[500, 1200])
    with pytest.raises(ValueError, match="must not hold 'timestep'"):
        lbd.DenoisingCalibration(wan_inputs())
    with pytest.raises(ValueError, match="latents_key"):
        lbd.DenoisingCalibration({"x": 1})
    with pytest.raises(TypeError, match="inputs must be a dict"):
        lbd.DenoisingCalibration([1, 2])
    with pytest.raises(ValueError, match="not both"):
        lbd.DenoisingCalibration(inputs, timesteps=[1.0], scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def test_static_nvfp4_scales_cover_every_timestep():
    """w4a4-nvfp4's static input_global_scale is 2688 / (absmax of the layer's input over all calibration
    timesteps): the max over the steps, not the first step's."""
    ref = tiny_wan()
    inputs = {k: v for k, v in wan_inputs().items() if k != "timestep"}
    cal = lbd.DenoisingCalibration(inputs, timesteps=[999, 600, 300, 50], update_latents=False)
    names = ("blocks.0.attn1.to_q", "blocks.1.ffn.net.2")
    per_step = {n: [] for n in names}
    mods = dict(ref.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda m, a, n=n: per_step[n].append(float(a[0].float().abs().max())))
             for n in names]
    cal(ref)
    for h in hooks:
        h.remove()
    q = lbd.quantize_transformer(copy.deepcopy(ref), "w4a4-nvfp4", calibration=cal)
    qmods = dict(q.named_modules())
    for n in names:
        assert len(set(per_step[n])) > 1  # the timestep changes the activations (AdaLN modulation)
        got = float(qmods[n].input_global_scale)
        assert got == pytest.approx(2688.0 / max(per_step[n]), rel=1e-6)
        assert got < 2688.0 / per_step[n][0] or max(per_step[n]) == per_step[n][0]
    # calibrated static scales keep the step's error where dynamic per-tensor scales have it
    err_static = lbd.denoise_step_error(ref, q, wan_inputs())
    assert err_static["cosine"] >= 0.99, err_static


def test_awq_on_wan_folds_into_the_attention_and_cross_norm():
    ref = tiny_wan()
    groups = {(g.prev, g.linears) for g in find_groups(ref)}
    assert ("blocks.0.attn1.to_v", ("blocks.0.attn1.to_out.0",)) in groups
    assert ("blocks.0.attn2.to_v", ("blocks.0.attn2.to_out.0",)) in groups
    assert ("blocks.1.norm2", ("blocks.1.attn2.to_q",)) in groups
    assert not any(g[0].endswith(("norm1", "norm3")) for g in groups)  # modulated by the timestep
    inputs = {k: v for k, v in wan_inputs().items() if k != "timestep"}
    cal = lbd.DenoisingCalibration(inputs, num_steps=3)
    awq = lbd.quantize_transformer(copy.deepcopy(ref), "w4a16-int4", calibration=cal)
    rtn = lbd.quantize_transformer(copy.deepcopy(ref), "w4a16-int4")
    # a scale was folded into at least one cross-attention norm (the search may keep s = 1 for a group)
    assert any(not torch.equal(awq.blocks[i].norm2.weight, ref.blocks[i].norm2.weight) for i in (0, 1))
    e_awq = lbd.denoise_step_error(ref, awq, wan_inputs())
    e_rtn = lbd.denoise_step_error(ref, rtn, wan_inputs())
    assert e_awq["cosine"] >= 0.99
    # the search keeps alpha = 0 (plain rounding) in its grid: never much worse than round-to-nearest
    assert e_awq["sqnr_db"] > e_rtn["sqnr_db"] - 1.0, (e_awq, e_rtn)


def test_awq_leaves_joint_attention_alone():
    """SD3's joint attention averages values of to_v and add_v_proj: scaling one would change the model."""
    groups = [g for g in find_groups(tiny_sd3()) if g.prev.endswith("to_v")]
    assert all(not g.prev.endswith("attn.to_v") for g in groups)


def test_calibration_callable_must_run_the_model():
    m = tiny_wan()
    with pytest.raises(ValueError, match="never ran the model"):
        lowbit.quantize_model(m, "w4a4-nvfp4", calibration=lambda model: None)
    with pytest.raises(TypeError, match="got a module"):
        lowbit.quantize_model(m, "w4a4-nvfp4", calibration=torch.nn.Identity())


# ---------------------------------------------------------------------------------------------- pipeline


def tiny_wan_pipeline():
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    return diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tiny_wan(),
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


def _run_pipe(pipe, steps=3):
    g = torch.Generator().manual_seed(0)
    pe = torch.randn(1, 16, 64, generator=g).bfloat16()
    ne = torch.randn(1, 16, 64, generator=g).bfloat16()
    return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=64, width=64, num_frames=5,
                num_inference_steps=steps, guidance_scale=5.0, output_type="latent",
                generator=torch.Generator().manual_seed(0)).frames


def test_quantize_pipeline_calibrated_by_a_pipeline_call():
    pipe = tiny_wan_pipeline()
    ref = _run_pipe(copy.deepcopy(pipe))
    calls = []

    def calibrate(p):
        calls.append(p)
        _run_pipe(p, steps=4)

    assert lbd.quantize_pipeline(pipe, "w4a4-nvfp4", calibration=calibrate) is pipe
    assert calls == [pipe]
    scales = [m.input_global_scale for m in pipe.transformer.modules() if isinstance(m, QuantLinear)]
    assert len(scales) == 20 and all(s is not None and float(s) > 0 for s in scales)
    assert type(pipe.vae.decoder.conv_in) is not QuantLinear
    out = _run_pipe(pipe)
    err = lbd.output_error(ref, out)
    assert err["cosine"] >= 0.99, err  # three denoising steps with guidance, all quantized


def test_quantize_pipeline_inputs():
    class Stand:
        pass

    with pytest.raises(TypeError, match="'transformer' attribute"):
        lbd.quantize_pipeline(Stand(), "w4a16-nvfp4")
    s = Stand()
    s.transformer = tiny_wan()
    s.transformer_2 = tiny_wan(seed=3)
    lbd.quantize_pipeline(s, "w4a16-nf4")
    assert _quantized_names(s.transformer) and _quantized_names(s.transformer_2)
    s.text = "x"
    with pytest.raises(TypeError, match="not an nn.Module"):
        lbd.quantize_pipeline(s, "w4a16-nf4", components="text")
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        lbd.quantize_pipeline(s, "w4a16-nf4", components=["nope"])
    with pytest.raises(ValueError, match="unknown scheme"):
        lbd.quantize_pipeline(s, "w3a3")


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("scheme", ["w4a16-nvfp4", "w4a16-nf4", "w8a8-fp8-block", "w4a16-fp4b32", "w4a4-nvfp4"])
def test_save_and_load_in_diffusers_layout(tmp_path, scheme):
    ref = tiny_wan()
    cal = None
    if scheme == "w4a4-nvfp4":
        cal = lbd.DenoisingCalibration({k: v for k, v in wan_inputs().items() if k != "timestep"}, num_steps=2)
    q = lbd.quantize_transformer(copy.deepcopy(ref), scheme, calibration=cal)
    out = lbd.save_transformer(q, tmp_path / "transformer")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["_class_name"] == "WanTransformer3DModel" and cfg["num_layers"] == 2
    qc = cfg["quantization_config"]
    back = lbd.load_transformer(out)
    assert type(back) is diffusers.WanTransformer3DModel
    assert _quantized_names(back) == _quantized_names(q)
    inputs = wan_inputs()
    with torch.no_grad():
        want, got = q(**inputs)[0], back(**inputs)[0]
    assert torch.equal(got, want)  # the same bits, the same kernels
    if scheme == "w4a4-nvfp4":
        assert all(m.input_global_scale is not None for m in back.modules() if isinstance(m, QuantLinear))
    if scheme == "w4a16-nf4":
        # diffusers' own from_pretrained reads this config as a bitsandbytes 4-bit checkpoint (loading the
        # tensors needs CUDA and accelerate: tests/integrations/test_diffusers_gpu.py)
        from diffusers.quantizers.auto import DiffusersAutoQuantizer

        bnb = DiffusersAutoQuantizer.from_dict(qc)
        assert bnb.quant_method == "bitsandbytes" and bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4"
        assert "proj_out" in bnb.llm_int8_skip_modules


def test_save_sharded_and_refusals(tmp_path):
    q = lbd.quantize_transformer(tiny_wan(), "w4a16-nvfp4")
    out = lbd.save_transformer(q, tmp_path / "t", max_shard_size=200_000)
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s.startswith("diffusion_pytorch_model-") for s in shards)
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert not (out / "model.safetensors.index.json").exists()
    back = lbd.load_transformer(out)
    with torch.no_grad():
        assert torch.equal(back(**wan_inputs())[0], q(**wan_inputs())[0])
    with pytest.raises(FileExistsError):
        lbd.save_transformer(q, out)
    with pytest.raises(ValueError, match="no QuantLinear"):
        lbd.save_transformer(tiny_wan(), tmp_path / "u")
    with pytest.raises(TypeError, match="diffusers model"):
        lbd.save_transformer(torch.nn.Sequential(torch.nn.Linear(32, 32)), tmp_path / "v")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="_class_name"):
        lbd.load_transformer(tmp_path / "w")
