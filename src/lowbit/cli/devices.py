"""Where ``lowbit quantize`` runs: the ``--devices`` list and the ranks torchrun starts.

Both only read text (the option, the environment) and refuse what cannot run; the processes themselves are
started by :mod:`lowbit.eval.convert_only`.
"""

from __future__ import annotations


def torchrun_world() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when torchrun (or another launcher setting them) started more than one process."""
    import os

    size_text, rank_text = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if not size_text:
        return None
    try:
        size = int(size_text)
        rank = int(rank_text) if rank_text else 0
    except ValueError:
        raise ValueError(f"environment variables RANK={rank_text!r}, WORLD_SIZE={size_text!r} must be integers "
                         "(as torchrun sets them)") from None
    if size <= 1:
        return None
    if rank_text is None or not 0 <= rank < size:
        raise ValueError(f"environment variable RANK must be set to 0..{size - 1} when WORLD_SIZE is {size}, "
                         f"got {rank_text!r}")
    return rank, size


def parse_devices(text: str) -> list[str]:
    """``--devices``: ``"cuda:0,cuda:1"``, ``"cpu,cpu"`` or a count ``"2"`` (cuda:0..cuda:1) -> device names;
    ValueError naming the option for an empty list or entry, an unknown device, a GPU given twice (each GPU
    converts in one process; cpu may repeat), or a GPU this machine lacks."""
    import torch

    text = text.strip()
    if not text:
        raise ValueError("--devices is empty: give devices such as cuda:0,cuda:1 or cpu,cpu, or a count such as 2")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--devices {text}: a count of devices must be at least 1")
        if n > n_gpus:
            raise ValueError(f"--devices {n}: a count means cuda:0..cuda:{n - 1}, but this machine has {n_gpus} "
                             "CUDA device(s); name the devices instead (e.g. cpu,cpu)")
        return [f"cuda:{i}" for i in range(n)]
    names = [p.strip() for p in text.split(",")]
    if not all(names):
        raise ValueError(f"--devices {text!r}: an empty entry (give comma-separated devices such as cuda:0,cuda:1)")
    devs = []
    for name in names:
        try:
            devs.append(torch.device(name))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"--devices: {name!r} is not a torch device ({e})") from None
    out = []
    for name, d in zip(names, devs):
        if d.type == "cpu":
            out.append("cpu")
            continue
        if d.type != "cuda":
            raise ValueError(f"--devices: {name!r}: only cpu and cuda devices convert checkpoints")
        if d.index is None:
            raise ValueError(f"--devices: {name!r}: name the GPU by its index (cuda:0, cuda:1, ...)")
        if str(d) in out:
            raise ValueError(f"--devices: {d} is given twice; each GPU converts in one process (only cpu may repeat)")
        out.append(str(d))
    for d in out:
        if d != "cpu" and int(d.split(":")[1]) >= n_gpus:
            raise ValueError(f"--devices: {d} does not exist here ({n_gpus} CUDA device(s)"
                             + ("" if n_gpus else ": CUDA is not available") + ")")
    return out
