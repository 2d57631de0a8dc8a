"""Unit-test setup: the engine package on sys.path, and paths to the generated test models."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "backend_src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
