"""One streaming client for two servers (perf.peers.cpu_peer): Triton's gRPC stream and llama.cpp's HTTP SSE.

Each request records when it was sent and when each response arrived with how many tokens it carried, so both
servers are measured by the same code: TTFT is the first response, inter-token gaps are the gaps between
responses spread over the tokens each carries.
"""
from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlparse

import tritonclient.grpc as grpcclient

from server_harness.stream_client import make_inputs


@dataclass
class Result:
    sent_s: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that response)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def first_s(self) -> float:
        return next(t for t, n in self.arrivals if n)

    @property
    def last_s(self) -> float:
        return self.arrivals[-1][0]

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def token_gaps_s(self) -> list[float]:
        gaps, prev = [], None
        for t, n in self.arrivals:
            if not n:
                continue
            if prev is not None:
                gaps.extend([(t - prev) / n] * n)
            prev = t
        return gaps


class StreamClient(Protocol):
    name: str

    def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = True) -> Result: ...


class TritonStream:
    """Our `llm` model over gRPC streaming; one connection and stream per calling thread."""

    name = "ours"

    def __init__(self, url: str, model: str = "llm"):
        self.url, self.model = url, model
        self._local = threading.local()
        self._ids = iter(range(1 << 62))
        self._clients: list = []  # every thread's, so close() can end each stream (an open one delays shutdown)

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            inbox: queue.Queue = queue.Queue()
            client = grpcclient.InferenceServerClient(self.url)
            client.start_stream(callback=lambda result=None, error=None: inbox.put((time.perf_counter(), result,
                                                                                   error)))
            conn = self._local.conn = (client, inbox)
            self._clients.append(client)
        return conn

    def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = True) -> Result:
        client, inbox = self._conn()
        inputs = make_inputs(prompt, {"max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos,
                                      "temperature": 0.0, "return_num_output_tokens": True})
        res = Result(time.perf_counter())
        client.async_stream_infer(self.model, inputs, request_id=str(next(self._ids)))
        while True:
            t, result, error = inbox.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"ours: {error}")
            response = result.get_response()
            counts = result.as_numpy("num_output_tokens")
            res.arrivals.append((t, int(counts.sum()) if counts is not None else 0))
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return res

    def close(self) -> None:
        for client in self._clients:
            client.stop_stream()
            client.close()
        self._clients.clear()


class LlamaCppStream:
    """llama.cpp's /completion with stream=true (server-sent events); one keep-alive connection per thread."""

    name = "llama_cpp"

    def __init__(self, url: str):
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port
        self._local = threading.local()

    def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = True) -> Result:
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "stream": True, "ignore_eos": ignore_eos,
                           "temperature": 0.0})
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
            res = Result(time.perf_counter())
            try:
                conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # llama-server closes a keep-alive connection left idle for a few seconds; nothing was
                # generated yet, so open a new one and send again (once).
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        if resp.status != 200:
            raise RuntimeError(f"llama_cpp: HTTP {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError("llama_cpp: stream ended without a final event")
            if not line.startswith(b"data: "):
                continue
            t = time.perf_counter()
            event = json.loads(line[6:])
            if event.get("stop"):
                resp.read()  # drain, so the connection can carry the next request
                predicted = event.get("timings", {}).get("predicted_n")
                if predicted is not None and predicted != res.num_tokens:
                    # Every token but the last comes as its own event; the final event carries the rest.
                    res.arrivals.append((t, predicted - res.num_tokens))
                return res
            res.arrivals.append((t, len(event.get("tokens") or [0])))


def run_closed_loop(client: StreamClient, requests: list, concurrency: int) -> list[Result]:
    """`concurrency` workers, each sending its next request as soon as the previous one ended."""
    todo: queue.Queue = queue.Queue()
    for r in requests:
        todo.put(r)
    results: list[Result] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker():
        while not errors:
            try:
                r = todo.get_nowait()
            except queue.Empty:
                return
            try:
                res = client.stream(r.prompt, r.max_tokens)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
                errors.append(e)
                return
            with lock:
                results.append(res)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(requests)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
