"""Block-scaled floating-point formats: NVFP4, MXFP4/6/8 and fp4_b32 (pure PyTorch reference).

One generic path: split the last dim into blocks, take each block's absmax, turn it into a block scale
of the format's scale type (E4M3, E8M0 or fp32), encode ``x`` times the block's multiplier with the
element codec, pack. The per-format arithmetic below is pinned to the producers named in
``docs/formats.md``; the evaluation order of every fp32 operation is part of the format.
"""

from __future__ import annotations

import torch

from .checks import positive_fp32_scalar
from .codecs import canonical_nan, true_div, decode_e8m0, decode_minifloat, encode_e8m0, encode_minifloat
from .packing import pack_fp4, pack_fp6, swizzle_scales, unpack_fp4, unpack_fp6, unswizzle_scales
from .qtensor import QTensor
from .spec import E2M1, E4M3, FORMATS, MinifloatSpec, NVFP4Convention, ScaleRounding

F4_MAX = 6.0
F8E4M3_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max
_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor, block: int, fmt: str) -> None:
    """Raise TypeError/ValueError unless ``x`` is float32/bf16/fp16 ``[..., K]`` with ``K % block == 0``.

    Args:
        x: the tensor to quantize.
        block: block size along the last dim.
        fmt: format name, used in the error messages.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"{fmt}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fmt}: x must have at least 1 dimension, got a scalar")
    if x.shape[-1] % block:
        raise ValueError(f"{fmt}: the last dim of x must be a multiple of {block}, got {x.shape[-1]}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 view ``[rows, K/block, block]`` of ``x`` (a copy: inputs are never modified)."""
    rows = x.shape[:-1].numel()
    # detached: the fp32 scales of fp4_b32 are computed from these values and must not carry x's graph
    return x.detach().float().reshape(rows, x.shape[-1] // block, block)


def _pack(codes: torch.Tensor, elem: MinifloatSpec) -> torch.Tensor:
    if elem.torch_dtype is not None:
        return codes.view(elem.torch_dtype)
    if elem.bits == 4:
        return pack_fp4(codes)
    return pack_fp6(codes)


def _unpack(data: torch.Tensor, elem: MinifloatSpec) -> torch.Tensor:
    if elem.torch_dtype is not None:
        return data.view(torch.uint8)
    if elem.bits == 4:
        return unpack_fp4(data)
    return unpack_fp6(data)


def layout_scales(scale_2d: torch.Tensor, lead: torch.Size, layout: str) -> torch.Tensor:
    if layout == "swizzled":
        return swizzle_scales(scale_2d)
    return scale_2d.reshape(*lead, scale_2d.shape[-1])


def _linear_scales(q: QTensor, block: int) -> torch.Tensor:
    """Block scales of ``q`` as a ``[rows, K/block]`` tensor, whatever the stored layout."""
    cols = q.shape[-1] // block
    rows = q.shape[:-1].numel()
    if q.scale_layout == "swizzled":
        return unswizzle_scales(q.scale, rows, cols)
    return q.scale.reshape(rows, cols)


def check_layout(scale_layout: str) -> None:
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"scale_layout must be 'linear' or 'swizzled', got {scale_layout!r}")


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements, in x's dtype (0 for an empty or all-non-finite tensor).

    Args:
        x: any float tensor.

    Returns:
        0-dim tensor of ``x.dtype``.
    """
    a = x.detach().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax() if a.numel() else torch.zeros((), dtype=x.dtype, device=x.device)


def nvfp4_default_global_scale(x: torch.Tensor, convention: NVFP4Convention | str = "vllm") -> torch.Tensor:
    """The per-tensor multiplier ``448*6/amax(x)`` each convention computes when none is given.

    vllm and lightx2v: fp32 ``2688 / amax``; amax == 0 gives 1.0 (as TransformerEngine) and the result is capped at
    FLT_MAX. compressed-tensors: ``2688 / amax`` evaluated in x's dtype (bf16 gives 13120 where fp32 gives
    13107.2), amax clamped to the dtype's tiny, non-finite results replaced by 1.0 (``generate_gparam``).
    torchao: ``1 / (amax/2688)`` of its divisor ``per_tensor_amax_to_scale`` (amax == 0 gives 1.0, where
    torchao itself divides by zero). Non-finite elements of x are ignored when taking amax.

    Args:
        x: the tensor to be quantized (float32/bfloat16/float16).
        convention: ``"vllm"``, ``"lightx2v"``, ``"torchao"`` or ``"compressed-tensors"``.

    Returns:
        0-dim fp32 multiplier.
    """
    convention = NVFP4Convention(convention)
    amax = finite_amax(x)
    if convention is NVFP4Convention.COMPRESSED_TENSORS:
        a = amax.clamp(min=torch.finfo(x.dtype).tiny)
        g = torch.nan_to_num(F8E4M3_MAX * F4_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
        return g.to(torch.float32).reshape(())
    amax = amax.float()
    if convention is NVFP4Convention.TORCHAO:
        return 1.0 / _torchao_default_pts(amax)
    # `2688 / amax` on a tensor is torch's __rtruediv__, i.e. 2688 * reciprocal(amax): two roundings, as in
    # every torch-side producer that writes this expression (vLLM's tests, LightX2V); kernels copy the order.
    # amax == 0 is selected on the device, not branched on: no host read (a GPU sync; a meta x has no value)
    g = (F8E4M3_MAX * F4_MAX / amax).clamp(max=_FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(g), g)


def torchao_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's divisor ``amax / (448*6)`` in fp32 (``per_tensor_amax_to_scale``).

    Args:
        amax: tensor absmax, any float dtype and shape.

    Returns:
        fp32 tensor of ``amax``'s shape.
    """
    return true_div(amax.to(torch.float32), F8E4M3_MAX * F4_MAX)


