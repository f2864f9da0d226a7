"""Tensor-level interop: pure layout transforms between lowbit QTensors and other producers' tensors.

No model code here; each converter validates names, dtypes and shapes and raises ValueError/TypeError.
"""

from .awq import from_autoawq, to_autoawq
from .bnb import from_bnb_state_dict, to_bnb_state_dict
from .compressed_tensors import from_compressed_tensors, to_compressed_tensors
from .convert import convert_checkpoint
from .deepseek import deepseek_quantization_config, from_deepseek_fp8, to_deepseek_fp8
from .gptq import from_gptq, to_gptq
from .inspection import inspect_checkpoint
from .load import load_quantized
from .modelopt import from_modelopt_nvfp4, to_modelopt_nvfp4
from .save import save_quantized

__all__ = [
    "convert_checkpoint", "deepseek_quantization_config", "from_autoawq", "from_bnb_state_dict", "from_compressed_tensors",
    "from_deepseek_fp8", "from_gptq", "from_modelopt_nvfp4", "inspect_checkpoint", "load_quantized", "save_quantized", "to_autoawq",
    "to_bnb_state_dict", "to_compressed_tensors", "to_deepseek_fp8", "to_gptq", "to_modelopt_nvfp4",
]
