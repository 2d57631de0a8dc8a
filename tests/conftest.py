"""Shared fixtures (pyproject.toml puts tests/ on pytest's pythonpath, for engine_helpers and serve_script)."""

from __future__ import annotations

import os

# Triton's language helpers are built when triton is first imported (transformers may import it):
# without a GPU the kernels can only run in the interpreter, which must be chosen before that.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Callable, Iterator

import pytest

from server_harness.server import TritonServer


@pytest.fixture
def triton_server_factory(tmp_path_factory) -> Iterator[Callable[..., TritonServer]]:
    """Start real tritonservers: factory(model_repository, extra_args=(), **TritonServer kwargs).

    Each is started ready and stopped at teardown (if the test did not), and the test errors
    at teardown if a server left a stub process or a shared-memory region behind; a fault
    test that leaves them on purpose passes check_leftovers=False and asserts them itself.
    """
    servers: list[TritonServer] = []

    def start(model_repository, extra_args=(), *, check_leftovers=True, **kwargs) -> TritonServer:
        log_dir = tmp_path_factory.mktemp("tritonserver")
        kwargs.setdefault("log_path", log_dir / "server.log")
        server = TritonServer(model_repository, extra_args, **kwargs)
        if check_leftovers:
            servers_checked.append(server)
        servers.append(server)
        print(f"tritonserver log: {server.log_path}")  # shown by pytest when a test fails
        return server.start()

    servers_checked: list[TritonServer] = []
    yield start
    problems = []
    for server in servers:
        server.stop()
    for server in servers_checked:
        problems += server.leftovers()
    if problems:
        pytest.fail("tritonserver left things behind:\n" + "\n".join(problems))


# ---- slow tests: skipped unless asked for ------------------------------------------------------------------
# Runs of many minutes (the 5-minute soak in the image, the 500-iteration cancellation loop) are marked
# `@pytest.mark.slow`; `make test` skips them. Run them with `pytest --run-slow ...` (or RUN_SLOW=1).

def pytest_addoption(parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: minutes long; skipped unless --run-slow (or RUN_SLOW=1)")


def pytest_collection_modifyitems(config, items) -> None:
    if config.getoption("--run-slow") or os.environ.get("RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (or RUN_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
