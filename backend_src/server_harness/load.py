"""Steady streaming traffic through both A/B arms for a while: the load behind the dashboard test
(tests/deploy/test_dashboard.py), the dashboard picture (perf/bench/dashboard_snapshot.py) and the instance test."""
from __future__ import annotations

import random
import threading
import time

from .stream_client import StreamClient

# A shared opening (several KV blocks long) makes later prompts hit the prefix cache.
PREFIX = ("You are a concise assistant. Answer in one or two sentences, plainly, without lists or headings, "
          "and do not repeat the question. ")
QUESTIONS = ("Why is the sky blue?", "What is a hash table?", "Name three prime numbers.",
             "How do tides work?", "What does a compiler do?", "Why do leaves change colour?")


def traffic(grpc_url: str, seconds: float, concurrency: int, models: tuple[str, ...] = ("llm", "llm_ensemble"),
            max_tokens: tuple[int, int] = (8, 64), seed: int = 0) -> dict[str, int]:
    """`concurrency` clients (client i on models[i % len(models)]), each on its own gRPC stream sending one
    streamed request after another until `seconds` have passed. Returns {"sent", "ok", "errors"}."""
    counts = {"sent": 0, "ok": 0, "errors": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        model = models[index % len(models)]
        client = StreamClient(grpc_url)
        try:
            n = 0
            while time.monotonic() < deadline:
                rid = f"c{index}-{n}"
                n += 1
                client.send(model, rid, PREFIX + rng.choice(QUESTIONS),
                            {"max_tokens": rng.randint(*max_tokens), "stream": True,
                             "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30)})
                client.wait_finals(300, ids=[rid])
                with lock:
                    counts["sent"] += 1
                    counts["errors" if client.records[rid].error else "ok"] += 1
        finally:
            client.close(cancel=True)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts
