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

.PHONY: setup test serve test-docker

setup:
	bash scripts/setup.sh

# tests/deploy needs podman and Prometheus (root): `make test-docker` runs it.
test: setup
	.venv/bin/ruff check .
	$(PYTHON) -m pytest $(PYTEST_FLAGS) --ignore=tests/deploy tests

# Containers and deployment (root, Debian 12): podman, Prometheus and a local Debian base image
# (scripts/setup_docker.sh), the CPU image (docker/build.py, from that base; torch from this machine's pip
# settings), then tests/deploy: the image, the dashboard and alerts against live Prometheus, lint checks.
test-docker: setup
	bash scripts/setup_docker.sh
	$(PYTHON) docker/build.py cpu --base local/debian:bookworm --torch-index ""
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests/deploy

serve: setup
	$(PYTHON) scripts/serve.py
