"""``lowbit quantize``: convert a model with each scheme, then measure what quality each one lost.

For every scheme: the source directory is converted tensor by tensor (:func:`lowbit.convert_checkpoint`), or
with ``calib > 0`` quantized in memory by :func:`lowbit.quantize_model` on that many calibration sentences
(static NVFP4 activation scales for ``w4a4-nvfp4``, the AWQ scale search for ``w4a16-int4``) and written by
:func:`lowbit.save_quantized`; the checkpoint is loaded back with :func:`lowbit.load_quantized` (so the
report measures the files, not an in-memory model), and its sentence
embeddings and per-layer outputs are compared with the fp32 original on the built-in sentences
(:mod:`lowbit.eval.metrics`). The report goes to ``out_dir/report.{txt,json,png}``.

The exception: a model that ``algorithm`` leaves with online input transforms (``SmoothQuant(online=True)``,
rotations not folded into weights) has no checkpoint form; it is measured in memory, and its report row says
so.
"""

from __future__ import annotations

import copy
import datetime
import json
import platform
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..algorithms.pipeline import describe, label, names_of, resolve, without_transforms
from ..algorithms.rotation import online_transform_layers
from .checkpoint_info import inspect_checkpoint
from .data import load_sentences
from .encoder import BUNDLED_NAME, ModelDirError, SentenceEncoder, bundled_model_dir, check_model_dir
from .metrics import LayerErrors, cosine_stats, retrieval_agreement, topic_accuracy
from .outdir import OutDir
from .report import format_table, plot_png, report_json

ISOLATED_BATCHES: int | None = None
"""Batches (of the length-sorted sentences) on which each quantized layer is also run on the fp32 layer's
input (None: all)."""


def resolve_schemes(spec: str | Sequence[str]) -> list[str]:
    """``"all"``, one name, a comma-separated list or a sequence -> scheme names; ValueError naming the
    unknown ones and the known schemes."""
    from ..nn import SCHEMES

    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError(f"no scheme given; known schemes: all, {', '.join(SCHEMES)}")
    if names == ["all"]:
        return list(SCHEMES)
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        raise ValueError(
            f"unknown scheme {', '.join(map(repr, unknown))}; known schemes: all, {', '.join(SCHEMES)}"
        )
    return list(dict.fromkeys(names))


def default_out_dir(model_name: str) -> Path:
    return Path("lowbit-out") / model_name


def _device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ModelDirError(f"bad --device {device!r}: {e}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ModelDirError(
            f"--device {device}: CUDA is not available here (torch.cuda.is_available() is False)"
        )
    return d


def _git_sha() -> str:
    try:
        from ..bench.envinfo import git_sha

        return git_sha()
    except Exception:  # noqa: BLE001
        return "unknown"


