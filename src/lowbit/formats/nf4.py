"""bitsandbytes-compatible NF4 (formats.md section 4), with optional double quantization of the absmax.

The reference reproduces bitsandbytes 0.50.2 on CPU bit for bit:

- 4-bit step (``bitsandbytes::quantize_4bit``, default backend, pure torch): blocks of ``blocksize`` over
  the flattened tensor; full blocks are scaled by ``x * (1 / absmax.clamp(min=1e-38))`` (reciprocal, then
  multiply), the tail block by ``x / absmax_tail.clamp(min=1e-38)`` (a true division) and the tail's stored
  absmax is the clamped value; the result is clamped to [-1, 1] and the code is the nearest NF4 level, ties
  to the lower code. Element ``2i`` goes in the high nibble; an odd tail is padded with code 7 (0.0).
- 8-bit blockwise step of double quantization (``cquantize_blockwise_cpu_fp32``, C++): not a true nearest
  search. The normalised value ``v = x * (1/absmax)`` is binned into a 65536-entry table,
  ``idx = trunc(((clamp(v, -1, 1) + 1) * 0.5) * 65535 + 0.5)``, whose entry ``i`` holds the nearest code
  to ``-1 + 2i/65535``. So 0.0 encodes to code 131 (2.125e-05), not to code 127 (0.0). NaN elements are
  left out of the block absmax and encode to the code of -1.0's bin (0); an all-zero block gives absmax 0
  and codes 0. bitsandbytes' CUDA kernel instead binary-searches the nearest code, so the two bitsandbytes
  backends write different nested codes; lowbit follows CPU.
"""

from __future__ import annotations

import functools

import torch

