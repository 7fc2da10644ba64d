# Two commands for a fresh machine: `make train` and `make test` (each sets up .venv if needed).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Exact versions of the whole stack (pyproject.toml's ranges resolved for Python 3.11 on x86_64
# Linux): setup installs through it, `make lock` regenerates it.
LOCK   := requirements.lock
UV     := .venv-lock/bin/uv

.PHONY: setup system-tools lock train test test-slow bench clean

setup: $(STAMP)

# Reinstall when the dependency list or the lock changes. The `tpu` extra (jax 0.7.0, libtpu
# 0.0.21, flax) is installed everywhere: the Pallas kernels are tested in interpret mode and the
# TPU compiler runs on CPU.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[dev,tpu]"
	# an editable install hides the hydra_plugins namespace from Hydra's plugin scan: put launch/
	# on the venv's path instead (a wheel install carries the plugin itself)
	echo "$(CURDIR)/launch" > $$($(PY) -c 'import site; print(site.getsitepackages()[0])')/xtrain-launch-plugins.pth
	touch $(STAMP)

# Re-resolve after a change to pyproject.toml's dependencies. uv keeps every pin the lock already
# has that still fits; `make lock ARGS=--upgrade` (or `ARGS="--upgrade-package gcsfs"`) moves them.
# manylinux_2_31: the oldest glibc libtpu 0.0.21 ships wheels for.
lock:
	test -x $(UV) || { $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install --quiet uv==0.13.9; }
	$(UV) pip compile pyproject.toml --extra dev --extra tpu --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_31 --custom-compile-command "make lock" --quiet \
	  -o $(LOCK) $(ARGS)

train: $(STAMP)
	$(PY) -m xtrain $(ARGS)

# Two pytest-xdist workers (WORKERS=0: one process): most tests spend their time in a child process
# that keeps about one core busy. Tests on the loopback hosts share one worker (tests/conftest.py).
WORKERS ?= 2
PYTEST  := $(PY) -m pytest -q -n $(WORKERS) --dist loadgroup

# sshd, rsync and bubblewrap, installed with apt when missing: the tests use them for real
system-tools:
	bash .ci/system-tools

test: $(STAMP) system-tools
	$(PYTEST) -m "not slow" --durations=15 $(ARGS)

test-slow: $(STAMP) system-tools
	$(PYTEST) -m slow $(ARGS)

bench: $(STAMP)
	$(PY) -m tests.bench $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
