"""Benchmarks of the engine and the serving stack that docs/ and tests/ cite (host overhead, offline, step cost...)."""
