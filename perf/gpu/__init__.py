"""The GPU session: check.sh (kernel tests + bench, one command) and bench.py (offline engine throughput)."""
