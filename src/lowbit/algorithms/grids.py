"""Each 4-bit weight format's quantization grid, opened up for algorithms that round column by column.

GPTQ quantizes a weight one input column at a time and changes the columns it has not reached yet, so the
block scales cannot come from one call of the format's quantizer on the final weight. A :class:`Grid` splits
that quantizer in two: :meth:`Grid.fit` computes the scales of one group of columns (the format's block
along K) from the weights given, exactly as the reference in :mod:`lowbit.formats` computes them from a
block, and :meth:`Grid.round` rounds values onto that group's grid exactly as the reference rounds an element
with those scales. :meth:`Grid.assemble` packs the codes and scales into the QTensor the reference would
write (same layout, params and global scale), so every checkpoint writer and kernel takes the result, and
``lowbit.dequantize`` of it returns the values :meth:`Grid.round` returned, bit for bit.

A grid with a scale search (``grid_for(..., scale_search=factors)``) fits each group's scales by the same
rules to the group's weights times each factor too and keeps per row the candidate that rounds the group with
the least squared error. Which scales are stored then differs from round-to-nearest, but each is a value the
format stores (an E4M3 or E8M0 code, an fp32 absmax, an fp16 scale and integer zero point) computed as the
reference computes it from some block, so the QTensor is as valid and decodes to the rounded values bit for bit.

The per-element arithmetic below repeats the reference's operation for operation (the order of every fp32
operation is part of the format); ``tests/algorithms`` pins the two together: fitting and rounding every
group of an unchanged weight gives the reference's own codes and scales.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..api import quantize
from ..formats.blockscaled import layout_scales, quantize_blockscaled
from ..formats.bnb_fp4 import encode_bnb_fp4
from ..formats.codecs import decode_codebook, decode_e8m0, decode_minifloat, encode_minifloat, true_div
from ..formats.int4_awq import pack_awq
from ..formats.nf4 import ABSMAX_FLOOR, BNB_4BIT_FORMATS, encode_nf4
from ..formats.packing import pack_fp4, pack_nibbles_high_first
from ..formats.qtensor import QTensor
from ..formats.spec import E2M1, NVFP4Convention, ScaleRounding

GRID_FORMATS = ("nvfp4", "mxfp4", "fp4_b32", "nf4", "bnb_fp4", "int4_awq")
"""Weight formats a :class:`Grid` exists for."""

State = tuple[torch.Tensor, ...]
"""The scales of one group, per row (what :meth:`Grid.fit` returns and :meth:`Grid.round` reads)."""

FIT_ELEMENTS = 1 << 23
"""The most weights :meth:`Grid.fit_groups` fits in one call (32 MB of fp32; a scale search holds a few
copies per factor)."""


class Grid:
    """The grid of one weight ``[rows, K]`` in one format: groups of :attr:`group` consecutive columns."""

    fmt: str
    group: int
    code_dtype: torch.dtype = torch.uint8
    round_reads: tuple[int, ...] = (0, 1)
    """The positions of a state that :meth:`round` reads (the others may be passed as None)."""
    free_scale: bool = False
    """Whether a group's scale is a free fp32 multiplier the format stores as it is (fp4_b32, nf4, bnb_fp4): a
    value decodes as ``unit_values(code) * state[0]``, so any positive scale gives a valid QTensor
    (:meth:`unit_values`, :meth:`with_scale`)."""

    def __init__(self, template: QTensor) -> None:
        # the reference's QTensor of the original weight: its layout, params and global scale are kept
        self.template = template
        self.rows, self.cols = int(template.shape[0]), int(template.shape[1])

    def fit(self, w: torch.Tensor) -> State:
        """Scales of one group from its weights ``w`` (fp32 ``[rows, group]``)."""
        raise NotImplementedError

    def fit_groups(self, w: torch.Tensor) -> list[State]:
        """The states of every group of ``w`` (fp32 ``[rows, n * group]``): :meth:`fit` of each group, in a
        few calls over many groups at once.

        A fit treats each row of its input on its own (a block's scales come from that block alone), so the
        groups' rows stacked into one input get the states one fit per group gives; one call per group
        would instead cost a few dozen kernel launches per group (thousands for a large layer), far more
        than their arithmetic. At most :data:`FIT_ELEMENTS` weights go into one call, which bounds the
        temporaries of a scale search."""
        rows, cols = w.shape
        G = self.group
        n = cols // G
        per_call = max(1, FIT_ELEMENTS // max(1, rows * G))
        states: list[State] = []
        for g0 in range(0, n, per_call):
            k = min(n, g0 + per_call) - g0
            blocks = w[:, g0 * G:(g0 + k) * G].reshape(rows, k, G).transpose(0, 1).reshape(k * rows, G)
            fitted = self.fit(blocks)
            states += [tuple(t[j * rows:(j + 1) * rows] for t in fitted) for j in range(k)]
        return states

    def round(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, fp32 dequantized values) of fp32 values ``x`` (``[rows]`` or ``[rows, n]``) on the grid of
        one group."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, state: State) -> torch.Tensor:
        """fp32 values of ``codes`` (``[rows]`` or ``[rows, n]``) on the grid of one group: what :meth:`round`
        returns with them (it decodes through this method)."""
        raise NotImplementedError

    def levels(self, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """Every value one group's grid holds, per row: (the 16 codes ``[16]``, their fp32 values
        ``[rows, 16]``), decoded as :meth:`round` decodes (so a value :meth:`round` returned is among them,
        bit for bit)."""
        codes = torch.arange(16, dtype=self.code_dtype, device=state[self.round_reads[0]].device)
        return codes, self.decode(codes.expand(self.rows, 16), state)

    def assemble(self, codes: torch.Tensor, states: list[State]) -> QTensor:
        """The QTensor of codes ``[rows, K]`` and the states of groups ``0 .. K/group - 1``."""
        raise NotImplementedError

    def unit_values(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 values of ``codes`` at scale 1 (grids with :attr:`free_scale`)."""
        raise NotImplementedError

    def with_scale(self, state: State, scale: torch.Tensor) -> State:
        """``state`` with its per-row scale replaced by fp32 ``scale`` ``[rows]`` (> 0; grids with
        :attr:`free_scale`): :meth:`round` and :meth:`decode` then use it as they use a fitted one."""
        raise NotImplementedError


