"""What a results file must name (GPU, driver, CUDA, torch, triton, lowbit, git sha) and ``lowbit env``.

Reads versions and asks CUDA only when called; safe on a CPU-only machine.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

OPTIONAL_PACKAGES = ("triton", "torchao", "bitsandbytes")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _repo_root() -> Path:
    # src/lowbit/bench/envinfo.py -> the checkout root (when lowbit runs from a source tree)
    return Path(__file__).resolve().parents[3]


def git_sha() -> str:
    """``$GIT_SHA`` if set (the GPU machine has no git), else ``git rev-parse --short HEAD``, else
    ``.git/HEAD``
    read by hand, else ``"unknown"``."""
    env = os.environ.get("GIT_SHA", "").strip()
    if env:
        return env
    root = _repo_root()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        head = (root / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = root / ".git" / head[5:]
            if ref.exists():
                return ref.read_text().strip()[:7]
        elif head:
            return head[:7]
    except OSError:
        pass
    return "unknown"


def driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def gpu_info() -> dict[str, Any]:
    """``{"cuda_available": bool, "gpu": name | None, ...}`` for device 0."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda_available": False, "gpu": None}
    p = torch.cuda.get_device_properties(0)
    return {
        "cuda_available": True,
        "gpu": p.name,
        "gpu_count": torch.cuda.device_count(),
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "memory_GiB": round(p.total_memory / 2**30, 1),
        "l2_MB": round(getattr(p, "L2_cache_size", 0) / 1e6, 1) or None,
    }


def header() -> dict[str, Any]:
    """The results header: date, GPU, driver, CUDA, torch, triton, lowbit version, git sha and more."""
    import torch

    import lowbit

    now = datetime.datetime.now(datetime.timezone.utc)
    info = gpu_info()
    return {
        "date": now.date().isoformat(),
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": info.get("gpu"),
        "capability": info.get("capability"),
        "sm_count": info.get("sm_count"),
        "driver": driver_version() if info["cuda_available"] else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "lowbit": lowbit.__version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torchao": _version("torchao"),
        "bitsandbytes": _version("bitsandbytes"),
    }


def backends() -> dict[str, str]:
    """Backend -> ``"yes"`` or why it cannot run here."""
    import torch

    from lowbit.kernels import triton_available

    reason = triton_available()
    if reason is None and not torch.cuda.is_available():
        reason = "no CUDA device (triton kernels need CUDA tensors)"
    return {"torch": "yes", "triton": "yes" if reason is None else reason}


def kernel_table() -> dict[str, dict[str, str]]:
    """Format -> {"quantize": ..., "dequantize": ...}: ``"kernel"`` or the kernel table's reason for none."""
    import types

    import torch

    from lowbit import kernels
    from lowbit.formats import FORMATS

    table = {}
    for fmt in FORMATS:
        q = kernels.quantize_kernel(fmt, {})
        # a QTensor of the format's defaults as far as the table's predicates look (no params, fp16 scales)
        d = kernels.dequantize_kernel(fmt, types.SimpleNamespace(params={}, scale=torch.empty(0, dtype=torch.float16)))
        table[fmt] = {
            "quantize": q if isinstance(q, str) else "kernel",
            "dequantize": d if isinstance(d, str) else "kernel",
        }
    return table


def env_info() -> dict[str, Any]:
    """Everything ``lowbit env`` prints."""
    import torch

    import lowbit

    info = gpu_info()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "lowbit": lowbit.__version__,
        "lowbit_path": str(Path(lowbit.__file__).parent),
        "packages": {p: _version(p) for p in OPTIONAL_PACKAGES},
        **info,
        "driver": driver_version() if info["cuda_available"] else None,
        "backends": backends(),
        "kernels": kernel_table(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("LOWBIT_")},
        "git_sha": git_sha(),
    }


def format_env(info: dict[str, Any]) -> str:
    lines = [
        f"python   {info['python']}  ({info['platform']})",
        f"torch    {info['torch']}  (CUDA {info['torch_cuda']})",
        f"lowbit   {info['lowbit']}  ({info['lowbit_path']}, git {info['git_sha']})",
    ]
    lines += [f"{name:8} {ver or 'not installed'}" for name, ver in info["packages"].items()]
    if info["cuda_available"]:
        lines.append(
            f"GPU      {info['gpu']} x{info['gpu_count']} (sm_{info['capability'].replace('.', '')}, "
            f"{info['sm_count']} SMs, {info['memory_GiB']} GiB), driver {info['driver']}"
        )
    else:
        lines.append("GPU      none (torch.cuda.is_available() is False)")
    lines.append("backends " + ", ".join(f"{b}: {s}" for b, s in info["backends"].items()))
    lines.append("kernels  (triton; format: quantize / dequantize)")
    for fmt, k in info["kernels"].items():
        lines.append(f"  {fmt:12} {k['quantize']} / {k['dequantize']}")
    if info["env"]:
        lines += ["LOWBIT_* " + ", ".join(f"{k}={v}" for k, v in info["env"].items())]
    else:
        lines.append("LOWBIT_* (none set)")
    return "\n".join(lines)
