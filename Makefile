# Set-up and the two everyday jobs. `make train` and `make test` work on a fresh clone:
# they find Python >= 3.12 (on PATH or through pyenv), make .venv, and install the package.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.py
# worksteal: a worker that runs out takes tests queued for the other, so the long ones
# do not leave one core idle at the end (9:40 against 9:57 on 2 cores, 2026-11-26)
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: venv install train test clean

$(PY):
	@py=$$(for c in python3.13 python3.12 python3; do \
	    command -v $$c >/dev/null && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$c; break; }; \
	  done); \
	if [ -z "$$py" ] && command -v pyenv >/dev/null; then \
	  for v in $$(pyenv versions --bare | grep -E '^3\.1[2-9]' | sort -rV); do \
	    py="$$(pyenv root)/versions/$$v/bin/python3"; [ -x "$$py" ] && break; done; \
	fi; \
	if [ -z "$$py" ]; then echo "No Python >= 3.12 found (PATH or pyenv); install one." >&2; exit 1; fi; \
	echo "Using $$py"; "$$py" -m venv $(VENV)

install: $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	@# Mosaic GPU's compiler bindings (no CUDA runtime): the tests lower the collective-matmul
	@# kernels for sm_90 on a machine without a GPU (tests/test_collective_matmul.py)
	$(PY) -m pip install -q --no-deps jax-cuda13-plugin==0.11.2

train: install
	$(PY) -m taco_jax.train --config=$(CONFIG) $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
