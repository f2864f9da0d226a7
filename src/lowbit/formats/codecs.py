"""Element codecs: value <-> code for every element and scale type lowbit stores.

All encoders take any float tensor, compute in fp32 and return integer codes (uint8, or int32 for
INT4) of the same shape; all decoders return fp32. Behaviour at the edges, per codec:

=========  =========================  ============================  =========================  ===================
codec      overflow / +-Inf           NaN                           -0 and negatives -> 0      rounding
=========  =========================  ============================  =========================  ===================
E2M1       saturate to +-6            code 0x7 (+6)                 sign kept: 0x8             RNE
E2M3       saturate to +-7.5          code 0x1F (+7.5)              sign kept: 0x20            RNE
E3M2       saturate to +-28           code 0x1F (+28)               sign kept: 0x20            RNE
E4M3 (fn)  saturate to +-448 (0x7E)   0x7F (sign dropped)           sign kept: 0x80            RNE (torch cast)
E5M2       saturate to +-57344 (0x7B) 0x7F (sign dropped)           sign kept: 0x80            RNE (torch cast)
E8M0       > 2^127 -> 0xFE; Inf->0xFF 0xFF                          sign dropped; 0 -> 0x00    FLOOR or RCEIL
INT4/UINT4 clamp to [qmin, qmax]      ValueError                    0                          RNE (torch.round)
codebook   clamp to the end levels    not encoded (NaN -> ValueError) nearest level          ties -> lower level
=========  =========================  ============================  =========================  ===================

Saturation matches PTX ``cvt.rn.satfinite`` (what GPU kernels do) and torch >= 2.13's E4M3 cast; E5M2 is
clamped before torch's (non-saturating) cast so both agree. NaN is canonicalised to one code so that
kernels and reference can agree bit for bit; the FP4/FP6 NaN code is arbitrary but fixed, and in every
lowbit format a NaN element also makes its block scale NaN, so the block decodes to NaN regardless.
"""

from __future__ import annotations

import functools

import torch

from .spec import E4M3, E5M2, CodebookSpec, IntSpec, MinifloatSpec, ScaleRounding

_FP8_CANONICAL_NAN = 0x7F


@functools.lru_cache(maxsize=None)
def minifloat_table(spec: MinifloatSpec) -> torch.Tensor:
    """fp32 value of every code 0 .. 2^bits-1 (NaN where the format has NaN, Inf where it has Inf)."""
    if spec.torch_dtype is not None:
        codes = torch.arange(1 << spec.bits, dtype=torch.int32).to(torch.uint8)
        return codes.view(spec.torch_dtype).float()
    n_mag = 1 << (spec.ebits + spec.mbits)
    codes = torch.arange(n_mag, dtype=torch.float64)
    exp_field = torch.div(codes, 1 << spec.mbits, rounding_mode="floor")
    mant = codes - exp_field * (1 << spec.mbits)
    frac = mant / (1 << spec.mbits)
    normal = torch.ldexp(1.0 + frac, (exp_field - spec.bias).to(torch.int32))
    subnormal = torch.ldexp(frac, torch.tensor(1 - spec.bias, dtype=torch.int32))
    mag = torch.where(exp_field == 0, subnormal, normal).float()
    return torch.cat([mag, -mag])


@functools.lru_cache(maxsize=None)
def _positive_midpoints(spec: MinifloatSpec) -> torch.Tensor:
    mag = minifloat_table(spec)[: spec.max_code + 1]
    return (mag[:-1] + mag[1:]) / 2


def _table(table: str, spec, device: torch.device) -> torch.Tensor:
    """One of the tables above (``"minifloat"``, ``"midpoints"``, ``"codebook"``) on ``device``; callers only
    read it."""
    if device.type == "cpu":
        return _TABLE_FNS[table](spec)
    return _on_device(table, spec, device)


