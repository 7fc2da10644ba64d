# Two commands for a fresh machine: `make train` and `make test` (each sets up .venv if needed).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-slow bench clean

setup: $(STAMP)

# Reinstall when the dependency list changes. The `tpu` extra (jax 0.7.0, libtpu 0.0.21, flax) is
# installed everywhere: the Pallas kernels are tested in interpret mode and the TPU compiler runs
# on CPU.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,tpu]"
	# an editable install hides the hydra_plugins namespace from Hydra's plugin scan: put launch/
	# on the venv's path instead (a wheel install carries the plugin itself)
	echo "$(CURDIR)/launch" > $$($(PY) -c 'import site; print(site.getsitepackages()[0])')/xtrain-launch-plugins.pth
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m xtrain $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

bench: $(STAMP)
	$(PY) -m tests.bench $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
