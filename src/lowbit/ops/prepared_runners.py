"""The decode runners of prepared layers whose activations are quantized (``PreparedWeight.scaled_runners``):
each makes, for one M, x dtype and bias presence, the launches :func:`lowbit.ops.scaled_linear` makes (the
activation's quantize kernel, then the GEMM) with everything but x, the outputs and the scratch fixed once, so
it gives the same bits with less host work per call. ``x`` is ``[M, K]`` contiguous and 16-byte aligned and
``bias`` None or ``[N]`` of the output dtype, contiguous and aligned (the caller checks; nothing is checked
here). :data:`MAX_RUNNERS` bounds the runners a prepared layer keeps (these and its W4A16 GEMV runners).
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import scratch_per_call

MAX_RUNNERS = 256
"""Runners kept per layer (one per M up to GEMV_MAX_M, x dtype and bias presence); cleared when full."""

MAX_STREAMS = 8
"""Streams whose scratch one runner keeps (:func:`stream_scratch`); cleared when full."""


def stream_scratch(kept: dict, dev_index: int, make) -> tuple[tuple, bool]:
    """(buffers, made now): a runner's intermediates of one call, which never leave it, kept in ``kept`` per
    stream (the calls on one stream run one after another), so a call allocates only its output. Made fresh
    (``make()``) inside a CUDA-graph capture, where the graph owns them, and inside a custom op's per-call
    scope (see ``lowbit.kernels.per_call_scratch``)."""
    if torch._C._cuda_isCurrentStreamCapturing() or scratch_per_call():
        return make(), True
    stream = torch._C._cuda_getCurrentRawStream(dev_index)
    bufs = kept.get(stream)
    if bufs is None:
        if len(kept) >= MAX_STREAMS:  # streams come and go: keep the buffers of a few
            kept.clear()
        bufs = kept[stream] = make()
        return bufs, True
    return bufs, False


class Fp8BlockDecode:
    """``run(x, bias) -> out``: the decode call of a layer whose activations are quantized to fp8_block
    (block 1x128) and whose GEMM is lowbit's decoding kernel (``lowbit.kernels.scaled_mm.KernelRoute``), at one
    M, x dtype and bias presence. It makes the launches :func:`lowbit.ops.scaled_linear` makes (the
    activation's quantize kernel, then the GEMM) with everything but x, the outputs and the scratch fixed, so
    it gives the same bits; ``x`` is ``[M, K]`` contiguous and 16-byte aligned (the caller checks)."""

    __slots__ = ("qlaunch", "data_shape", "scale_shape", "m", "k", "n_mblocks", "route", "a_strides", "device")

    def __init__(self, plan: Any, route: Any, a_strides: tuple, device: torch.device) -> None:
        self.qlaunch = plan.launch
        self.data_shape, self.scale_shape = tuple(plan.data_shape), tuple(plan.scale_shape)
        self.m, self.k, self.n_mblocks = plan.m, plan.kdim, plan.n_mblocks
        self.route, self.a_strides, self.device = route, a_strides, device

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        data = torch.empty(self.data_shape, dtype=torch.float8_e4m3fn, device=self.device)
        scale = torch.empty(self.scale_shape, dtype=torch.float32, device=self.device)
        k = self.k
        self.qlaunch(True, x, data, scale, self.m, k, 0, k, self.n_mblocks)
        return self.route.run(data, scale, scale, self.a_strides, None, bias)


class GemvRouteDecode:
    """``run(x, bias) -> out``: the decode call of an nvfp4/mxfp4 weight with nvfp4 (global scale derived per
    call) or mxfp4 activations at one M, bf16 x and bias presence, as ``lowbit.kernels.scaled_mm``'s ``"gemv"``
    route makes it: [the absmax pass,] the activation's quantize kernel, its exact decode to bf16 (without the
    global scale), then the W4A16 GEMV dividing by the global scale, each launch kept from the general path's
    first call, so the same bits."""

    __slots__ = ("amax_launch", "qlaunch", "decode", "gemv", "m", "k", "cols", "cols4", "n_groups", "width",
                 "nvfp4", "device", "dev_index", "kept", "roundtrip")

    def __init__(self, launches: list, decode: Any, gemv: Any, m: int, k: int, block: int, width: int,
                 device: torch.device, roundtrip: Any = None) -> None:
        # roundtrip: for small nvfp4 activations, the one launch that does the absmax, quantize and decode
        # launches' work with their bits (lowbit.kernels.blockscaled.nvfp4_roundtrip_launch)
        self.roundtrip = roundtrip
        self.nvfp4 = block == 16
        self.amax_launch = launches[0] if self.nvfp4 else None
        self.qlaunch = launches[-1]
        self.decode, self.gemv = decode, gemv
        self.m, self.k, self.width = m, k, width
        self.cols = k // block
        self.cols4 = -(-self.cols // 4) * 4
        self.n_groups = m * self.cols
        self.device = device
        self.dev_index = device.index if device.index is not None else torch.cuda.current_device()
        self.kept: dict[int, tuple] = {}

    def _scratch(self) -> tuple:
        """(activation codes, block scales, amax bits, global scale, decoded activation, its int16 view): the
        intermediates of one call (see :func:`stream_scratch`)."""
        bufs, fresh = stream_scratch(self.kept, self.dev_index, self._new_scratch)
        if not fresh and self.nvfp4 and self.roundtrip is None:
            bufs[2].zero_()  # the absmax pass takes the max into it
        return bufs

    def _new_scratch(self) -> tuple:
        dev, m, k = self.device, self.m, self.k
        xd = torch.empty((m, k), dtype=torch.bfloat16, device=dev)
        return (torch.empty((m, self.width), dtype=torch.uint8, device=dev),
                torch.empty((m, self.cols), dtype=torch.uint8, device=dev),
                torch.zeros(1, dtype=torch.int32, device=dev) if self.nvfp4 else None,
                torch.empty(1, dtype=torch.float32, device=dev) if self.nvfp4 else None,
                xd, xd.view(torch.int16))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        idx = self.dev_index
        data, scale, amax, gs, xd, xd16 = self._scratch()
        if self.roundtrip is not None:
            self.roundtrip.run(idx, x, gs, xd16, self.m * self.k)
        elif self.nvfp4:
            # lowbit.kernels.blockscaled.quantize_nvfp4 with the default global scale: absmax bits, then the
            # quantize kernel derives 2688 / amax into gs and quantizes with it
            self.amax_launch.run(idx, x, amax, self.m * self.k)
            self.qlaunch.run(idx, x, data, scale, gs, amax, self.n_groups, self.cols, self.cols4)
        else:
            self.qlaunch.run(idx, x, data, scale, scale, scale, self.n_groups, self.cols, self.cols4)
        if self.roundtrip is None:
            self.decode.run(idx, data, scale, scale, xd16, self.n_groups, self.cols, self.cols4)
        return self.gemv(xd, bias, gs)


class MXDecode:
    """``run(x, bias) -> out``: the decode call of a layer whose activations are quantized to an MX format
    (linear scales) and whose GEMM is lowbit's decoding kernel (``KernelRoute``), at one M, x dtype and bias
    presence: the quantize kernel's launch as ``lowbit.kernels.blockscaled.quantize_mx`` makes it (into data and
    scale buffers kept per stream, :func:`stream_scratch`), then the GEMM, so the same bits as
    :func:`lowbit.ops.scaled_linear`."""

    __slots__ = ("qlaunch", "m", "k", "width", "cols", "cols4", "n_groups", "data_dtype", "route", "a_strides",
                 "device", "dev_index", "kept")

    def __init__(self, qlaunch: Any, m: int, k: int, data_dtype: torch.dtype, route: Any, a_strides: tuple,
                 device: torch.device) -> None:
        self.qlaunch, self.m, self.k = qlaunch, m, k
        self.data_dtype = data_dtype
        # the quantize kernel's buffers (as lowbit.kernels.blockscaled._QuantizeLaunch makes them): uint8 rows as
        # wide as the activation's data rows (K bytes for 8-bit elements, viewed as the FP8 dtype after; K * bits
        # / 8 for the packed ones), one E8M0 byte per 32 columns
        self.width = a_strides[0]
        self.cols = k // 32
        self.cols4 = -(-self.cols // 4) * 4
        self.n_groups = m * self.cols
        self.route, self.a_strides, self.device = route, a_strides, device
        self.dev_index = device.index if device.index is not None else torch.cuda.current_device()
        self.kept: dict[int, tuple] = {}

    def _new_scratch(self) -> tuple:
        data = torch.empty((self.m, self.width), dtype=torch.uint8, device=self.device)
        return (data, torch.empty((self.m, self.cols), dtype=torch.uint8, device=self.device),
                data if self.data_dtype == torch.uint8 else data.view(self.data_dtype))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        (data, scale, typed), _ = stream_scratch(self.kept, self.dev_index, self._new_scratch)
        self.qlaunch.run(self.dev_index, x, data, scale, scale, scale, self.n_groups, self.cols, self.cols4)
        return self.route.run(typed, scale, scale, self.a_strides, None, bias)


class Fp8BlockLibraryGemm:
    """``run(x, bias) -> out``: the call of a layer whose activations are quantized to fp8_block (block 1x128)
    and whose GEMM is a library's, cuBLASLt's block-scaled one (``lowbit.kernels.cublas_fp8_block``) or DeepGEMM's
    (``lowbit.kernels.deep_gemm_fp8``), at one M, x dtype and bias presence: the quantize kernel writes the scales
    M-major (the values the general path computes and then copies into that layout), then the prepared library
    call (``mm``), so the same bits with one launch less."""

    __slots__ = ("qlaunch", "data_shape", "scale_shape", "m", "k", "n_mblocks", "mm", "device")

    def __init__(self, plan: Any, mm: Any, device: torch.device) -> None:
        self.qlaunch = plan.launch
        self.data_shape, self.scale_shape = tuple(plan.data_shape), tuple(plan.scale_shape)
        self.m, self.k, self.n_mblocks = plan.m, plan.kdim, plan.n_mblocks
        self.mm, self.device = mm, device

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, k = self.m, self.k
        data = torch.empty(self.data_shape, dtype=torch.float8_e4m3fn, device=self.device)
        scale = torch.empty_strided(self.scale_shape, (1, m), dtype=torch.float32, device=self.device)
        self.qlaunch(True, x, data, scale, m, k, 0, k, self.n_mblocks)
        return self.mm(data, scale, bias)


class Nvfp4DequantGemm:
    """``run(x, bias) -> out``: the call of a w4a4-nvfp4 layer on the ``"dequant"`` route (prefill and DiT
    sizes) at one M, x dtype and bias presence: the activation quantized and decoded in one pass
    (``lowbit.kernels.blockscaled.quantize_nvfp4_decoded``, after the absmax pass of a derived global scale),
    then the route's GEMM on the decoded values (``scaled_mm_routes.dequant_mm_decoded``): the bits of quantizing
    then decoding, without writing and reading back the packed activation. Where the global scale is derived
    and the route decodes the weight in one chunk at this M, the absmax pass and the weight's decoding share
    one launch (``blockscaled.finite_absmax_and_dequantize``)."""

    __slots__ = ("absmax_and_decode", "decode", "gemm", "kwargs", "out_dtype", "quantize", "w")

    def __init__(self, w: Any, kwargs: dict, out_dtype: torch.dtype, m: int) -> None:
        from ..kernels.blockscaled import absmax_and_dequantize, dequantize_call, quantize_nvfp4_decoded
        from ..kernels.scaled_mm_routes import dequant_chunk_rows, dequant_mm_decoded, without_global

        self.w, self.kwargs, self.out_dtype = w, kwargs, out_dtype
        self.quantize, self.gemm = quantize_nvfp4_decoded, dequant_mm_decoded
        self.absmax_and_decode = self.decode = None
        plain = without_global(w)[0]
        if kwargs.get("global_scale") is None and dequant_chunk_rows(m, w.shape[1], plain, False) == w.shape[0]:
            # the weight's decode call made here, once (the runner is made outside CUDA-graph captures)
            self.absmax_and_decode, self.decode = absmax_and_dequantize, dequantize_call(plain, torch.bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.absmax_and_decode is not None:
            amax, w_decoded = self.absmax_and_decode(x, self.decode)
            values, global_scale = self.quantize(x, **self.kwargs, amax=amax)
            return self.gemm(values, global_scale, self.w, None, bias, self.out_dtype, w_decoded)
        values, global_scale = self.quantize(x, **self.kwargs)
        return self.gemm(values, global_scale, self.w, None, bias, self.out_dtype)