@functools.lru_cache(maxsize=64)
def _on_device(table: str, spec, device: torch.device) -> torch.Tensor:
    # cached: a CPU table's .to(device) per call is a synchronous host-to-device copy, which costs more than
    # the op itself on a GPU and cannot run inside a CUDA-graph capture
    return _TABLE_FNS[table](spec).to(device)


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def encode_minifloat(x: torch.Tensor, spec: MinifloatSpec) -> torch.Tensor:
    """Round ``x`` to the nearest ``spec`` value (ties to even), saturating; returns uint8 codes."""
    _check_float(x)
    xf = x.float()
    if spec.torch_dtype is not None:
        # clamp first: torch < 2.13 casts overflow to NaN (E4M3) and torch never saturates E5M2
        m = spec.max_normal
        codes = xf.clamp(-m, m).to(spec.torch_dtype).view(torch.uint8)
        return torch.where(xf.isnan(), torch.full_like(codes, _FP8_CANONICAL_NAN), codes)
    mids = _table("midpoints", spec, xf.device)
    mag = xf.abs()
    idx = torch.bucketize(mag, mids, right=False)
    # bucketize sends a value equal to a midpoint to the lower code; RNE wants the even one
    on_mid = mids[idx.clamp(max=mids.numel() - 1)] == mag
    idx = torch.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    codes = idx.to(torch.uint8) | (torch.signbit(xf).to(torch.uint8) << (spec.ebits + spec.mbits))
    return torch.where(xf.isnan(), torch.full_like(codes, spec.max_code), codes)


def decode_minifloat(codes: torch.Tensor, spec: MinifloatSpec) -> torch.Tensor:
    """fp32 values of uint8 ``codes`` (only the low ``spec.bits`` bits are read)."""
    table = _table("minifloat", spec, codes.device)
    return table[(codes.to(torch.int64) & ((1 << spec.bits) - 1))]


_QNAN_BITS = {torch.float32: (0x7FC00000, torch.int32), torch.bfloat16: (0x7FC0, torch.int16),
              torch.float16: (0x7E00, torch.int16)}


