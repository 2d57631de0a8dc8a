"""Importing the engine sets OpenMP's passive wait before torch loads its runtime (docs/cpu.md: spinning
threads collapse when another thread wants a core), and leaves an operator's own choice alone."""
import os
import subprocess
import sys

CODE = "import inflight, os, torch; print(os.environ['OMP_WAIT_POLICY'])"


def run(env):
    done = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_passive_by_default_and_the_operators_value_wins():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert run(env) == "PASSIVE"
    assert run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
