"""The batchers' A/B harness: `python -m perf.ab` (see perf.ab.harness and docs/ab.md)."""