def canonical_nan(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` cast to ``dtype`` (default: its own) with every NaN written as the positive quiet NaN.

    The bits are fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00. Decoded tensors and fp32 scales carry only
    this NaN, so GPU kernels (whose arithmetic yields 0x7FFFFFFF) and the CPU reference (which keeps
    payloads, and whose bf16 cast writes 0xFFFF) agree bit for bit.
    """
    dtype = x.dtype if dtype is None else dtype
    y = x.to(dtype)
    bits, int_dtype = _QNAN_BITS[dtype]
    # torch.full, not torch.tensor: no host-to-device copy, so this can run inside CUDA-graph capture
    nan = torch.full((), bits, dtype=int_dtype, device=x.device).view(dtype)
    return torch.where(x.isnan(), nan, y)


def true_div(a: torch.Tensor, c: float) -> torch.Tensor:
    """``a / c`` as an IEEE division on every device.

    On CUDA, PyTorch turns ``tensor / python_number`` into a multiply by the rounded reciprocal, which
    differs from the division in the last bit; dividing by a same-device tensor keeps true division, so the
    reference gives the CPU's bits everywhere. The divisor is made by ``torch.full`` (a fill on the device), not
    ``torch.tensor`` (a copy from pageable host memory, which waits for the device's queued work first: GPTQ's
    fits call this once per group between graph replays, and CUDA-graph capture refuses the copy).
    """
    return a / torch.full((), c, dtype=a.dtype, device=a.device)


def encode_e8m0(x: torch.Tensor, rounding: ScaleRounding | str) -> torch.Tensor:
    """Power-of-two scale code (uint8) for the magnitude of fp32 ``x``.

    FLOOR: ``2^floor(log2|x|)`` from the exponent bits. RCEIL: the smallest power of two >= |x|
    (exponent bits plus one if any mantissa bit is set, the DeepGEMM/TransformerEngine bit method,
    never ``log2`` in floating point). fp32 subnormals: FLOOR gives 0x00; RCEIL gives 0x00 up to 2^-127
    and 0x01 above. Results above 2^127 saturate to 0xFE; NaN and Inf give 0xFF.
    """
    rounding = ScaleRounding(rounding)
    xf = x.float().abs()
    bits = xf.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if rounding is ScaleRounding.FLOOR:
        code = exp
    else:
        subnormal_up = (exp == 0) & (mant > 0x400000)
        code = torch.where(exp == 0, subnormal_up.to(torch.int32), exp + (mant != 0).to(torch.int32))
    code = code.clamp(max=254)
    code = torch.where(xf.isfinite(), code, torch.full_like(code, 255))
    return code.to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2^(code-127)`` of uint8 ``codes``; 0x00 is 2^-127 (an fp32 subnormal), 0xFF is NaN."""
    c = codes.to(torch.int32)
    normal = (c << 23).view(torch.float32)
    out = torch.where(c == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(c == 255, torch.full_like(out, float("nan")), out)


def e8m0_to_exponent(codes: torch.Tensor) -> torch.Tensor:
    """Unbiased int32 exponent of E8M0 codes (NaN code 255 gives 128)."""
    return codes.to(torch.int32) - 127


def encode_int(x: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """Round to nearest even and clamp to ``[qmin, qmax]``; returns int32 values (not nibbles)."""
    _check_float(x)
    if torch.isnan(x).any():
        raise ValueError(f"x contains NaN, which {spec.name} cannot encode")
    return torch.round(x.float()).clamp(spec.qmin, spec.qmax).to(torch.int32)


def int_to_nibble(q: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """Two's complement (signed) or plain (unsigned) 4-bit pattern of int values, as uint8."""
    return (q.to(torch.int32) & ((1 << spec.bits) - 1)).to(torch.uint8)


def nibble_to_int(nibbles: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    n = nibbles.to(torch.int32) & ((1 << spec.bits) - 1)
    if spec.signed:
        n = torch.where(n >= (1 << (spec.bits - 1)), n - (1 << spec.bits), n)
    return n


@functools.lru_cache(maxsize=None)
def codebook_table(spec: CodebookSpec) -> torch.Tensor:
    return torch.tensor(spec.levels, dtype=torch.float32)


def encode_codebook(x: torch.Tensor, spec: CodebookSpec, *, check_nan: bool = True) -> torch.Tensor:
    """Nearest level of ``spec`` for fp32 ``x`` (already normalised to [-1, 1]); ties go to the lower level.

    This is bitsandbytes' rule (CPU ``bucketize`` on midpoints, CUDA ``x > midpoint`` tree). Levels are
    searched in ascending order; where two codes share a value (bnb FP4's +0 and -0), the lower code wins.
    ``check_nan=False`` is for callers that have replaced NaN already: the check reads a value back to the
    host (a device synchronisation).
    """
    _check_float(x)
    xf = x.float()
    # a meta tensor (a shape-only quantize) has no values to check
    if check_nan and not xf.is_meta and torch.isnan(xf).any():
        raise ValueError(f"x contains NaN, which the {spec.name} codebook cannot encode")
    table = _table("codebook", spec, xf.device)
    sorted_vals, order = torch.sort(table, stable=True)
    mids = (sorted_vals[:-1] + sorted_vals[1:]) / 2
    pos = torch.bucketize(xf, mids, right=False)
    return order[pos].to(torch.uint8)


_TABLE_FNS = {"minifloat": minifloat_table, "midpoints": _positive_midpoints, "codebook": codebook_table}


def decode_codebook(codes: torch.Tensor, spec: CodebookSpec) -> torch.Tensor:
    return _table("codebook", spec, codes.device)[codes.to(torch.int64) & 0xF]


__all__ = [
    "E4M3", "E5M2",
    "minifloat_table", "encode_minifloat", "decode_minifloat",
    "encode_e8m0", "decode_e8m0", "e8m0_to_exponent",
    "encode_int", "int_to_nibble", "nibble_to_int",
    "codebook_table", "encode_codebook", "decode_codebook",
]
