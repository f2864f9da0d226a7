"""``ColwiseParallel`` / ``RowwiseParallel`` that also take lowbit ``QuantLinear`` layers.

They are torch's ``torch.distributed.tensor.parallel`` styles (same arguments, and ``nn.Linear`` /
``nn.Embedding`` are handed to torch's own implementation), so a plan may mix quantized and dense layers and
be given to ``torch.distributed.tensor.parallel.parallelize_module`` unchanged. A ``QuantLinear`` becomes this
rank's :class:`~lowbit.parallel.layers.ColwiseQuantLinear` / :class:`~lowbit.parallel.layers.RowwiseQuantLinear`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwiseParallel

from ..nn.modules import QuantLinear
from .layers import parallelize_quant_linear


class ColwiseParallel(TorchColwiseParallel):
    """torch's ``ColwiseParallel``; a ``QuantLinear`` is split along its output features (N).

    Args (besides torch's): exact: plan each shard's kernel launches as the whole layer's, so that its outputs
    equal the one-GPU layer's bit for bit (``lowbit.parallel.parallelize_quant_linear``).
    """

    def __init__(self, *, exact: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.exact = bool(exact)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if isinstance(module, QuantLinear):
            return parallelize_quant_linear(module, device_mesh, "colwise", input_layouts=self.input_layouts,
                                            output_layouts=self.output_layouts,
                                            use_local_output=self.use_local_output, exact=self.exact)
        return super()._apply(module, device_mesh)


class RowwiseParallel(TorchRowwiseParallel):
    """torch's ``RowwiseParallel``; a ``QuantLinear`` is split along its input features (K) and its outputs are
    summed across ranks before the bias and activation.

    Args (besides torch's): all_reduce: ``"nccl"`` (default) or ``"symm_mem"`` (:mod:`lowbit.parallel.collectives`).
    """

    def __init__(self, *, all_reduce: str = "nccl", **kwargs) -> None:
        super().__init__(**kwargs)
        from .collectives import ALL_REDUCES

        if all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {ALL_REDUCES}, got {all_reduce!r}")
        self.all_reduce = all_reduce

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if isinstance(module, QuantLinear):
            return parallelize_quant_linear(module, device_mesh, "rowwise", input_layouts=self.input_layouts,
                                            output_layouts=self.output_layouts,
                                            use_local_output=self.use_local_output, all_reduce=self.all_reduce)
        return super()._apply(module, device_mesh)


__all__ = ["ColwiseParallel", "RowwiseParallel"]