def _torchao_default_pts(amax: torch.Tensor) -> torch.Tensor:
    # torchao divides by a zero pts for an all-zero tensor and returns NaN scales; 1.0 keeps the
    # tensor decodable (zero blocks then get the clamped minimum scale 0x08, as any zero block does)
    pts = torchao_per_tensor_scale(amax)
    return torch.where(pts == 0, torch.ones_like(pts), pts)


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | str | None = None,
    convention: NVFP4Convention | str = "vllm",
    scale_layout: str = "linear",
) -> QTensor:
    """NVFP4: E2M1 values, 16-element blocks along the last dim, E4M3 block scales, fp32 global scale.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, ``K % 16 == 0``.
        global_scale: the per-tensor multiplier ``S`` (dequant = value * block_scale / S). None computes
            the convention's default from ``amax(x)`` (see :func:`nvfp4_default_global_scale`); ``"none"``
            quantizes single-level (no global scale, ``S = 1``).
        convention: ``"vllm"`` (default; vLLM, FlashInfer), ``"lightx2v"``, ``"torchao"`` or
            ``"compressed-tensors"``.
        scale_layout: ``"linear"`` (``[..., K/16]``) or ``"swizzled"`` (128x4 tiles, 2-D).

    Per block with absmax ``a`` (fp32 unless said otherwise), block scale ``sf`` and value multiplier ``m``:
      - vllm: ``sf = e4m3(S * (a * fp32(1/6)))``; ``m = 1/(fp32(sf) * (1/S))``, or 0 when ``sf == 0``
        (so a zero block gets scale byte 0x00 and codes 0); codes ``e2m1(x * m)``.
      - lightx2v: as vllm but ``m = S * (1/fp32(sf))``. The two multipliers can differ in the last bit, and
        an element that lands on an E2M1 tie with one of them gets another code with the other.
      - torchao (divisor ``p = 1/S``, or its own ``amax/2688`` by default): ``sf = e4m3(clamp((a/6)/p,
        2^-6, 448))``; ``m = (1/p)/fp32(sf)``; single-level: ``sf = e4m3(clamp(a/6, 2^-6, 448))``,
        ``m = 1/fp32(sf)``.
      - compressed-tensors: ``sf = e4m3(clamp(S * fp32(a/6 in x.dtype), +-448))``, 0 replaced by 0.125;
        codes ``e2m1(clamp(x / (fp32(sf)/S), +-6))``; an exactly -0.0 scaled value gets code 0x0.

    Returns:
        QTensor: ``data`` uint8 ``[..., K/2]``, ``scale`` float8_e4m3fn, ``global_scale`` fp32 ``[1]``
        (None when single-level); torchao convention also keeps its exact divisor in
        ``params["per_tensor_scale"]`` so that dequantization is torchao's ``p * sf``.

    Where lowbit deliberately differs from the producer (tests/interop pin each case):
      - The default global scale ignores NaN/Inf elements. torchao's ``amax`` then is NaN/Inf (every
        scale NaN); compressed-tensors gives ``S = 1`` for NaN and ``S = 0`` for Inf.
      - torchao with an all-zero tensor divides by ``p = 0`` (NaN scales); lowbit uses ``p = 1``.
      - Elements that are NaN after scaling (NaN inputs, or torchao's ``0 * inf`` when ``1/p``
        overflows for ``amax < ~2^-117``) get the codec's canonical code 0x7, where torchao's bit
        trick gives 0x3/0xB and compressed-tensors' int8 cast gives 0x0; their block scale is NaN.
    """
    check_input(x, 16, "nvfp4")
    convention = NVFP4Convention(convention)
    check_layout(scale_layout)
    lead = x.shape[:-1]
    xb = _blocks(x, 16)
    single_level = isinstance(global_scale, str)
    if single_level and global_scale != "none":
        raise ValueError(f"global_scale must be a tensor, a float, 'none' or None, got {global_scale!r}")
    params: dict = {"convention": convention.value}

    if single_level:
        s = None
    elif global_scale is None:
        s = nvfp4_default_global_scale(x, convention)
    else:
        s = positive_fp32_scalar(global_scale, "global_scale").to(x.device)

    if convention is NVFP4Convention.TORCHAO:
        amax_b = xb.abs().amax(dim=-1)
        block_scale = true_div(amax_b, F4_MAX)
        tiny = torch.finfo(torch.float8_e4m3fn).tiny
        if s is None:
            sf = block_scale.clamp(min=tiny, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
            mult = 1.0 / sf.float()
        else:
            pts = _torchao_default_pts(finite_amax(x)) if global_scale is None else 1.0 / s
            params["per_tensor_scale"] = pts
            sf = (block_scale / pts).clamp(min=tiny, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
            mult = (1.0 / pts) / sf.float()
        scaled = (xb * mult.unsqueeze(-1)).clamp(-F4_MAX, F4_MAX)
    elif convention is NVFP4Convention.COMPRESSED_TENSORS:
        # llm-compressor computes amax/6 in the weight's dtype, then promotes to fp32 for the global scale
        amax_b = x.detach().reshape(xb.shape).abs().amax(dim=-1)
        local = true_div(amax_b, F4_MAX).float()
        s_eff = torch.ones((), dtype=torch.float32, device=x.device) if s is None else s
        sf = (s_eff * local).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)
        sf = torch.where(sf.float() == 0, torch.full_like(sf, 0.125), sf)
        scaled = (xb / (sf.float() / s_eff).unsqueeze(-1)).clamp(-F4_MAX, F4_MAX)
        # CT's cast_to_fp4 takes the sign from torch.sign, which is 0 for -0.0: a scaled value that is
        # exactly -0.0 gets code 0x0, while a negative value that rounds to zero gets 0x8
        scaled = torch.where(scaled == 0, torch.zeros_like(scaled), scaled)
    else:
        codes, sf = quantize_blockscaled(x, E2M1, 16, "e4m3", global_scale=s, convention=convention)
        scaled = None

    if scaled is not None:
        codes = encode_minifloat(scaled, E2M1).reshape(x.shape)
    return QTensor(
        data=pack_fp4(codes),
        scale=layout_scales(sf.reshape(x.shape[:-1].numel(), x.shape[-1] // 16), lead, scale_layout),
        fmt="nvfp4",
        shape=x.shape,
        dtype=x.dtype,
        global_scale=None if s is None else s.reshape(1),
        scale_layout=scale_layout,
        params=params,
    )


def dequantize_nvfp4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an nvfp4 QTensor: ``e2m1 * (fp32(sf) / S)`` per block, computed in fp32, cast to ``dtype``.

    A QTensor carrying an exact divisor ``params["per_tensor_scale"] = p`` (torchao convention, ModelOpt)
    decodes ``e2m1 * (p * fp32(sf))`` instead, as those producers do; single-level decodes ``e2m1 * sf``.

    Args:
        q: nvfp4 QTensor (linear or swizzled scales).
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape``.
    """
    values = decode_minifloat(unpack_fp4(q.data), E2M1).reshape(q.shape[:-1].numel(), q.shape[-1] // 16, 16)
    sf = _linear_scales(q, 16).float()
    pts = q.params.get("per_tensor_scale")
    if pts is not None:
        block = pts * sf
    elif q.global_scale is not None:
        block = sf / q.global_scale.reshape(())
    else:
        block = sf
    return canonical_nan((values * block.unsqueeze(-1)).reshape(q.shape), dtype)


def quantize_blockscaled(
    x: torch.Tensor,
    element: MinifloatSpec,
    block_size: int,
    scale_type: str,
    *,
    global_scale: torch.Tensor | None = None,
    scale_rounding: ScaleRounding | str = "rceil",
    convention: NVFP4Convention | str = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generic block-scaled quantizer: element type x block size x scale type x optional global scale.

    Blocks of ``block_size`` run along the last dim of ``x`` (``K % block_size == 0``). With block absmax
    ``a`` (fp32), element max ``E`` and global multiplier ``S`` (1 if None):
      - ``"e4m3"``: ``sf = e4m3(S * (a * fp32(1/E)))``, multiplier ``m = 1/(fp32(sf) * (1/S))`` (``convention``
        ``"vllm"``) or ``m = S * (1/fp32(sf))`` (``"lightx2v"``), 0 if sf == 0.
      - ``"e8m0"``: ``sf = 2^e`` by ``scale_rounding`` (RCEIL of ``a * fp32(1/E)``, or FLOOR
        ``floor(log2 a) - emax``), ``m = 2^-e`` exactly; NaN/Inf blocks get 0xFF.
      - ``"fp32"``: ``sf = a / E``; elements are ``x / sf`` (IEEE division), 0 where sf == 0.
    Elements are encoded with round-to-nearest-even and saturation.

    Args:
        x: ``[..., K]`` float tensor.
        element: the element codec spec (E2M1, E2M3, E3M2, E4M3, E5M2).
        block_size: elements per block.
        scale_type: ``"e4m3"``, ``"e8m0"`` or ``"fp32"``.
        global_scale: e4m3 only: 0-dim fp32 multiplier ``S``.
        scale_rounding: e8m0 only: ``"rceil"`` or ``"floor"``.
        convention: e4m3 only: ``"vllm"`` or ``"lightx2v"``, the producer whose multiplier order to follow.

    Returns:
        (codes, scales): uint8 element codes shaped like x, and scales ``[rows, K/block_size]`` as
        float8_e4m3fn, float8_e8m0fnu or float32.
    """
    xb = _blocks(x, block_size)
    amax_b = xb.abs().amax(dim=-1)
    rcp_max = torch.tensor(1.0 / element.max_normal, dtype=torch.float32, device=x.device)
    if scale_type == "e4m3":
        s = torch.ones((), dtype=torch.float32, device=x.device) if global_scale is None else global_scale
        # fp32(1/E) times amax: LightX2V's `vecMax * 0.16666666666666666f`, vLLM's `amax * (1/6)`
        sf = encode_minifloat(s * (amax_b * rcp_max), E4M3).view(torch.float8_e4m3fn)
        sf32 = sf.float()
        convention = NVFP4Convention(convention)
        if convention is NVFP4Convention.VLLM:
            # vLLM's `get_reciprocal(scale * get_reciprocal(global_scale))` (its CUDA kernel: the same with
            # rcp.approx); sf * (1/S) can underflow to 0 for a huge S, then m is Inf as in vLLM
            m = 1.0 / (sf32 * (1.0 / s))
        elif convention is NVFP4Convention.LIGHTX2V:
            # LightX2V's `SFScaleVal * reciprocal(SFValue)`
            m = s * (1.0 / sf32)
        else:
            raise ValueError(f"convention: the e4m3 scale follows 'vllm' or 'lightx2v', got {convention.value!r}")
        mult = torch.where(sf32 == 0, torch.zeros_like(sf32), m)
        scaled = xb * mult.unsqueeze(-1)
    elif scale_type == "e8m0":
        if global_scale is not None:
            raise ValueError("e8m0-scaled formats take no global_scale")
        rounding = ScaleRounding(scale_rounding)
        if rounding is ScaleRounding.RCEIL:
            code = encode_e8m0(amax_b * rcp_max, ScaleRounding.RCEIL)
        else:
            biased = encode_e8m0(amax_b, ScaleRounding.FLOOR).to(torch.int32)
            code = torch.where(biased == 255, biased, (biased - element.emax).clamp(min=0)).to(torch.uint8)
        # 2^-e, the exact reciprocal of the scale, is the E8M0 value of code 254 - c
        # (0x00 -> 2^127 ... 0xFE -> 2^-127)
        inv = decode_e8m0((254 - code.to(torch.int32)).clamp(min=0))
        inv = torch.where(code == 255, torch.full_like(inv, float("nan")), inv)
        sf = code.view(torch.float8_e8m0fnu)
        scaled = xb * inv.unsqueeze(-1)
    elif scale_type == "fp32":
        if global_scale is not None:
            raise ValueError("fp32-scaled formats take no global_scale")
        sf = canonical_nan(true_div(amax_b, element.max_normal))
        safe = torch.where(sf == 0, torch.ones_like(sf), sf)
        scaled = torch.where(sf.unsqueeze(-1) == 0, xb * 0.0, xb / safe.unsqueeze(-1))
    else:
        raise ValueError(f"scale_type must be 'e4m3', 'e8m0' or 'fp32', got {scale_type!r}")
    return encode_minifloat(scaled, element).reshape(x.shape), sf


def quantize_mx(
    x: torch.Tensor,
    fmt: str,
    scale_rounding: ScaleRounding | str = "rceil",
    scale_layout: str = "linear",
) -> QTensor:
    """MX (OCP Microscaling): 32-element blocks along the last dim, E8M0 power-of-two scales.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, ``K % 32 == 0``.
        fmt: ``"mxfp4"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``.
        scale_rounding: ``"rceil"`` (default): the smallest power of two >= ``amax * fp32(1/max_elem)``
            (LightX2V/TransformerEngine/FlashInfer); ``"floor"``: ``2^(floor(log2(amax)) - emax_elem)``
            (OCP spec, torchao FLOOR), values above the element max then saturate.
        scale_layout: ``"linear"`` (``[..., K/32]`` float8_e8m0fnu) or ``"swizzled"``.

    Elements are ``x / 2^e`` (exact: a power of two) rounded to nearest even with saturation. A block
    whose absmax is NaN or Inf gets scale 0xFF (NaN); a zero block gets 0x00 and zero codes.

    Returns:
        QTensor: ``data`` uint8 (FP4 ``[..., K/2]``, FP6 ``[..., 3K/4]``) or float8 ``[..., K]``,
        ``scale`` float8_e8m0fnu ``[..., K/32]`` (or swizzled 2-D).

    Equal to torchao 0.18.0 ``to_mx`` (FLOOR / RCEIL, every element type) except, by design
    (tests/interop/test_torchao.py pins each case):
      - RCEIL: torchao's eager path computes ``ceil(log2(amax/E))`` in floating point; when
        ``amax/E`` is a few ulps above ``2^k`` with ``|k|`` large, log2 rounds to ``k`` and torchao picks
        the scale one step smaller (the top elements then saturate). lowbit uses the exact exponent bits
        (TransformerEngine, torchao HEAD, PTX ``cvt.rp.satfinite.ue8m0x2``). ``amax * fp32(1/E)`` and
        torchao's ``amax / E`` give the same scale for every fp32 amax (checked near every power of two).
      - Scale code 0x00 (2^-127) with nonzero elements: lowbit multiplies by 2^127 (OCP, TE, torchao
        HEAD); torchao 0.18.0 FLOOR divides by 2^-126 and RCEIL multiplies by 1.0.
      - Inf absmax: lowbit 0xFF (NaN block, torchao HEAD); torchao 0.18.0 FLOOR gives ``255 - emax``
        (e.g. 247 for E4M3), RCEIL 0xFE, with the Inf element saturated.
      - Element codes inside a NaN block (scale 0xFF) are unspecified; the block decodes to NaN.
    """
    spec = FORMATS[fmt]
    check_input(x, 32, fmt)
    check_layout(scale_layout)
    rounding = ScaleRounding(scale_rounding)
    codes, scale = quantize_blockscaled(x, spec.element, 32, "e8m0", scale_rounding=rounding)
    return QTensor(
        data=_pack(codes, spec.element),
        scale=layout_scales(scale, x.shape[:-1], scale_layout),
        fmt=fmt,
        shape=x.shape,
        dtype=x.dtype,
        scale_layout=scale_layout,
        params={"scale_rounding": rounding.value},
    )


def dequantize_mx(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an MX QTensor: ``element * 2^(s-127)`` in fp32 (scale 0xFF gives NaN), cast to ``dtype``.

    Args:
        q: MX QTensor (linear or swizzled scales).
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape``.
    """
    elem = q.spec.element
    rows = q.shape[:-1].numel()
    values = decode_minifloat(_unpack(q.data, elem), elem).reshape(rows, q.shape[-1] // 32, 32)
    scale = decode_e8m0(_linear_scales(q, 32).view(torch.uint8))
    return canonical_nan((values * scale.unsqueeze(-1)).reshape(q.shape), dtype)


def quantize_fp4_b32(x: torch.Tensor) -> QTensor:
    """fp4_b32 (the ``nvfp4_packed`` GEMV plugin's format): E2M1, 32-element blocks, fp32 scale ``amax/6``.

    Codes are ``e2m1(x / s)`` with IEEE fp32 division; a zero block has ``s = 0`` and codes 0.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, ``K % 32 == 0``.

    Returns:
        QTensor: ``data`` uint8 ``[..., K/2]``, ``scale`` fp32 ``[..., K/32]``.
    """
    check_input(x, 32, "fp4_b32")
    codes, scale = quantize_blockscaled(x, E2M1, 32, "fp32")
    return QTensor(
        data=pack_fp4(codes),
        scale=scale.reshape(*x.shape[:-1], x.shape[-1] // 32),
        fmt="fp4_b32",
        shape=x.shape,
        dtype=x.dtype,
    )


def dequantize_fp4_b32(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an fp4_b32 QTensor: ``e2m1 * s`` in fp32, cast to ``dtype``.

    Args:
        q: fp4_b32 QTensor.
        dtype: output dtype.

    Returns:
        Tensor of shape ``q.shape``.
    """
    values = decode_minifloat(unpack_fp4(q.data), E2M1).reshape(q.shape[:-1].numel(), q.shape[-1] // 32, 32)
    scale = q.scale.reshape(q.shape[:-1].numel(), q.shape[-1] // 32, 1).float()
    return canonical_nan((values * scale).reshape(q.shape), dtype)


FOLD_SHIFT = 6
"""An MXFP4 block re-encoded in E4M3 (:func:`mxfp4_as_fp8_block`) is its E2M1 codes times 2^(FOLD_SHIFT + d),
d <= 0 its exponent below the largest of its 128-column tile: 6 * 2^6 = 384 <= 448."""
FOLD_WINDOW = 11
"""Folded blocks stay within FOLD_WINDOW binades of their block's largest (shift FOLD_SHIFT + d >= -5): there
every E2M1 value times 2^(FOLD_SHIFT + d) is a normal E4M3 number (0.5 * 2^-5 = 2^-6 is E4M3's smallest
normal), exact, and the E4M3 code is the shift-0 code plus ``shift << 3`` (the kernel's byte table)."""


def check_fold_args(q: QTensor, block: tuple[int, int]) -> tuple[int, int]:
    """Raise ValueError unless ``q`` is a 2-D mxfp4 QTensor and ``block`` is (1, 128) or (128, 128); returns
    ``block`` as a tuple."""
    if not isinstance(q, QTensor) or q.fmt != "mxfp4" or len(q.shape) != 2:
        raise ValueError("q must be a 2-D mxfp4 QTensor")
    block = tuple(block)
    if block not in ((1, 128), (128, 128)):
        raise ValueError(f"block must be (1, 128) or (128, 128), got {block}")
    return block


def mxfp4_as_fp8_block(q: QTensor, block: tuple[int, int] = (1, 128)) -> tuple[QTensor, torch.Tensor]:
    """Re-encode a 2-D MXFP4 tensor exactly as ``fp8_block``, for the FP8 tensor cores.

    In each ``block`` (1x128: a row's 128-column tile, 4 MX blocks; 128x128: 128 rows of it) let ``emax`` be
    the largest scale code. The block's fp32 scale is ``2^(emax - 127 - FOLD_SHIFT)`` and each element becomes
    the E4M3 value ``e2m1 * 2^(e - emax + FOLD_SHIFT)`` (``e`` its MX block's code), so ``dequantize_fp8_block``
    of the result equals :func:`dequantize_mx` of ``q`` bit for bit. An MX block that cannot be folded exactly
    -- a NaN scale (0xFF), or a nonzero block more than ``FOLD_WINDOW`` binades below its ``emax`` -- is
    written as +0 and left out of ``emax``; the second result (a bool scalar tensor) is False when any was.

    Args:
        q: ``mxfp4`` QTensor of shape ``[R, K]`` (linear or swizzled scales).
        block: ``(1, 128)`` (activations: one scale per row and 128 columns) or ``(128, 128)`` (weights: one
            scale per 128x128 block, so a GEMM tile of up to 128 weight rows has a single scale).

    Returns:
        (QTensor ``fp8_block`` with ``params={"block": block}``: data float8_e4m3fn ``[R, K]``, scale fp32
        ``[R, ceil(K/128)]`` or ``[ceil(R/128), ceil(K/128)]``; ``exact`` bool tensor).
    """
    block = check_fold_args(q, block)
    rows, k = q.shape
    blocks = k // 32
    tiles = -(-k // 128)
    row_blocks = -(-rows // block[0])
    codes = unpack_fp4(q.data.reshape(rows, k // 2)).reshape(rows, blocks, 32)
    e = _linear_scales(q, 32).view(torch.uint8).to(torch.int32)
    nan_block = e == 255
    e_padded = torch.zeros(row_blocks * block[0], tiles * 4, dtype=torch.int32, device=e.device)
    e_padded[:rows, :blocks] = torch.where(nan_block, 0, e)
    emax = e_padded.reshape(row_blocks, block[0], tiles, 4).amax((1, 3))
    d = e_padded - emax.repeat_interleave(block[0], dim=0).repeat_interleave(4, dim=1)
    d = d[:rows, :blocks]
    nonzero = (codes & 7).amax(-1) > 0
    dropped = nan_block | (nonzero & (d < -FOLD_WINDOW))
    mult = ((d.clamp(min=-FOLD_WINDOW) + FOLD_SHIFT + 127) << 23).view(torch.float32)
    values = decode_minifloat(codes, E2M1) * mult.unsqueeze(-1)
    values = torch.where(dropped.unsqueeze(-1), torch.zeros_like(values), values)
    scale_bits = torch.where(emax > FOLD_SHIFT, (emax - FOLD_SHIFT) << 23, 1 << (emax + 22 - FOLD_SHIFT))
    folded = QTensor(
        data=values.reshape(rows, k).to(torch.float8_e4m3fn),
        scale=scale_bits.view(torch.float32),
        fmt="fp8_block",
        shape=q.shape,
        dtype=q.dtype,
        params={"block": block},
    )
    return folded, ~dropped.any()
