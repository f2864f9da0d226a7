"""bitsandbytes 4-bit checkpoint layout (``Linear4bit`` state dict / ``QuantState.as_dict(packed=True)``).

Pure layout transforms between an nf4 or bnb_fp4 :class:`~lowbit.formats.qtensor.QTensor` and the tensors
bitsandbytes 0.50.2 writes under a weight's key (formats.md section 4); ``<type>`` is bitsandbytes'
``quant_type``, ``nf4`` for lowbit's nf4 and ``fp4`` for bnb_fp4:

=====================================  ===================================================================
key                                    tensor
=====================================  ===================================================================
``{prefix}``                           uint8 ``[ceil(n/2), 1]`` packed codes (element 2i in the high nibble)
``{prefix}.absmax``                    fp32 ``[nblocks]``, or uint8 ``[nblocks]`` with double quantization
``{prefix}.quant_map``                 fp32 ``[16]`` NF4 / FP4 levels (``get_4bit_type(<type>)``)
``{prefix}.nested_absmax``             fp32 ``[ceil(nblocks/256)]`` (double quantization only)
``{prefix}.nested_quant_map``          fp32 ``[256]`` dynamic map (double quantization only)
``{prefix}.quant_state.bitsandbytes__<type>``  uint8 bytes of the UTF-8 JSON of the non-tensor fields
=====================================  ===================================================================

The JSON is ``json.dumps`` (default separators) of ``{"quant_type", "blocksize", "dtype", "shape"}`` and, with
double quantization, ``"nested_blocksize", "nested_dtype", "nested_offset"`` in that order; ``dtype`` is
the torch dtype name without ``torch.``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from ..formats.codecs import codebook_table
from ..formats.nf4 import BLOCKSIZES, BNB_4BIT_FORMATS, NESTED_BLOCKSIZE, check_bnb4_qtensor, dynamic_map
from ..formats.qtensor import QTensor

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_QS_PREFIX = "quant_state.bitsandbytes__"
_BASE_FIELDS = ("quant_type", "blocksize", "dtype", "shape")
_NESTED_FIELDS = ("nested_blocksize", "nested_dtype", "nested_offset")
# lowbit format <-> bitsandbytes quant_type
_QUANT_TYPES = {"nf4": "nf4", "bnb_fp4": "fp4"}
_FORMATS_BY_TYPE = {v: k for k, v in _QUANT_TYPES.items()}


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if not prefix or prefix.endswith("."):
        raise ValueError(f"prefix must be a non-empty key that does not end with '.', got {prefix!r}")


def to_bnb_state_dict(q: QTensor, prefix: str = "weight") -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes saves for an NF4 or FP4 ``Linear4bit`` weight, byte for byte.

    Args:
        q: nf4 or bnb_fp4 QTensor (from ``lowbit.quantize(x, "nf4" / "bnb_fp4", ...)``), ``n`` elements,
            ``nblocks`` blocks.
        prefix: the weight's key, e.g. ``"model.layers.0.mlp.down_proj.weight"``.

    Returns:
        Ordered dict (bitsandbytes' key order): ``{prefix}`` uint8 ``[ceil(n/2), 1]``, ``{prefix}.absmax``,
        ``{prefix}.quant_map`` fp32 ``[16]``, with double quantization ``{prefix}.nested_absmax`` fp32
        ``[ceil(nblocks/256)]`` and ``{prefix}.nested_quant_map`` fp32 ``[256]``, then
        ``{prefix}.quant_state.bitsandbytes__nf4`` (bnb_fp4: ``__fp4``) uint8 JSON bytes. Tensors are copies.
    """
    _check_prefix(prefix)
    _, blocksize, nested = check_bnb4_qtensor(q)
    quant_type = _QUANT_TYPES[q.fmt]
    if q.dtype not in _DTYPE_NAMES:
        raise ValueError(f"q.dtype must be float32, bfloat16 or float16, got {q.dtype}")
    dev = q.device
    out = {
        prefix: q.data.reshape(-1, 1).clone(),
        f"{prefix}.absmax": q.scale.reshape(-1).clone(),
        f"{prefix}.quant_map": codebook_table(BNB_4BIT_FORMATS[q.fmt]).to(dev).clone(),
    }
    meta: dict[str, object] = {
        "quant_type": quant_type,
        "blocksize": blocksize,
        "dtype": _DTYPE_NAMES[q.dtype],
        "shape": list(q.shape),
    }
    if nested:
        out[f"{prefix}.nested_absmax"] = q.nested_scale.reshape(-1).clone()
        out[f"{prefix}.nested_quant_map"] = dynamic_map(dev)
        meta.update(
            nested_blocksize=NESTED_BLOCKSIZE,
            nested_dtype="float32",
            nested_offset=q.nested_offset.reshape(()).item(),
        )
    raw = json.dumps(meta).encode("utf-8")
    out[f"{prefix}.{_QS_PREFIX}{quant_type}"] = torch.tensor(list(raw), dtype=torch.uint8, device=dev)
    return out


