"""Fault runs against a real tritonserver: cancellation loops through both arms, a stub killed under load,
overload. Each writes perf/results/faults-<name>/ and exits non-zero when a guarantee broke."""
