# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test

.PHONY: demo test test-slow bench setup clean aot-plugins

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m jtree.launch.train --config configs/tiny.yaml

# The import layers first (lint-imports: tests/import_layers.toml on the layout as it installs), then the tests: two workers, one per core; a
# test file stays on one worker so its compiled functions are shared.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# The heavier tests (CI runs them after `make test`): meshes, interpreters, full-depth lowering.
# SLOW_ARGS: more pytest options (CI passes a start budget: tests/conftest.py).
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m slow --durations=25 $(SLOW_ARGS)

bench: $(STAMP)
	$(PY) -m jtree.launch.bench

# The production compilers (libtpu; jax's CUDA plugin) for `python -m jtree.launch.compile`, at the
# versions the installed jax asks for, into their own folder: never on .venv's import path.
aot-plugins: $(STAMP)
	$(PY) -m jtree.launch.aot_plugins .aot

clean:
	rm -rf $(VENV) runs bench_out
