"""Element and format specifications: the data every codec, kernel and checkpoint reads its constants from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch


@dataclass(frozen=True)
class MinifloatSpec:
    """A sign-magnitude binary float with ``ebits`` exponent and ``mbits`` mantissa bits.

    ``nan_inf`` says how the top of the code space is used:
      - ``"none"``: every code is finite (E2M1, E2M3, E3M2). Overflow and +-Inf saturate to +-max.
      - ``"fn"``: only S.1111.111 is NaN, no Inf (OCP FP8 E4M3).
      - ``"ieee"``: exponent all-ones is Inf/NaN (FP8 E5M2).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    nan_inf: str
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def sign_mask(self) -> int:
        return 1 << (self.ebits + self.mbits)

    @property
    def max_code(self) -> int:
        """Code of +max (the positive saturation value)."""
        if self.nan_inf == "fn":
            return self.sign_mask - 2
        if self.nan_inf == "ieee":
            return ((1 << self.ebits) - 1 << self.mbits) - 1
        return self.sign_mask - 1

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max_normal (OCP MX ``emax_elem``)."""
        # frexp: max_normal = m * 2^e with 0.5 <= m < 1, exact for every float (no rounding of a log)
        return math.frexp(self.max_normal)[1] - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mbits)


@dataclass(frozen=True)
class CodebookSpec:
    """A 4-bit lookup table (code -> value); encoding picks the nearest level."""

    name: str
    levels: tuple[float, ...]


@dataclass(frozen=True)
class IntSpec:
    name: str
    bits: int
    signed: bool

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1


E2M1 = MinifloatSpec("e2m1", ebits=2, mbits=1, bias=1, max_normal=6.0, nan_inf="none")
E2M3 = MinifloatSpec("e2m3", ebits=2, mbits=3, bias=1, max_normal=7.5, nan_inf="none")
E3M2 = MinifloatSpec("e3m2", ebits=3, mbits=2, bias=3, max_normal=28.0, nan_inf="none")
E4M3 = MinifloatSpec("e4m3", ebits=4, mbits=3, bias=7, max_normal=448.0, nan_inf="fn", torch_dtype=torch.float8_e4m3fn)
E5M2 = MinifloatSpec("e5m2", ebits=5, mbits=2, bias=15, max_normal=57344.0, nan_inf="ieee", torch_dtype=torch.float8_e5m2)

INT4 = IntSpec("int4", bits=4, signed=True)
UINT4 = IntSpec("uint4", bits=4, signed=False)

# bitsandbytes `get_4bit_type("nf4")`, index = code
NF4 = CodebookSpec(
    "nf4",
    (
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ),
)
# bitsandbytes `get_4bit_type("fp4")`: not E2M1 (code 0b011 is the max, exponent field "reversed"). Code 8 is
# +0.0, not -0.0: bitsandbytes writes it as the Python int `-0`, so its table (the `quant_map` it saves, and
# what its PyTorch kernel decodes) holds +0.0 there (its CUDA and scalar C++ decoders give -0.0)
BNB_FP4 = CodebookSpec(
    "bnb_fp4",
    tuple(v / 12.0 for v in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)),
)


class _Choice(str, Enum):
    """A string option whose bad values raise a ValueError listing the valid ones."""

    @classmethod
    def _missing_(cls, value: object) -> None:
        valid = ", ".join(repr(m.value) for m in cls)
        option = {"ScaleRounding": "scale_rounding", "NVFP4Convention": "convention"}.get(cls.__name__, cls.__name__)
        raise ValueError(f"{option}: {value!r} is not one of {valid}")


class ScaleRounding(_Choice):
    """How an fp32 block scale becomes an E8M0 power of two."""

    RCEIL = "rceil"
    """Round ``amax * (1/max_elem)`` up to a power of two (LightX2V, TransformerEngine, FlashInfer)."""
    FLOOR = "floor"
    """``2^(floor(log2(amax)) - emax_elem)``: the OCP MX spec rule and torchao FLOOR."""


class NVFP4Convention(_Choice):
    """Whose NVFP4 arithmetic to reproduce where the producers differ (formats.md section 1.3)."""

    VLLM = "vllm"
    """vLLM (``scaled_fp4_quant``, ``ref_nvfp4_quant``; FlashInfer, TRT-LLM): multiplier global scale, element
    multiplier ``1/(sf * (1/S))``, zero block -> scale 0x00, subnormal scales allowed."""
    LIGHTX2V = "lightx2v"
    """LightX2V ``scaled_nvfp4_quant``: as ``vllm`` but the element multiplier is ``S * (1/sf)`` (another
    rounding order: some elements at E2M1 ties get another code)."""
    TORCHAO = "torchao"
    """torchao ``nvfp4_quantize``: divisor per-tensor scale, block scales clamped to >= 2^-6."""
    COMPRESSED_TENSORS = "compressed-tensors"
    """llm-compressor: ``amax/6`` in the weight dtype, zero scale replaced by 0.125."""


@dataclass(frozen=True)
class FormatSpec:
    """A named quantization format: what the element, block and scale are, and its option defaults."""

    name: str
    kind: str
    element: MinifloatSpec | CodebookSpec | IntSpec
    block: int | tuple[int, int]
    scale: str
    options: dict = field(default_factory=dict, hash=False, compare=False)

    def __str__(self) -> str:
        return self.name


NVFP4_FORMAT = FormatSpec(
    "nvfp4", "blockscaled", E2M1, 16, "e4m3",
    {"global_scale": None, "convention": NVFP4Convention.VLLM.value, "scale_layout": "linear"},
)
_MX_OPTIONS = {"scale_rounding": ScaleRounding.RCEIL.value, "scale_layout": "linear"}
MXFP4_FORMAT = FormatSpec("mxfp4", "blockscaled", E2M1, 32, "e8m0", _MX_OPTIONS)
MXFP6_E2M3_FORMAT = FormatSpec("mxfp6_e2m3", "blockscaled", E2M3, 32, "e8m0", _MX_OPTIONS)
MXFP6_E3M2_FORMAT = FormatSpec("mxfp6_e3m2", "blockscaled", E3M2, 32, "e8m0", _MX_OPTIONS)
MXFP8_E4M3_FORMAT = FormatSpec("mxfp8_e4m3", "blockscaled", E4M3, 32, "e8m0", _MX_OPTIONS)
MXFP8_E5M2_FORMAT = FormatSpec("mxfp8_e5m2", "blockscaled", E5M2, 32, "e8m0", _MX_OPTIONS)
FP4_B32_FORMAT = FormatSpec("fp4_b32", "blockscaled", E2M1, 32, "fp32", {})
FP8_BLOCK_FORMAT = FormatSpec("fp8_block", "fp8_block", E4M3, (1, 128), "fp32", {"block": (1, 128), "scale_fmt": None})
# one scale per row: the block is 1 x (the whole last dim), written (1, -1)
FP8_ROWWISE_FORMAT = FormatSpec("fp8_rowwise", "fp8_rowwise", E4M3, (1, -1), "fp32", {})
NF4_FORMAT = FormatSpec("nf4", "codebook", NF4, 64, "fp32", {"blocksize": 64, "double_quant": False})
BNB_FP4_FORMAT = FormatSpec("bnb_fp4", "codebook", BNB_FP4, 64, "fp32", {"blocksize": 64, "double_quant": False})
INT4_AWQ_FORMAT = FormatSpec("int4_awq", "int_group", UINT4, 128, "fp16", {"group_size": 128})

FORMATS: dict[str, FormatSpec] = {}
"""Format name -> :class:`FormatSpec` of every registered format, in registration order. Filled by
:func:`lowbit.formats.registry.register_format` (the registry is the one list of formats; this table is its
bit-level view, for the code that needs only the spec)."""
