"""Start, load, check and stop the real tritonserver: shared by `make serve`, the tests and the benchmarks."""
