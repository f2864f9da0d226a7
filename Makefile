# `make test`: sets up .venv on a fresh machine (CPU torch 2.13.0 if no torch is there) and runs the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test setup clean

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# never let pip resolve torch by itself: a bare requirement pulls several GB of CUDA wheels
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	# AutoAWQ's packing_utils only (its package import needs accelerate; tests load the file by path)
	$(BIN)/python -m pip install -q --no-deps autoawq==0.2.9
	touch $@

clean:
	rm -rf $(VENV)
