# Entry points. Every target sets the project up first; setup is idempotent and takes
# seconds once done (first run: venv + packages + model conversion, a few minutes).
SHELL := /bin/bash
PYTHON := .venv/bin/python
# -rfEs: list failures, errors and skips at the end; --timeout: a hung server test fails
# instead of eating CI's time; no cacheprovider: keep the tree free of .pytest_cache.
PYTEST_FLAGS ?= -q -rfEs -p no:cacheprovider --timeout=600 --durations=10
# Nothing may try to reach a model hub: everything comes from models/.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test serve

setup:
	bash scripts/setup.sh

test: setup
	.venv/bin/ruff check .
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests

serve: setup
	$(PYTHON) scripts/serve.py