def _parse_meta(blob: torch.Tensor, key: str) -> dict:
    if not isinstance(blob, torch.Tensor):
        raise TypeError(f"{key} must be a torch.Tensor, got {type(blob).__name__}")
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"{key} must be a 1-D uint8 tensor of UTF-8 JSON bytes, got {_describe(blob)}")
    try:
        meta = json.loads(bytes(blob.cpu().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{key} does not hold valid UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict):
        # malformed checkpoint content, not a wrong Python argument type
        raise ValueError(f"{key} must hold a JSON object, got {type(meta).__name__}")  # noqa: TRY004
    return meta


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)}"
    return type(t).__name__


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_meta(
    meta: dict, nested: bool, key: str, quant_type: str
) -> tuple[int, torch.dtype, torch.Size, float | None]:
    fields = _BASE_FIELDS + (_NESTED_FIELDS if nested else ())
    missing = [f for f in fields if f not in meta]
    extra = sorted(set(meta) - set(fields))
    if missing or extra:
        why = "nested_absmax is present" if nested else "there is no nested_absmax"
        raise ValueError(
            f"{key}: JSON must have exactly the fields {list(fields)} ({why}); "
            f"missing {missing}, unexpected {extra}"
        )
    if meta["quant_type"] != quant_type:
        # the key names the type too; they must agree
        raise ValueError(f"{key}: quant_type must be {quant_type!r} (the key's), got {meta['quant_type']!r}")
    blocksize = meta["blocksize"]
    if not _is_int(blocksize) or blocksize not in BLOCKSIZES:
        raise ValueError(f"{key}: blocksize must be one of {BLOCKSIZES}, got {blocksize!r}")
    if meta["dtype"] not in _NAME_DTYPES:
        raise ValueError(f"{key}: dtype must be one of {sorted(_NAME_DTYPES)}, got {meta['dtype']!r}")
    shape = meta["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{key}: shape must be a list of non-negative ints, got {shape!r}")
    offset = None
    if nested:
        if meta["nested_blocksize"] != NESTED_BLOCKSIZE or not _is_int(meta["nested_blocksize"]):
            raise ValueError(
                f"{key}: nested_blocksize must be {NESTED_BLOCKSIZE}, got {meta['nested_blocksize']!r}"
            )
        if meta["nested_dtype"] != "float32":
            raise ValueError(f"{key}: nested_dtype must be 'float32', got {meta['nested_dtype']!r}")
        offset = meta["nested_offset"]
        if not isinstance(offset, (int, float)) or isinstance(offset, bool):
            raise ValueError(f"{key}: nested_offset must be a number, got {offset!r}")
    return blocksize, _NAME_DTYPES[meta["dtype"]], torch.Size(shape), offset


def _expect(tensors: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    t = tensors[key]
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"{key} must be {dtype} [{numel}], got {_describe(t)}")
    return t


