"""`import lowbit` works without triton and without touching a GPU."""

import subprocess
import sys
import textwrap


def test_import_without_triton_and_without_device_queries():
    code = textwrap.dedent(
        """
        import sys, torch
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        calls = []
        for name in ("is_available", "device_count", "get_device_properties", "current_device", "init"):
            orig = getattr(torch.cuda, name)
            setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))
        import lowbit, lowbit.formats, lowbit.api
        q = lowbit.quantize(torch.randn(2, 64), "mxfp4")
        lowbit.dequantize(q)
        assert not calls, calls
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
