"""Run scripts/serve.py (`make serve`) as a user would, for the tests that check it end to end."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping

ROOT = Path(__file__).resolve().parent.parent
SERVE_SCRIPT = ROOT / "scripts" / "serve.py"


@contextlib.contextmanager
def serve_script(env: Mapping[str, str], log_path: Path, ready_line: str,
                 timeout_s: float = 180.0) -> Iterator[subprocess.Popen]:
    """Run scripts/serve.py (`make serve`) with env as its whole environment and its output in log_path;
    yield its process once ready_line is in the log (assert it gets there alive within timeout_s).
    Leaving the block normally stops it with SIGINT (Ctrl-C) and asserts exit code 0; whatever is still
    running after that, or after an exception, is killed."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(SERVE_SCRIPT)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while ready_line not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        yield proc
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
