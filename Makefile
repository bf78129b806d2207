# Set-up is part of every target: a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV ?= .venv
# The CPU build that lies on this machine's disk; on a GPU machine use `make TORCH_SPEC=torch ...`.
TORCH_SPEC ?= torch==2.13.0
# The torchvision release built for that torch, installed without its dependencies so that pip keeps the
# CPU torch (PyPI's wheel names the CUDA build); tests/support/torchvision_ops.py says why it then imports.
TORCHVISION_SPEC ?= torchvision==0.28.0
BIN := $(VENV)/bin

.PHONY: demo test test-all lint docs bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q --no-deps $(TORCHVISION_SPEC)
	$(BIN)/pip install -q -e ".[test,docs,sweep]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m torchmb demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .

# The docs build (warnings as errors) is part of the tests, so API pages cannot rot.
test: lint docs
	$(BIN)/python -m pytest

# The slow cases too (larger zoo models whose families the default run already covers).
test-all: lint docs
	$(BIN)/python -m pytest -m "slow or not slow"

docs: $(BIN)/.installed
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build demo-output
