"""Benchmarks, grouped by purpose, each run from the repository root as `python -m perf.<package>[.<module>]`.

ab (the batchers' A/B), soak (long mixed traffic), peers (llama.cpp and the peers' own clients), gpu (the GPU
check and benchmark), bench (engine and frontend benchmarks), probes (one-off measurements behind a default or
a doc's figure). Results and their index: perf/results/README.md. The tuner is a package of its own (`python -m
tuner`). Nothing in backend_src may import perf.
"""
