"""One streaming gRPC load generator for every arm: the same requests, in the same order, under the same arrival
process, whatever batcher serves them.

perf_analyzer cannot drive the iterative arm (it sees sequence_batching and sends its own correlation ids with
start/end flags; docs/ab.md), so the A/B measures all three arms with this client instead:

- `concurrency` virtual users, each on its own gRPC stream (tritonclient), each sending its next request when the
  previous one has its final; requests are taken from one shared list in order, so the mix is the same for every
  arm and no user drains early (perf_analyzer splits the count per thread);
- arrival: `closed` (the next request goes as soon as a user is free), or `poisson:R` (request i may not start
  before its arrival time, exponential gaps at R requests/s, seeded; at most `concurrency` in flight);
- inputs take the batch dimension when the model's config has max_batch_size > 0 (llm_iterative), as every
  Triton client of a batching model does; the contract's values are the same;
- per request: the send time, and for every response that carries tokens its arrival time and its
  num_output_tokens (the same records perf_analyzer's profile export gives, so perf.ab.metrics summarizes both).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

from perf.ab.metrics import RequestTiming
from perf.ab.workloads import Request


@dataclass(frozen=True)
class Arrival:
    kind: str  # "closed" or "poisson"
    rate: float = 0.0  # requests/s for poisson

    @classmethod
    def parse(cls, text: str) -> "Arrival":
        if text == "closed":
            return cls("closed")
        kind, _, rate = text.partition(":")
        try:
            value = float(rate)
        except ValueError:
            value = -1.0
        if kind != "poisson" or value <= 0:
            raise ValueError(f"arrival={text!r} is invalid: allowed 'closed' or 'poisson:R' with R > 0 requests/s")
        return cls("poisson", value)

    def times(self, count: int, seed: int = 0) -> list[float]:
        """Offsets (s) from the start before which request i may not be sent."""
        if self.kind == "closed":
            return [0.0] * count
        rng = random.Random(f"arrivals/{seed}")
        t, out = 0.0, []
        for _ in range(count):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


def request_values(request: Request) -> dict[str, np.ndarray]:
    """What every arm gets for a workload request (as perf_analyzer's --input-data did): greedy, exact lengths."""
    return {"text_input": np.array([request.prompt.encode()], dtype=np.object_),
            "max_tokens": np.array([request.max_tokens], dtype=np.int32),
            "stream": np.array([True]), "ignore_eos": np.array([True]),
            "temperature": np.array([0.0], dtype=np.float32),
            "return_num_output_tokens": np.array([True])}


def takes_batch_dim(grpc_url: str, model: str) -> bool:
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        return client.get_model_config(model).config.max_batch_size > 0
    finally:
        client.close()


def build_inputs(request: Request, batch_dim: bool) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in request_values(request).items():
        if batch_dim:
            array = array[None, ...]
        wire = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), wire)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class _User:
    """One virtual user: one gRPC stream, one request at a time."""

    def __init__(self, grpc_url: str, index: int):
        self.index = index
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.done = threading.Event()
        self.timing: RequestTiming | None = None
        self.error: str | None = None
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result=None, error=None) -> None:
        now = time.monotonic_ns()
        timing = self.timing
        if timing is None:
            return
        if error is not None:
            self.error = str(error)
            self.done.set()
            return
        n = result.as_numpy("num_output_tokens")
        count = int(n.reshape(-1)[0]) if n is not None else 0
        if count > 0:
            timing.response_ns.append(now)
            timing.tokens.append(count)
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.done.set()

    def run_one(self, model: str, inputs: list, request_id: str, timeout_s: float) -> tuple[RequestTiming, str | None]:
        self.done.clear()
        self.error = None
        self.timing = RequestTiming(time.monotonic_ns(), [], [])
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        if not self.done.wait(timeout_s):
            self.error = f"no final response within {timeout_s:.0f} s"
        timing, self.timing = self.timing, None
        return timing, self.error

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        finally:
            self.client.close()


@dataclass
class LoadResult:
    timings: list[RequestTiming]
    errors: list[str]
    seconds: float


def run_load(grpc_url: str, model: str, requests: list[Request], concurrency: int, arrival: Arrival = Arrival("closed"),
             seed: int = 0, request_timeout_s: float = 600.0) -> LoadResult:
    """Send every request once through `concurrency` users; returns a timing per request, in request order."""
    batch_dim = takes_batch_dim(grpc_url, model)
    prepared = [build_inputs(r, batch_dim) for r in requests]  # before the clock starts: not the client's cost
    offsets = arrival.times(len(requests), seed)
    timings: list[RequestTiming | None] = [None] * len(requests)
    errors: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(len(requests)))
    users = [_User(grpc_url, i) for i in range(concurrency)]
    t0 = time.monotonic()

    def work(user: _User) -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            wait = t0 + offsets[i] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            timing, error = user.run_one(model, prepared[i], f"u{user.index}-r{i}", request_timeout_s)
            timings[i] = timing
            if error:
                with lock:
                    errors.append(f"request {i}: {error}")

    threads = [threading.Thread(target=work, args=(u,), name=f"loadgen-{u.index}", daemon=True) for u in users]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for u in users:
            u.close()
    return LoadResult([t for t in timings if t is not None], errors, time.monotonic() - t0)