def evaluate(
    ref: torch.nn.Module,
    quant: torch.nn.Module,
    encoder: SentenceEncoder,
    batches: list,
    topics: Sequence[str],
    *,
    device: torch.device,
    isolated_batches: int | None = ISOLATED_BATCHES,
    layer_ref: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Metrics of ``quant`` against ``ref`` on the tokenized ``batches`` (see :mod:`lowbit.eval.metrics`).

    ``layer_ref``: the float model the per-layer errors are measured against instead of ``ref`` (the same
    function with the input transforms of the quantization algorithm applied, so that each layer's float
    output is what its quantized twin approximates); the embeddings are still compared with ``ref``, and
    ``transform_cos_min`` says how far ``layer_ref``'s embeddings are from ``ref``'s (float rounding only).
    """
    lref = ref if layer_ref is None else layer_ref
    errors = LayerErrors(lref, quant)
    if not errors.names:
        raise ValueError("the quantized model has no quantized Linear layer matching the fp32 model's")
    n = sum(len(idx) for idx, _ in batches)
    r_emb = torch.empty(n, 0)
    q_emb = torch.empty(n, 0)
    t_emb = torch.empty(n, 0)
    for b, (idx, enc) in enumerate(batches):
        enc = encoder.to_device(enc, device)
        r_out, q_out = errors.run(lref, quant, enc, isolated=isolated_batches is None or b < isolated_batches)
        if layer_ref is not None:
            with torch.inference_mode():
                t = encoder.pool(r_out, enc["attention_mask"]).float().cpu()
                r_out = ref(**enc)
        r = encoder.pool(r_out, enc["attention_mask"]).float().cpu()
        q = encoder.pool(q_out, enc["attention_mask"]).float().cpu()
        if r_emb.shape[1] == 0:
            r_emb, q_emb = torch.empty(n, r.shape[1]), torch.empty(n, q.shape[1])
            if layer_ref is not None:
                t_emb = torch.empty(n, r.shape[1])
        r_emb[idx], q_emb[idx] = r, q
        if layer_ref is not None:
            t_emb[idx] = t
    if not torch.isfinite(r_emb).all():
        raise ValueError("the fp32 source model produced non-finite embeddings (NaN/Inf in the source)")
    if not torch.isfinite(q_emb).all():
        raise ValueError("the quantized model produced non-finite embeddings")
    out = {
        "cosine": cosine_stats(r_emb, q_emb),
        "retrieval": retrieval_agreement(r_emb, q_emb, k=5),
        "topic_top1": topic_accuracy(q_emb, topics),
        "layers": errors.results(),
    }
    if layer_ref is not None:
        out["transform_cos_min"] = cosine_stats(r_emb, t_emb)["min"]
    return out


def run(
    model_dir: str | Path | None = None,
    schemes: str | Sequence[str] = "all",
    out_dir: str | Path | None = None,
    *,
    calib: int | None = None,
    calib_file: str | Path | None = None,
    algorithm: Any = "rtn",
    device: str | None = None,
    log: Callable[[str], None] | None = print,
    convert_progress: bool = False,
    plot: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert ``model_dir`` (None: the bundled all-MiniLM-L6-v2) with each scheme into ``out_dir/<scheme>``,
    evaluate each checkpoint against the fp32 model, write ``out_dir/report.{txt,json,png}`` and return the
    report dict (``report["schemes"][i]["status"]`` is ``"ok"`` or ``"error"`` with ``"error"``).

    ``calib`` sentences (the built-in calibration set, disjoint from the evaluation sentences, or the first
    ``calib`` non-empty lines of ``calib_file``; None: 0, or all of them when ``algorithm`` holds ``"gptq"``
    or ``"smoothquant"``) drive :func:`lowbit.quantize_model` with ``algorithm`` (``"rtn"``, ``"gptq"``,
    ``"smoothquant"``, ``"rotate"``, their options objects or a combination, see
    :mod:`lowbit.algorithms.pipeline`). Smoothing and rotation apply to the schemes that quantize
    activations; weight-only schemes run the rest of ``algorithm`` (each report row names what ran). A model
    left with online input transforms (online smoothing, rotations not folded) is written in lowbit's native
    layout, the one that stores them, and its row says so.

    ``out_dir`` must lie outside ``model_dir``; outputs of an earlier run there are replaced only with
    ``overwrite``, anything else there never (:mod:`lowbit.eval.outdir`).

    Raises:
        ModelDirError: missing/unusable/already quantized model directory, a config.json that does not match
            its safetensors headers, a source whose fp32 embeddings are not finite, bad device, or an output
            path that is inside the source, not ours, or ours without ``overwrite``.
        ValueError: unknown scheme, bad ``calib``.
    """
    from .. import convert_checkpoint, load_quantized, quantize_model, save_quantized
    from ..nn import get_scheme
    from ..nn.quantize import transform_model

    say = log or (lambda s: None)
    names = resolve_schemes(schemes)
    evalset = load_sentences()
    calib_sentences = calibration_sentences(evalset, calib, calib_file, algorithm)
    if model_dir is None:
        src = bundled_model_dir()
        model_name = BUNDLED_NAME
    else:
        src = check_model_dir(model_dir)
        model_name = src.resolve().name
    out = Path(out_dir) if out_dir is not None else default_out_dir(model_name)
    target = OutDir(out, src, names, overwrite=overwrite)
    ckpts = target.ckpts
    dev = _device(device)

    t0 = time.perf_counter()
    src_info = _check_source(src)
    encoder = SentenceEncoder(src)
    batches = encoder.batches(evalset.sentences)
    topics = [evalset.topics[i] for i in range(len(evalset.sentences))]
    # one token length per batch: padded positions would enter GPTQ's Hessians and the activation ranges
    calib_batches = ([enc for _, enc in encoder.batches(calib_sentences, same_length=True)]
                     if calib_sentences else None)
    ref = encoder.load_fp32(dev)
    ref_emb = encoder.embed(ref, batches, dev)
    if not torch.isfinite(ref_emb).all():
        raise ModelDirError(
            f"{src}: the fp32 source model itself produces non-finite embeddings (NaN/Inf in its weights?); "
            "no scheme can be measured against it"
        )
    n_tokens = int(sum(enc["attention_mask"].sum().item() for _, enc in batches))
    say(
        f"lowbit quantize: {model_name} ({src}), {len(evalset.sentences)} sentences / {n_tokens} tokens, "
        f"{len(names)} scheme(s), device {dev}, output {out}"
    )
    target.create()
    report: dict[str, Any] = {
        "model": model_name,
        "model_dir": str(src),
        "out_dir": str(out),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lowbit": _lowbit_version(),
        "git": _git_sha(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(dev),
        "n_sentences": len(evalset.sentences),
        "n_tokens": n_tokens,
        "calibration_sentences": len(calib_sentences),
        "calibration_source": str(calib_file) if calib_file is not None else "built-in calibration set",
        "algorithm": describe(algorithm),
        "isolated_sqnr_batches": ISOLATED_BATCHES if ISOLATED_BATCHES is not None else len(batches),
        "fp32": {
            "bytes": src_info["total_bytes"],
            "topic_top1": topic_accuracy(ref_emb, topics),
        },
        "schemes": [],
    }

    for i, name in enumerate(names, 1):
        scheme = get_scheme(name)
        # smoothing and rotation act on quantized activations: weight-only schemes run the rest
        alg = algorithm if scheme.act_format is not None else without_transforms(algorithm)
        entry: dict[str, Any] = {
            "scheme": name,
            "description": scheme.description,
            "weight_format": scheme.weight_format,
            "act_format": scheme.act_format,
            "checkpoint": str(ckpts[name]),
            "algorithm": describe(alg),
            "algorithm_label": label(alg),
        }
        t = time.perf_counter()
        layer_ref = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                transforms = resolve(alg, None, calib_batches or None).transforms
                if calib_batches or transforms:
                    # calibration data: the library decides what it drives (static NVFP4 activation scales
                    # for w4a4-nvfp4, the AWQ scale search for w4a16-int4; ignored by the others)
                    model = encoder.load_fp32(dev)
                    if transforms:
                        # the float model with smoothing/rotation applied is what each quantized layer is
                        # compared with; the quantized model starts from a copy of it
                        layer_ref = transform_model(model, scheme, algorithm=alg, calibration=calib_batches or None)
                        model = copy.deepcopy(layer_ref)
                        quantize_model(model, scheme, calibration=calib_batches or None,
                                       algorithm=without_transforms(alg))
                    else:
                        quantize_model(model, scheme, calibration=calib_batches, algorithm=alg)
                    how = (f"quantize_model(calibration={len(calib_sentences)} sentences, "
                           f"algorithm={describe(alg)!r})")
                    online = online_transform_layers(model)
                    if online:
                        # only lowbit's native layout stores online input transforms ("auto" picks it)
                        entry["online_transform_layers"] = len(online)
                    save_quantized(model, ckpts[name], source_dir=src, overwrite=target.replace[name])
                    target.record_checkpoint(name)
                    entry["method"] = f"{how} + save_quantized" + (
                        f" (lowbit-native: {len(online)} layers transform their input online)" if online else "")
                    del model
                else:
                    convert_checkpoint(
                        src,
                        ckpts[name],
                        scheme,
                        device=dev,
                        progress=convert_progress,
                        overwrite=target.replace[name],
                    )
                    target.record_checkpoint(name)
                    entry["method"] = "convert_checkpoint"
                t_convert = time.perf_counter() - t
                t = time.perf_counter()
                quant = load_quantized(ckpts[name], device=dev)
                metrics = evaluate(ref, quant, encoder, batches, topics, device=dev, layer_ref=layer_ref)
                del quant, layer_ref
            entry["warnings"] = sorted({str(w.message) for w in caught if "lowbit" in str(w.message)})
            info = inspect_checkpoint(ckpts[name])
            entry.update(
                status="ok",
                producer=info["producer"],
                bytes=info["total_bytes"],
                quantized_layers=info["quantized_layers"],
                bits_per_weight=info["quantized_bits_per_weight"],
                ratio_vs_fp32=src_info["total_bytes"] / info["total_bytes"],
                **metrics,
                time_s={"convert": t_convert, "eval": time.perf_counter() - t},
            )
            net = [x["sqnr_db"] for x in metrics["layers"]]
            say(
                f"[{i}/{len(names)}] {name:15} cos {metrics['cosine']['mean']:.4f} (min {metrics['cosine']['min']:.4f})"
                f"  NN@1 {metrics['retrieval']['top1']:.3f}  layer SQNR min {min(net):.1f} dB  "
                f"({t_convert:.1f} s convert, {entry['time_s']['eval']:.1f} s eval)"
            )
        except Exception as e:  # noqa: BLE001 - one failing scheme must not hide the others
            entry.update(status="error", error=f"{type(e).__name__}: {e}")
            say(f"[{i}/{len(names)}] {name:15} FAILED: {entry['error']}")
        report["schemes"].append(entry)

    report["total_time_s"] = time.perf_counter() - t0
    files = {"txt": out / "report.txt", "json": out / "report.json", "png": out / "report.png"}
    report["files"] = {k: str(v) for k, v in files.items()}
    table = format_table(report)
    report["table"] = table
    # each report file goes to a temp name first and is renamed into place: a run killed mid-write leaves
    # the previous file whole
    tmp_png = out / ".report.lowbit-tmp.png"
    why_no_png = plot_png(report, tmp_png) if plot else "disabled"
    if why_no_png is None:
        target.adopt_file("report.png", tmp_png)
    else:
        report["files"]["png"] = None
        report["png_skipped"] = why_no_png
    target.write_file("report.txt", (table + "\n").encode())
    target.write_file("report.json", report_json(report).encode())
    return report


EVAL_ALGORITHMS = ("rtn", "gptq", "smoothquant", "rotate")
"""The algorithms ``lowbit quantize`` runs (``awq`` is the w4a16-int4 default with calibration data)."""


def calibration_sentences(evalset: Any, calib: int | None, calib_file: str | Path | None,
                          algorithm: Any) -> list[str]:
    """The calibration sentences of a run (see :func:`run`); ValueError for a bad count, file or algorithm."""
    names = names_of(algorithm)
    bad = [n for n in names if n not in EVAL_ALGORITHMS]
    if bad:
        raise ValueError(f"algorithm must combine {', '.join(EVAL_ALGORITHMS)}; got {', '.join(map(repr, bad))}")
    resolve(algorithm, None, [])  # repeated or contradicting names (the calibration check comes below)
    needs = [n for n in names if n in ("gptq", "smoothquant")]
    if calib is not None and (isinstance(calib, bool) or not isinstance(calib, int)):
        raise TypeError(f"calib must be an int, got {type(calib).__name__}")
    if calib_file is None:
        n = calib if calib is not None else (len(evalset.calibration) if needs else 0)
        sentences = evalset.calibration_sentences(n)
    else:
        try:
            lines = Path(calib_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--calib-file {calib_file}: not a readable UTF-8 text file ({e})") from None
        lines = [line.strip() for line in lines if line.strip()]
        if not lines:
            raise ValueError(f"--calib-file {calib_file}: holds no non-empty line")
        if calib is not None and calib < 0:
            raise ValueError(f"--calib must not be negative, got {calib}")
        sentences = lines if calib is None else lines[:calib]
    if needs and not sentences:
        raise ValueError(f"--algorithm {needs[0]} needs calibration sentences (--calib N > 0 or --calib-file)")
    return sentences


def _check_source(src: Path) -> dict[str, Any]:
    """Everything about the source that can fail, checked before the model is loaded: config.json an object
    with no quantization_config (an already quantized model is not a source), no quantized tensors, and the
    config's model (built on the meta device) matching the safetensors headers. Returns its inspect info."""
    from ..io.convert import check_source

    cfg_path = src / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelDirError(f"{cfg_path}: not a readable JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelDirError(f"{cfg_path}: must hold a JSON object, got {type(cfg).__name__}")
    qc = cfg.get("quantization_config")
    if qc is None and (src / "hf_quant_config.json").exists():
        qc = {"quant_method": "modelopt"}
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelDirError(
            f"{src} is already quantized (quantization_config {method!r:.40}); lowbit quantize needs the "
            "unquantized model it came from"
        )
    info = inspect_checkpoint(src)
    if info["quantized_layers"]:
        raise ModelDirError(
            f"{src} is already quantized ({info['quantized_layers']} layers in {', '.join(info['formats'])}, "
            "from the tensor names); lowbit quantize needs the unquantized model it came from"
        )
    try:
        check_source(src)
    except ValueError as e:
        raise ModelDirError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a config it cannot build
        raise ModelDirError(f"{cfg_path}: transformers cannot build the model ({type(e).__name__}: {e})") from None
    return info


def _lowbit_version() -> str:
    from .. import __version__

    return __version__
