"""House style of src/: docstrings, comments and strings say what and why, not where a number came from.

Code must not cite benchmark results files (they are curated and renamed; the docs cite them), lowbit's own git
commits, issue numbers or the internal "seed" numbering of the producers (name the producer: LightX2V,
DeepSeek-V3, bitsandbytes, AutoAWQ, vLLM, the nvfp4_packed plugin). A measurement that justifies a threshold
stays, in words ("on an H100, at M = 4096 ... 0.84x"). CPU only.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowbit"

# anywhere in a file (code, strings, comments)
TEXT_RULES = {
    "results path": re.compile(r"benchmarks/results"),
    "results file": re.compile(
        r"(\.\.\._|\b20\d\d-\d\d-\d\d_|\bh[12]00_)[\w*.-]*\.(json|xml|log)\b"
    ),
    "issue number": re.compile(r"\b(issue|issues)[ #-]*\d+", re.IGNORECASE),
    "seed number": re.compile(r"\bseeds?[ #-]*0\d\d\b|\bseed'?s? (plugin|document|definition)\b|\bthe seed'?s?\b",
                              re.IGNORECASE),
    "git commit": re.compile(r"\bgit[ :]+[0-9a-f]{7,40}\b", re.IGNORECASE),
}

# a hex word of commit length with both digits and letters, standing alone (not 0x.., not part of a number)
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_.])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
# pins of other projects' repositories (the producer's version a format is matched against), not lowbit commits
UPSTREAM_PIN = re.compile(r"repository commit [0-9a-f]{7,40}\b")
# PTX float immediates (0f3F800000) are hex words too
PTX_FLOAT = re.compile(r"^0[fd][0-9a-fA-F]+$")


def _looks_like_sha(word: str) -> bool:
    return any(c.isdigit() for c in word) and any(c in "abcdef" for c in word) and not PTX_FLOAT.match(word)


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python source."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.start[0], tok.string))
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out.append((tok.start[0], tok.string))
    return out


def violations(source: str) -> list[tuple[int, str, str]]:
    """(line, rule, excerpt) for every reference the house style forbids in ``source``."""
    found = []
    for rule, pat in TEXT_RULES.items():
        for m in pat.finditer(source):
            line = source.count("\n", 0, m.start()) + 1
            found.append((line, rule, m.group(0)))
    for line, text in _prose(source):
        text = UPSTREAM_PIN.sub("", text)
        for m in HEX_WORD.finditer(text):
            if _looks_like_sha(m.group(0)):
                found.append((line + text.count("\n", 0, m.start()), "commit-like hex word", m.group(0)))
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "# H200 sweep (git 02d3b15)\n",
        '"""see benchmarks/results/h100_e2e.json"""\n',
        "# (..._h100_probe_cublas_blockwise_ac69f09.json)\n",
        "# 2026-11-21_h200_sweep_fp8_decode.json\n",
        '"""Issue 5 targets: 0.9x"""\n',
        "# checked in SASS, see the report of issue 4\n",
        'x = "FP4 weights (seed 002)"\n',
        '"""The seed\'s packed layer"""\n',
        "# first passed at 172fa2c\n",
    ],
)
def test_detector_catches(snippet):
    assert violations(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "MASK = 0x80808080  # sign bits\n",
        "y = 0.5 * v * (1.0 + erf(v * 0.7071067811865476))\n",
        'lines = [f"mov.f32 {c}, 0f00000000;"]\n',
        "# DeepSeek-V3 inference/kernel.py::act_quant (DeepSeek-V3 repository commit 9b4e9788)\n",
        "# on an H100, at M = 4096, 0.84-0.90x torch._scaled_mm\n",
        "def f(seed: int = 0):\n    torch.manual_seed(seed)\n",
        "# the producer warp issues the TMA loads\n",
    ],
)
def test_detector_passes(snippet):
    assert not violations(snippet), violations(snippet)


def test_src_has_no_results_paths_shas_issue_or_seed_numbers():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50, f"found only {len(files)} files under {SRC}"
    bad = []
    for path in files:
        for line, rule, excerpt in violations(path.read_text(encoding="utf-8")):
            bad.append(f"{path.relative_to(SRC.parent)}:{line}: {rule}: {excerpt!r}")
    assert not bad, "house style (see this test's docstring):\n" + "\n".join(bad)