from .codecs import codebook_table, encode_codebook
from .packing import pack_nibbles_high_first, unpack_nibbles_high_first
from .qtensor import QTensor
from .spec import BNB_FP4, NF4, CodebookSpec

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Block sizes bitsandbytes 0.50.2 ``quantize_4bit`` accepts."""
NESTED_BLOCKSIZE = 256
"""Block size bitsandbytes uses to quantize the absmax when ``compress_statistics=True``."""

_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)
_NAN_CODE = 15  # torch.bucketize puts NaN after every boundary
ABSMAX_FLOOR = 1e-38
_LUT_SIZE = 65536

BNB_4BIT_FORMATS: dict[str, CodebookSpec] = {"nf4": NF4, "bnb_fp4": BNB_FP4}
"""lowbit formats with bitsandbytes' 4-bit layout (``quantize_4bit``'s ``quant_type`` nf4 / fp4) -> their
16-entry table. They differ only in the table and the encode rule; blocks, absmax, double quantization and
packing are shared, and so is every kernel, which takes the table as data."""


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The bitsandbytes "dynamic" 8-bit quantization map, value for value (``create_dynamic_map``).

    Exponent level ``i`` (``0 <= i < max_exponent_bits``) contributes the midpoints of an fp32
    ``linspace(0.1, 1, 2^(i + total_bits - 1 - max_exponent_bits [+1 if unsigned]) + 1)`` scaled by
    ``10^(i - max_exponent_bits + 1)`` (and their negatives when signed); the values 0 and 1.0 are added,
    the list is padded with zeros to 256 entries and sorted ascending.

    Args:
        signed: include negative values (the map double quantization uses).
        max_exponent_bits: number of decimal exponent levels, ``1 <= max_exponent_bits <= total_bits - 1``.
        total_bits: bits per code, 2..8 (unsigned maps need ``max_exponent_bits == total_bits - 1``).

    Returns:
        fp32 ``[256]``, sorted ascending. The default is ``[-0.99297, ..., 0, ..., 0.99297, 1.0]``.
    """
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    for name, v in (("max_exponent_bits", max_exponent_bits), ("total_bits", total_bits)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not 2 <= total_bits <= 8:
        raise ValueError(f"total_bits must be in 2..8, got {total_bits}")
    non_sign_bits = total_bits - 1
    if not 1 <= max_exponent_bits <= non_sign_bits:
        raise ValueError(
            f"max_exponent_bits must be in 1..total_bits-1 = 1..{non_sign_bits}, got {max_exponent_bits}"
        )
    if not signed and max_exponent_bits != non_sign_bits:
        # otherwise the map does not have 2^total_bits entries and bitsandbytes' own assertion fails
        raise ValueError(
            f"an unsigned map needs max_exponent_bits == total_bits - 1 = {non_sign_bits}, "
            f"got {max_exponent_bits}"
        )

    def level(count: int, exponent: int) -> list[torch.Tensor]:
        bounds = torch.linspace(0.1, 1, count, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10**exponent
        return [scale * means, -scale * means] if signed else [scale * means]

    parts: list[torch.Tensor] = []
    for i in range(max_exponent_bits):
        extra = 0 if signed else 1
        parts += level(2 ** (i + non_sign_bits - max_exponent_bits + extra) + 1, i - max_exponent_bits + 1)
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    if additional > 0:
        # bitsandbytes puts the extra items on the last exponent level (scale 10^0)
        parts += level(additional + 1, 0)
    values = torch.cat(parts + [torch.tensor([0.0, 1.0])])
    if values.numel() != 2**total_bits:
        raise AssertionError(f"dynamic map has {values.numel()} entries, expected {2**total_bits}")
    values = torch.cat([values, torch.zeros(256 - values.numel())])
    return torch.sort(values).values


@functools.lru_cache(maxsize=1)
def _default_dynamic_map() -> torch.Tensor:
    return create_dynamic_map()


@functools.lru_cache(maxsize=8)
def _dynamic_map_on(device: torch.device) -> torch.Tensor:
    """The default map on ``device``, copied there once (a copy from pageable host memory per call would
    synchronize the host with the device's stream)."""
    return _default_dynamic_map().to(device)


def dynamic_map(device: torch.device | str | None = None) -> torch.Tensor:
    """A fresh copy of the default signed dynamic map (fp32 ``[256]``) that nf4 double quantization uses."""
    table = _default_dynamic_map()
    return (table if device is None else table.to(device)).clone()


@functools.lru_cache(maxsize=8)
def _bin_table(code_bytes: bytes) -> torch.Tensor:
    code = torch.frombuffer(bytearray(code_bytes), dtype=torch.float32)
    mids = (code[:-1] + code[1:]) * 0.5
    i = torch.arange(_LUT_SIZE, dtype=torch.float32)
    centers = -1.0 + (2.0 * i) / float(_LUT_SIZE - 1)
    # bitsandbytes advances to the next code while its midpoint is strictly below the bin centre
    return torch.bucketize(centers, mids, right=False)


def _check_code(code: torch.Tensor) -> torch.Tensor:
    if not isinstance(code, torch.Tensor):
        raise TypeError(f"code must be a torch.Tensor, got {type(code).__name__}")
    if code.dtype != torch.float32 or code.shape != (256,):
        raise ValueError(
            f"code must be a float32 tensor of shape [256], got {code.dtype} {tuple(code.shape)}"
        )
    c = code.detach().cpu()
    if not torch.isfinite(c).all() or (c[1:] < c[:-1]).any():
        raise ValueError(
            "code must be finite and sorted ascending (bitsandbytes bins against consecutive midpoints)"
        )
    return c


def _check_blocksize(blocksize: int, name: str = "blocksize") -> None:
    if not isinstance(blocksize, int) or isinstance(blocksize, bool):
        raise TypeError(f"{name} must be an int, got {type(blocksize).__name__}")
    if blocksize <= 0:
        raise ValueError(f"{name} must be positive, got {blocksize}")


def quantize_blockwise_8bit(
    x: torch.Tensor, code: torch.Tensor | None = None, blocksize: int = NESTED_BLOCKSIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' CPU 8-bit blockwise quantization (``quantize_blockwise``), bit for bit.

    Args:
        x: float32/bfloat16/float16 tensor of any shape; blocks run over the flattened tensor, a tail block
            uses its own absmax.
        code: fp32 ``[256]`` sorted map; default :func:`dynamic_map`.
        blocksize: elements per block (> 0).

    Returns:
        ``(codes, absmax)``: uint8 codes of ``x.shape`` and fp32 absmax ``[ceil(numel/blocksize)]``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    _check_blocksize(blocksize)
    code_cpu = _check_code(_default_dynamic_map() if code is None else code)
    n = x.numel()
    nblocks = -(-n // blocksize)
    flat = x.detach().reshape(-1).float()
    padded = torch.cat([flat, flat.new_zeros(nblocks * blocksize - n)]).view(nblocks, blocksize)
    mag = padded.abs()
    absmax = torch.where(mag.isnan(), torch.zeros_like(mag), mag).amax(dim=1) if n else flat.new_zeros(0)
    v = padded * (1.0 / absmax)[:, None]
    v = torch.where(v.isnan(), torch.full_like(v, -1.0), v).clamp(-1.0, 1.0)
    idx = ((v + 1.0) * 0.5 * float(_LUT_SIZE - 1) + 0.5).to(torch.int64)
    codes = _bin_table(code_cpu.numpy().tobytes()).to(x.device)[idx]
    codes = torch.where((absmax == 0)[:, None], torch.zeros_like(codes), codes)
    return codes.reshape(-1)[:n].to(torch.uint8).reshape(x.shape), absmax


def dequantize_blockwise_8bit(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor | None = None,
    blocksize: int = NESTED_BLOCKSIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise_8bit`: ``code[codes] * absmax[block]`` in fp32, then cast
    (bfloat16 with bitsandbytes' C++ conversion, see :func:`dequantize_nf4`).

    Args:
        codes: uint8 codes, any shape (blocks over the flattened tensor).
        absmax: fp32 ``[ceil(numel/blocksize)]``.
        code: fp32 ``[256]`` map; default :func:`dynamic_map`.
        blocksize: elements per block (> 0).
        dtype: output dtype (float32, bfloat16 or float16).

    Returns:
        ``dtype`` tensor of ``codes.shape``.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32:
        raise TypeError(
            f"absmax must be a float32 tensor, got {getattr(absmax, 'dtype', type(absmax).__name__)}"
        )
    if dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_blocksize(blocksize)
    table = _dynamic_map_on(codes.device) if code is None else _check_code(code).to(codes.device)
    n = codes.numel()
    nblocks = -(-n // blocksize)
    if absmax.numel() != nblocks:
        raise ValueError(f"absmax must have ceil({n}/{blocksize}) = {nblocks} elements, got {absmax.numel()}")
    vals = table[codes.reshape(-1).to(torch.int64)]
    vals = torch.cat([vals, vals.new_zeros(nblocks * blocksize - n)]).view(nblocks, blocksize)
    out = (vals * absmax.reshape(-1, 1).to(codes.device)).reshape(-1)[:n]
    out = _to_bf16_bnb(out) if dtype == torch.bfloat16 else out.to(dtype)
    return out.reshape(codes.shape)


def _check_nf4_input(x: torch.Tensor, blocksize: int, double_quant: bool, fmt: str = "nf4") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"{fmt}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if not isinstance(blocksize, int) or isinstance(blocksize, bool):
        raise TypeError(f"{fmt}: blocksize must be an int, got {type(blocksize).__name__}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"{fmt}: blocksize must be one of {BLOCKSIZES} (bitsandbytes), got {blocksize}")
    if not isinstance(double_quant, bool):
        raise TypeError(f"{fmt}: double_quant must be a bool, got {type(double_quant).__name__}")


def encode_nf4(scaled: torch.Tensor) -> torch.Tensor:
    nan = scaled.isnan()
    codes = encode_codebook(torch.where(nan, torch.zeros_like(scaled), scaled), NF4, check_nan=False)
    return torch.where(nan, torch.full_like(codes, _NAN_CODE), codes)


def quantize_nf4(x: torch.Tensor, blocksize: int = 64, double_quant: bool = False) -> QTensor:
    """Quantize ``x`` to NF4 exactly as bitsandbytes ``quantize_4bit(x, blocksize, compress_statistics=
    double_quant, quant_type="nf4")`` does on CPU.

    Blocks of ``blocksize`` run over the flattened tensor (a block may straddle rows); the tail block uses
    its own absmax. An all-zero block gets absmax 0 and codes 7 (bytes 0x77), the CPU result; bitsandbytes'
    CUDA kernel computes ``0 * (1/0) = NaN`` there and writes code 0 (bytes 0x00). Inputs are converted to
    fp32 first, as bitsandbytes does. NaN makes its whole block NaN (absmax NaN, every code 15); +-Inf gives
    absmax Inf, code 7 for finite elements and 15 for the infinite ones.

    With ``double_quant``: ``offset = absmax.mean()``, then ``absmax - offset`` is quantized with
    :func:`quantize_blockwise_8bit` (default dynamic map, blocks of 256).

    Args:
        x: float32/bfloat16/float16 tensor of any shape, ``n = x.numel()`` elements (not modified).
        blocksize: one of 32, 64, ..., 4096.
        double_quant: quantize the absmax to 8 bits (bitsandbytes ``compress_statistics``).

    Returns:
        QTensor with ``data`` uint8 ``[ceil(n/2)]`` (element 2i in the high nibble), ``scale`` fp32 absmax
        ``[ceil(n/blocksize)]`` or, with double_quant, its uint8 codes, ``nested_scale`` fp32
        ``[ceil(nblocks/256)]`` and ``nested_offset`` an fp32 scalar tensor; ``shape``/``dtype`` of ``x``.
    """
    return quantize_bnb_4bit(x, blocksize, double_quant, "nf4", encode_nf4)


def quantize_bnb_4bit(x: torch.Tensor, blocksize: int, double_quant: bool, fmt: str, encode) -> QTensor:
    """bitsandbytes' ``quantize_4bit`` (default backend) with the code choice left to ``encode``: the part
    nf4 and bnb_fp4 share. ``encode(scaled fp32 [m]) -> int codes [m]`` maps values already scaled into
    [-1, 1] (or NaN); bitsandbytes pads an odd count with one 0.0 before encoding, so the pad nibble is
    ``encode(0.0)``."""
    _check_nf4_input(x, blocksize, double_quant, fmt)
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].view(-1, blocksize)
    absmax = blocks.abs().max(dim=-1).values
    scaled = (blocks * (1.0 / absmax.clamp(min=ABSMAX_FLOOR)).view(-1, 1)).clamp(-1, 1).reshape(-1)
    if full < n:
        tail = flat[full:]
        tail_absmax = tail.abs().max().clamp(min=ABSMAX_FLOOR)
        absmax = torch.cat([absmax, tail_absmax.unsqueeze(0)])
        scaled = torch.cat([scaled, (tail / tail_absmax).clamp(-1, 1)])
    if n % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])
    data = pack_nibbles_high_first(encode(scaled))
    params = {"blocksize": blocksize, "double_quant": double_quant}
    if not double_quant:
        return QTensor(data=data, scale=absmax, fmt=fmt, shape=x.shape, dtype=x.dtype, params=params)
    offset = absmax.mean()
    # the default map (code=None) is read on the host, so a meta absmax (shape-only quantize) works too
    qabsmax, nested = quantize_blockwise_8bit(absmax - offset, None, NESTED_BLOCKSIZE)
    return QTensor(
        data=data,
        scale=qabsmax,
        fmt=fmt,
        shape=x.shape,
        dtype=x.dtype,
        params=params,
        nested_scale=nested,
        nested_offset=offset,
    )


def check_nf4_qtensor(q: QTensor) -> tuple[int, int, bool]:
    """Validate an nf4 QTensor's layout; returns ``(numel, blocksize, double_quant)``."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt != "nf4":
        raise ValueError(f"q must be an nf4 QTensor, got fmt={q.fmt!r}")
    return check_bnb4_qtensor(q)


def check_bnb4_qtensor(q: QTensor) -> tuple[int, int, bool]:
    """Validate the layout of a QTensor of any :data:`BNB_4BIT_FORMATS` format (nf4, bnb_fp4); returns
    ``(numel, blocksize, double_quant)``. The table to decode with is ``BNB_4BIT_FORMATS[q.fmt]``."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q must be a QTensor, got {type(q).__name__}")
    if q.fmt not in BNB_4BIT_FORMATS:
        raise ValueError(f"q must be a QTensor of one of {tuple(BNB_4BIT_FORMATS)}, got fmt={q.fmt!r}")
    blocksize = q.params.get("blocksize")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"q.params['blocksize'] must be one of {BLOCKSIZES}, got {blocksize!r}")
    n = q.shape.numel()
    nblocks = -(-n // blocksize)
    if q.data.dtype != torch.uint8 or q.data.numel() != -(-n // 2):
        raise ValueError(
            f"q.data must be uint8 with ceil({n}/2) = {-(-n // 2)} bytes, "
            f"got {q.data.dtype} {tuple(q.data.shape)}"
        )
    nested = q.nested_scale is not None
    if nested != bool(q.params.get("double_quant", False)) or nested != (q.nested_offset is not None):
        raise ValueError("q.params['double_quant'], q.nested_scale and q.nested_offset must agree")
    want = torch.uint8 if nested else torch.float32
    if q.scale.dtype != want or q.scale.numel() != nblocks:
        raise ValueError(
            f"q.scale must be {want} with {nblocks} elements, got {q.scale.dtype} {tuple(q.scale.shape)}"
        )
    if nested:
        n2 = -(-nblocks // NESTED_BLOCKSIZE)
        if q.nested_scale.dtype != torch.float32 or q.nested_scale.numel() != n2:
            raise ValueError(
                f"q.nested_scale must be float32 with {n2} elements, got "
                f"{q.nested_scale.dtype} {tuple(q.nested_scale.shape)}"
            )
        if q.nested_offset.dtype != torch.float32 or q.nested_offset.numel() != 1:
            raise ValueError(
                f"q.nested_offset must be a float32 scalar, "
                f"got {q.nested_offset.dtype} {tuple(q.nested_offset.shape)}"
            )
    return n, blocksize, nested


def nf4_absmax(q: QTensor) -> torch.Tensor:
    """fp32 per-block absmax ``[nblocks]`` of an nf4 (or bnb_fp4) QTensor, decoding double quantization as
    bitsandbytes ``dequantize_4bit`` does: ``dequantize_blockwise_8bit(scale, nested_scale) + nested_offset``."""
    check_bnb4_qtensor(q)
    if q.nested_scale is None:
        return q.scale
    absmax = dequantize_blockwise_8bit(
        q.scale.reshape(-1), q.nested_scale.reshape(-1), None, NESTED_BLOCKSIZE
    )
    return absmax + q.nested_offset.reshape(()).to(absmax.device)


def dequantize_nf4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an nf4 QTensor: ``NF4[code] * absmax[block]`` in fp32, then cast to ``dtype``.

    Matches bitsandbytes ``dequantize_4bit`` on CPU bit for bit, including NaN: bfloat16 output uses
    bitsandbytes' C++ conversion (NaN keeps its sign, 0xFFC0 for ``0 * inf``), not torch's (every NaN 0xFFFF);
    bitsandbytes' own torch fallback for odd last dims differs there. Unlike bitsandbytes, the result
    always has the logical shape ``q.shape`` (bitsandbytes returns ``[1, n]`` for even 1-D inputs and a
    transposed tensor when the packed weight is a single byte).

    Args:
        q: QTensor from :func:`quantize_nf4`.
        dtype: float32, bfloat16 or float16.

    Returns:
        ``dtype`` tensor of shape ``q.shape``.
    """
    check_nf4_qtensor(q)
    return dequantize_bnb_4bit(q, dtype)


def dequantize_bnb_4bit(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' ``dequantize_4bit`` of a QTensor of any :data:`BNB_4BIT_FORMATS` format, with its
    format's table: see :func:`dequantize_nf4`."""
    n, blocksize, _ = check_bnb4_qtensor(q)
    if dtype not in _SUPPORTED_INPUT:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    absmax = nf4_absmax(q)
    codes = unpack_nibbles_high_first(q.data, n)
    vals = codebook_table(BNB_4BIT_FORMATS[q.fmt]).to(q.device)[codes.to(torch.int64)]
    nblocks = absmax.numel()
    vals = torch.cat([vals, vals.new_zeros(nblocks * blocksize - n)]).view(nblocks, blocksize)
    out = (vals * absmax.reshape(-1, 1)).reshape(-1)[:n]
    out = _to_bf16_bnb(out) if dtype == torch.bfloat16 else out.to(dtype)
    return out.reshape(q.shape)


def _to_bf16_bnb(x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' C++ fp32 -> bf16 conversion: the round-to-nearest-even bit trick applied to every value.

    It equals torch's cast on finite values and Inf, but NaN is not special-cased: the sign and top payload
    bits survive (0x7FC00000 -> 0x7FC0, 0xFFC00000 -> 0xFFC0) and a payload can carry into the sign
    (0x7FFFFFFF -> 0x8000). torch's vectorised cast writes every NaN as 0xFFFF.
    """
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)


__all__ = [
    "BLOCKSIZES",
    "BNB_4BIT_FORMATS",
    "NESTED_BLOCKSIZE",
    "check_bnb4_qtensor",
    "check_nf4_qtensor",
    "create_dynamic_map",
    "dequantize_blockwise_8bit",
    "dequantize_bnb_4bit",
    "dequantize_nf4",
    "dynamic_map",
    "nf4_absmax",
    "quantize_blockwise_8bit",
    "quantize_bnb_4bit",
    "quantize_nf4",
]
