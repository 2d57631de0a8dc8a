"""Importing the engine sets OpenMP's short spin (sleeping threads otherwise, after ~0.1 ms) before torch loads
its runtime (docs/cpu.md), and leaves an operator's own choice alone."""
import os
import subprocess
import sys

CODE = "import inflight, os, torch; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


def run(env):
    done = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_short_spin_by_default_and_the_operators_value_wins():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert run(env) == "PASSIVE 30000"
    assert run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE None"
    assert run({**env, "OMP_WAIT_POLICY": "PASSIVE"}) == "PASSIVE None"
    assert run({**env, "GOMP_SPINCOUNT": "300"}) == "None 300"