def from_bnb_state_dict(tensors: Mapping[str, torch.Tensor], prefix: str = "weight") -> QTensor:
    """Read the bitsandbytes NF4 or FP4 tensors of one weight back into an nf4 or bnb_fp4 QTensor.

    The logical shape comes from the JSON, so it is right even where bitsandbytes' own
    ``dequantize_4bit`` returns another shape (``[1, n]`` for a 1-D weight, the transpose when the packed
    weight has a single byte row, e.g. shapes ``[1, 2]`` or ``[2, 1]``).

    Args:
        tensors: a state dict (other weights' keys are ignored); the packed weight ``{prefix}`` may use a
            non-uint8 ``quant_storage`` dtype (it is read as its bytes).
        prefix: the weight's key.

    Returns:
        nf4 (``bitsandbytes__nf4``) or bnb_fp4 (``bitsandbytes__fp4``) QTensor equal to the one
        :func:`to_bnb_state_dict` was given (copies of the tensors).

    Raises:
        ValueError: a key is missing or unexpected, a tensor has the wrong dtype/shape, the JSON is malformed,
            the quant type is neither nf4 nor fp4, or the quant maps are not bitsandbytes' standard NF4 / FP4
            table and dynamic map.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a Mapping[str, Tensor], got {type(tensors).__name__}")
    _check_prefix(prefix)
    sub = {k[len(prefix) + 1 :]: k for k in tensors if isinstance(k, str) and k.startswith(prefix + ".")}
    qs_keys = [s for s in sub if s.startswith(_QS_PREFIX)]
    if prefix not in tensors:
        raise ValueError(f"missing the packed weight {prefix!r}")
    if len(qs_keys) != 1:
        raise ValueError(
            f"expected exactly one '{prefix}.{_QS_PREFIX}<type>' key, found {[sub[s] for s in qs_keys]}"
        )
    qs_key = sub[qs_keys[0]]
    quant_type = qs_keys[0][len(_QS_PREFIX) :]
    if quant_type not in _FORMATS_BY_TYPE:
        raise ValueError(
            f"{qs_key}: quant_type must be one of {sorted(_FORMATS_BY_TYPE)} (bitsandbytes 4-bit), got {quant_type!r}"
        )
    fmt = _FORMATS_BY_TYPE[quant_type]
    nested = "nested_absmax" in sub
    allowed = {"absmax", "quant_map", qs_keys[0]} | (
        {"nested_absmax", "nested_quant_map"} if nested else set()
    )
    missing = sorted(allowed - set(sub))
    unexpected = sorted(set(sub) - allowed)
    if missing or unexpected:
        raise ValueError(
            f"bitsandbytes keys under {prefix!r}: missing {[f'{prefix}.{m}' for m in missing]}, "
            f"unexpected {[sub[u] for u in unexpected]}"
        )

    blocksize, dtype, shape, offset = _check_meta(_parse_meta(tensors[qs_key], qs_key), nested, qs_key, quant_type)
    n = shape.numel()
    nbytes = -(-n // 2)
    nblocks = -(-n // blocksize)

    packed = tensors[prefix]
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.shape[1] != 1:
        raise ValueError(f"{prefix} must be a packed weight of shape [k, 1], got {_describe(packed)}")
    data = packed.detach().reshape(-1).contiguous().view(torch.uint8)
    if data.numel() != nbytes:
        raise ValueError(
            f"{prefix} must hold ceil({n}/2) = {nbytes} bytes for shape {list(shape)}, "
            f"got {data.numel()} ({_describe(packed)})"
        )

    quant_map = _expect(tensors, f"{prefix}.quant_map", torch.float32, 16)
    # bitwise: FP4's code 8 is +0.0 in bitsandbytes' table, and a -0.0 there would be another map
    table = codebook_table(BNB_4BIT_FORMATS[fmt])
    if not torch.equal(quant_map.detach().cpu().view(torch.int32), table.view(torch.int32)):
        raise ValueError(
            f"{prefix}.quant_map is not the standard {quant_type.upper()} table; lowbit cannot represent a custom map"
        )
    scale = _expect(tensors, f"{prefix}.absmax", torch.uint8 if nested else torch.float32, nblocks)
    params = {"blocksize": blocksize, "double_quant": nested}
    nested_scale = nested_offset = None
    if nested:
        nested_map = _expect(tensors, f"{prefix}.nested_quant_map", torch.float32, 256)
        if not torch.equal(nested_map.detach().cpu(), dynamic_map()):
            raise ValueError(
                f"{prefix}.nested_quant_map is not bitsandbytes' default signed dynamic map; "
                "lowbit cannot represent a custom map"
            )
        n_nested = -(-nblocks // NESTED_BLOCKSIZE)
        nested_scale = _expect(tensors, f"{prefix}.nested_absmax", torch.float32, n_nested).detach().clone()
        # bitsandbytes rounds the JSON number to fp32 the same way (QuantState.from_dict)
        nested_offset = torch.tensor(float(offset), dtype=torch.float32, device=scale.device)
    return QTensor(
        data=data.clone(),
        scale=scale.detach().clone(),
        fmt=fmt,
        shape=shape,
        dtype=dtype,
        params=params,
        nested_scale=nested_scale,
        nested_offset=nested_offset,
    )


__all__ = ["from_bnb_state_dict", "to_bnb_state_dict"]
