"""The soak: minutes of mixed traffic against a served `llm`, `python -m perf.soak` (see perf.soak.run)."""