def _col(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-row ``[rows]`` state tensor shaped to broadcast against ``x`` (``[rows]`` or ``[rows, n]``)."""
    return t if x.dim() == 1 else t.unsqueeze(-1)


class _BlockscaledFP4(Grid):
    """E2M1 elements with one scale code per group (nvfp4, mxfp4): a state is (the group's scale codes, the
    multiplier the reference quantizes with, the step it decodes with)."""

    round_reads = (1, 2)

    def round(self, x, state):
        codes = encode_minifloat(x * _col(state[1], x), E2M1)
        return codes, self.decode(codes, state)

    def decode(self, codes, state):
        return decode_minifloat(codes, E2M1) * _col(state[2], codes)

    def assemble(self, codes, states):
        t = self.template
        sf = torch.stack([st[0] for st in states], dim=1)
        return dataclasses.replace(
            t, data=pack_fp4(codes), scale=layout_scales(sf, t.shape[:-1], t.scale_layout)
        )


class _NVFP4(_BlockscaledFP4):
    fmt, group = "nvfp4", 16

    def __init__(self, template: QTensor) -> None:
        super().__init__(template)
        conv = NVFP4Convention(template.params.get("convention", "vllm"))
        if conv not in (NVFP4Convention.VLLM, NVFP4Convention.LIGHTX2V):
            raise ValueError(
                f"convention: GPTQ rounds nvfp4 with the 'vllm' or 'lightx2v' multiplier, got {conv.value!r}"
            )
        if template.global_scale is None:
            raise ValueError("global_scale: GPTQ needs an nvfp4 weight with a global scale (not 'none')")
        self.convention = conv
        self.s = template.global_scale.reshape(()).float()

    def fit(self, w):
        _, sf = quantize_blockscaled(w, E2M1, 16, "e4m3", global_scale=self.s, convention=self.convention)
        sf32 = sf.float().reshape(-1)
        s = self.s
        # the multiplier of quantize_blockscaled, in its order of operations
        m = 1.0 / (sf32 * (1.0 / s)) if self.convention is NVFP4Convention.VLLM else s * (1.0 / sf32)
        mult = torch.where(sf32 == 0, torch.zeros_like(sf32), m)
        # the decode step of dequantize_nvfp4: fp32(sf) / S
        return sf.reshape(-1), mult, sf32 / s


class _MXFP4(_BlockscaledFP4):
    fmt, group = "mxfp4", 32

    def __init__(self, template: QTensor) -> None:
        super().__init__(template)
        self.rounding = ScaleRounding(template.params.get("scale_rounding", "rceil"))

    def fit(self, w):
        _, sf = quantize_blockscaled(w, E2M1, 32, "e8m0", scale_rounding=self.rounding)
        code = sf.reshape(-1).view(torch.uint8).to(torch.int32)
        # 2^-e exactly, as quantize_blockscaled multiplies; NaN for a NaN block (0xFF)
        inv = decode_e8m0((254 - code).clamp(min=0))
        inv = torch.where(code == 255, torch.full_like(inv, float("nan")), inv)
        return sf.reshape(-1), inv, decode_e8m0(code)


class _FP4B32(Grid):
    fmt, group = "fp4_b32", 32
    free_scale = True

    def fit(self, w):
        _, sf = quantize_blockscaled(w, E2M1, 32, "fp32")
        sf = sf.reshape(-1)
        return sf, torch.where(sf == 0, torch.ones_like(sf), sf)

    def round(self, x, state):
        sf, safe = _col(state[0], x), _col(state[1], x)
        scaled = torch.where(sf == 0, x * 0.0, x / safe)
        codes = encode_minifloat(scaled, E2M1)
        return codes, self.decode(codes, state)

    def decode(self, codes, state):
        return decode_minifloat(codes, E2M1) * _col(state[0], codes)

    def assemble(self, codes, states):
        sf = torch.stack([st[0] for st in states], dim=1)
        return dataclasses.replace(self.template, data=pack_fp4(codes), scale=sf)

    def unit_values(self, codes):
        return decode_minifloat(codes, E2M1)

    def with_scale(self, state, scale):
        return scale, torch.where(scale == 0, torch.ones_like(scale), scale)


class _BNB4(Grid):
    """nf4 and bnb_fp4: blocks run over the flattened weight, so a block is ``blocksize`` columns of one row
    only when ``K % blocksize == 0`` (checked by :func:`grid_for`); no double quantization (the 8-bit absmax
    depends on every block's absmax, unknown until the last column)."""

    free_scale = True

    def __init__(self, template: QTensor) -> None:
        super().__init__(template)
        self.fmt = template.fmt
        self.group = int(template.params["blocksize"])
        self.spec = BNB_4BIT_FORMATS[self.fmt]
        self.encode = encode_nf4 if self.fmt == "nf4" else encode_bnb_fp4

    def fit(self, w):
        absmax = w.abs().max(dim=-1).values
        return absmax, 1.0 / absmax.clamp(min=ABSMAX_FLOOR)

    def round(self, x, state):
        codes = self.encode((x * _col(state[1], x)).clamp(-1, 1))
        return codes, self.decode(codes, state)

    def decode(self, codes, state):
        return decode_codebook(codes, self.spec) * _col(state[0], codes)

    def assemble(self, codes, states):
        absmax = torch.stack([st[0] for st in states], dim=1).reshape(-1)
        data = pack_nibbles_high_first(codes.reshape(-1))
        return dataclasses.replace(self.template, data=data, scale=absmax)

    def unit_values(self, codes):
        return decode_codebook(codes, self.spec)

    def with_scale(self, state, scale):
        return scale, 1.0 / scale.clamp(min=ABSMAX_FLOOR)


class _INT4AWQ(Grid):
    """AutoAWQ's asymmetric INT4 in float16 (the weight's fp16 image, as AutoAWQ casts the layer)."""

    fmt = "int4_awq"
    code_dtype = torch.int32

    def __init__(self, template: QTensor) -> None:
        super().__init__(template)
        self.group = int(template.params["group_size"])

    def fit(self, w):
        w16 = w.to(torch.float16)
        if not torch.isfinite(w16).all():
            raise ValueError("int4_awq: a weight left float16's range during GPTQ's updates")
        max_val, min_val = w16.amax(dim=-1), w16.amin(dim=-1)
        scales = true_div((max_val - min_val).clamp(min=1e-5), 15)
        zeros = (-torch.round(min_val / scales)).clamp(0, 15)
        return scales, zeros

    def round(self, x, state):
        s, z = _col(state[0], x), _col(state[1], x)
        x16 = x.to(torch.float16)
        # quantize_int4_awq's two passes: the fake-quantized weight, then the integer AutoAWQ stores
        w_fq = (torch.clamp(torch.round(x16 / s) + z, 0, 15) - z) * s
        q = torch.round((w_fq + z * s) / s)
        return q.to(torch.int32), self.decode(q.to(torch.int32), state)

    def decode(self, codes, state):
        # the codes are small integers, exact in float16: (q - z) as the fp16 subtraction of the two passes
        s, z = _col(state[0], codes), _col(state[1], codes)
        return ((codes.to(torch.float16) - z).to(torch.float16) * s).float()

    def assemble(self, codes, states):
        scales = torch.stack([st[0] for st in states], dim=1)
        zeros = torch.stack([st[1] for st in states], dim=1)
        if codes.min() < 0 or codes.max() > 15:
            raise ValueError("int4_awq: an integer left [0, 15]")
        return dataclasses.replace(
            self.template,
            data=pack_awq(codes.t()),
            scale=scales.t().contiguous(),
            zeros=pack_awq(zeros.to(torch.int32).t()),
        )


class _ScaleSearch(Grid):
    """A grid whose :meth:`fit` tries each group's scales as the format's reference fits them to the weights
    times each factor of ``factors`` as well as to the weights themselves, and keeps per row the candidate
    whose rounding of the group has the least squared error (a clipping search: a factor below 1 gives up the
    largest values for a finer grid under the others). Every candidate is a state the format's own fit
    produced, so :meth:`round` and :meth:`assemble` are the wrapped grid's and the QTensor decodes to the
    values rounded, bit for bit; only which scales are stored differs from round-to-nearest."""

    def __init__(self, inner: Grid, factors: tuple[float, ...]) -> None:
        self.inner = inner
        self.template, self.rows, self.cols = inner.template, inner.rows, inner.cols
        self.fmt, self.group, self.round_reads = inner.fmt, inner.group, inner.round_reads
        self.code_dtype = inner.code_dtype
        self.free_scale = inner.free_scale
        self.factors = factors
        self._scales: dict[tuple, torch.Tensor] = {}

    def _factor_tensor(self, w: torch.Tensor) -> torch.Tensor:
        # made once per device and dtype: a host-to-device copy per group would synchronize the GPU loop
        key = (w.device, w.dtype)
        t = self._scales.get(key)
        if t is None:
            t = self._scales[key] = torch.tensor((1.0, *self.factors), dtype=w.dtype, device=w.device)
        return t

    def fit(self, w):
        # every candidate in one fit and one rounding of the stacked rows: a group is a few thousand values,
        # so per-call overhead, not arithmetic, is the cost
        n = len(self.factors) + 1
        scale = self._factor_tensor(w)
        stacked = (w.unsqueeze(0) * scale.view(n, 1, 1)).reshape(n * w.shape[0], w.shape[1])
        states = self.inner.fit(stacked)
        repeated = w.repeat(n, 1)
        _, q = self.inner.round(repeated, states)
        err = (repeated - q).square().sum(dim=-1).view(n, w.shape[0])
        # a non-finite block keeps the reference's state; ties too (argmin takes the first, factor 1)
        err = torch.where(err.isnan(), torch.full_like(err, float("inf")), err)
        best = err.argmin(dim=0)
        rows = torch.arange(w.shape[0], device=w.device)
        return tuple(_take(st.view(n, w.shape[0]), best, rows) for st in states)

    def round(self, x, state):
        return self.inner.round(x, state)

    def decode(self, codes, state):
        return self.inner.decode(codes, state)

    def assemble(self, codes, states):
        return self.inner.assemble(codes, states)

    def unit_values(self, codes):
        return self.inner.unit_values(codes)

    def with_scale(self, state, scale):
        return self.inner.with_scale(state, scale)


def _take(st: torch.Tensor, best: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``st[best[r], r]`` for every row ``r``; 1-byte scale codes (e4m3, e8m0) by their bits."""
    if st.dtype.itemsize == 1:
        return st.view(torch.uint8)[best, rows].view(st.dtype)
    return st[best, rows]


_GRIDS = {"nvfp4": _NVFP4, "mxfp4": _MXFP4, "fp4_b32": _FP4B32, "nf4": _BNB4, "bnb_fp4": _BNB4,
          "int4_awq": _INT4AWQ}


def grid_for(weight: torch.Tensor, fmt: str, *, scale_search: tuple[float, ...] = (), **options: Any) -> Grid:
    """The :class:`Grid` of a 2-D ``weight`` in ``fmt`` with ``lowbit.quantize`` options ``options``.

    The reference QTensor of ``weight`` (the round-to-nearest result) is the template whose layout, params and
    global scale the GPTQ result keeps: for nvfp4 the global scale is the one given in ``options`` (fused
    siblings share one) or the format default from the original weight.

    ``scale_search``: clipping factors in ``(0, 1]`` (see :class:`lowbit.algorithms.GPTQ`): :meth:`Grid.fit`
    then also fits each group's scales, by the format's own rule, to the group's weights times each factor and
    keeps per row the scales with the least squared rounding error of the group.

    Raises:
        ValueError: a format without a grid, a weight that is not 2-D, nf4/bnb_fp4 blocks that would straddle
            rows (``K % blocksize``) or with double quantization, an nvfp4 convention other than vllm or
            lightx2v.
    """
    if fmt not in _GRIDS:
        raise ValueError(f"fmt: GPTQ supports {', '.join(GRID_FORMATS)}, got {fmt!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = getattr(weight, "shape", type(weight))
        raise ValueError(f"weight must be a 2-D tensor [out, in], got {got}")
    if fmt in ("nf4", "bnb_fp4"):
        if options.get("double_quant"):
            raise ValueError(f"double_quant: GPTQ for {fmt} needs double_quant=False")
        bs = options.get("blocksize", 64)
        if isinstance(bs, int) and weight.shape[1] % bs:
            raise ValueError(
                f"{fmt}: in_features={weight.shape[1]} is not a multiple of blocksize={bs}; the blocks would "
                "straddle rows, which column-wise GPTQ cannot keep"
            )
    factors = check_scale_search(scale_search)
    with torch.no_grad():
        template = quantize(weight.detach(), fmt, backend="torch", **options)
    grid = _GRIDS[fmt](template)
    return _ScaleSearch(grid, factors) if factors else grid


def check_scale_search(scale_search: Any) -> tuple[float, ...]:
    """``scale_search`` as a tuple of floats; TypeError/ValueError naming it for anything but numbers in
    ``(0, 1]``."""
    if isinstance(scale_search, (str, bytes)) or not hasattr(scale_search, "__iter__"):
        raise TypeError(f"scale_search must be a tuple of floats, got {type(scale_search).__name__}")
    factors = tuple(scale_search)
    for f in factors:
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(f"scale_search must hold floats, got {type(f).__name__}")
        if not 0 < f <= 1:
            raise ValueError(f"scale_search factors must lie in (0, 1] (they shrink the fitted range), got {f}")
    return tuple(float(f) for f in factors)


__all__ = ["GRID_FORMATS", "Grid", "check_scale_search", "grid_for"]
