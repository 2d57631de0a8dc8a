"""Mixed traffic for the soak (perf.soak.run): one worker thread per concurrent client, each picking a
random action per request and recording what came back (finals, latency, errors).

Actions: gRPC stream, gRPC non-stream, HTTP /generate, a stream cancelled by the client (gRPC cancel after
its first tokens), a stream cancelled by a stop request with its id, an HTTP generate_stream dropped after
its first event, and a bad request (must come back as exactly one error).
"""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from server_harness.stream_client import StreamClient

PROMPTS = ["Why is the sky blue?", "Write a haiku about autumn.", "List three prime numbers.",
           "Explain what a hash table is.", "你好，请介绍一下你自己。", "Translate 'good morning' to French.",
           "What is 17 times 23?", "Tell me a short story about a robot 🤖."]
# name -> (prompt, typed inputs, request parameters); each must be refused with one error final.
BAD = {
    "negative_temperature": ("Hi", {"temperature": -1.0}, None),
    "bad_json": ("Hi", {"sampling_parameters": "{max_tokens: 4"}, None),
    "empty_prompt": ("", {}, None),
    "unknown_parameter": ("Hi", {}, {"best_of": 3}),
    "invalid_utf8": (b"\xff\xfe bad", {}, None),
    "oversize_prompt": (b"x" * (2 << 20), {}, None),
    "top_p_zero": ("Hi", {"sampling_parameters": json.dumps({"top_p": 0})}, None),
}
# action -> weight
MIX = {"stream": 30, "nonstream": 15, "http": 10, "grpc_cancel": 10, "stop_cancel": 10, "http_drop": 5, "bad": 20}
# Actions whose request reaches the engine (so the server's finished-request counters must grow by one each).
ENGINE_BOUND = ("stream", "nonstream", "http", "grpc_cancel", "stop_cancel", "http_drop")


@dataclass
class Outcome:
    action: str
    request_id: str
    ok: bool  # what the action expects happened (a bad request refused, a cancel cancelled, ...)
    detail: str = ""
    latency_s: float | None = None  # send -> final, for requests that ran to their end
    ttft_s: float | None = None


@dataclass
class Endpoints:
    model: str
    grpc_url: str  # host:port
    http_base: str  # http://host:port
    metrics_url: str


@dataclass
class Traffic:
    endpoints: Endpoints
    concurrency: int
    max_tokens: int
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    clients: list[StreamClient] = field(default_factory=list)  # long-lived, checked for finals at the end
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, duration_s: float) -> None:
        deadline = time.monotonic() + duration_s
        threads = [threading.Thread(target=self._worker, args=(w, deadline), name=f"soak-{w}", daemon=True)
                   for w in range(self.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def counts(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for o in self.outcomes:
                out[o.action] = out.get(o.action, 0) + 1
            return out

    # ---- one worker ------------------------------------------------------------------------------
    def _worker(self, w: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + w)
        client = StreamClient(self.endpoints.grpc_url)
        with self._lock:
            self.clients.append(client)
        actions, weights = zip(*MIX.items())
        n = 0
        while time.monotonic() < deadline:
            action = rng.choices(actions, weights)[0]
            rid = f"w{w}-{n}-{action}"
            n += 1
            try:
                outcome = getattr(self, f"_{action}")(client, rid, rng)
            except Exception as e:  # noqa: BLE001 - a client-side failure is a finding, not a crash
                outcome = Outcome(action, rid, False, f"client exception: {type(e).__name__}: {e}")
            with self._lock:
                self.outcomes.append(outcome)

    def _values(self, rng: random.Random, stream: bool) -> dict:
        values = {"max_tokens": rng.randint(4, self.max_tokens), "stream": stream, "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.5:
            values.update(temperature=0.8, seed=rng.randrange(2**31))
        else:
            values["temperature"] = 0.0
        return values

    def _await(self, client: StreamClient, rid: str, action: str, timeout_s: float = 300.0) -> Outcome:
        if not client.wait_finals(timeout_s, ids=[rid]):
            return Outcome(action, rid, False, "no final response")
        rec = client.records[rid]
        if rec.error:
            return Outcome(action, rid, False, f"error: {rec.error[:200]}")
        ttft = (rec.first_response_at - rec.sent_at) if rec.first_response_at else None
        return Outcome(action, rid, True, latency_s=rec.final_at - rec.sent_at, ttft_s=ttft)

    def _stream(self, client, rid, rng) -> Outcome:
        client.send(self.endpoints.model, rid, rng.choice(PROMPTS), self._values(rng, True))
        return self._await(client, rid, "stream")

    def _nonstream(self, client, rid, rng) -> Outcome:
        client.send(self.endpoints.model, rid, rng.choice(PROMPTS), self._values(rng, False))
        return self._await(client, rid, "nonstream")

    def _bad(self, client, rid, rng) -> Outcome:
        name = rng.choice(sorted(BAD))
        prompt, values, params = BAD[name]
        client.send(self.endpoints.model, rid, prompt, values, params)
        if not client.wait_finals(60, ids=[rid]):
            return Outcome("bad", rid, False, f"{name}: no final response")
        rec = client.records[rid]
        ok = rec.error is not None and rec.num_responses == 0
        return Outcome("bad", rid, ok, f"{name}: " + (rec.error or "accepted!")[:200])

    def _grpc_cancel(self, client, rid, rng) -> Outcome:
        """Its own stream, cancelled by the client once tokens flow: the final never reaches us (the stream is
        gone); the server's counters account for it."""
        own = StreamClient(self.endpoints.grpc_url)
        try:
            own.send(self.endpoints.model, rid, rng.choice(PROMPTS), {**self._values(rng, True), "max_tokens": 512,
                                                                     "ignore_eos": True})
            if not own.wait_responses(rid, 1, 300):
                return Outcome("grpc_cancel", rid, False, "no first response")
            if own.records[rid].num_finals:
                return Outcome("grpc_cancel", rid, False, "finished before the cancel")
        finally:
            own.close(cancel=True)
        return Outcome("grpc_cancel", rid, True)

    def _stop_cancel(self, client, rid, rng) -> Outcome:
        client.send(self.endpoints.model, rid, rng.choice(PROMPTS), {**self._values(rng, True), "max_tokens": 512,
                                                                    "ignore_eos": True})
        if not client.wait_responses(rid, 1, 300):
            return Outcome("stop_cancel", rid, False, "no first response")
        # The stop request must carry the victim's id; on the same stream the two would share one record.
        stopper = StreamClient(self.endpoints.grpc_url)
        try:
            stopper.send(self.endpoints.model, rid, "", {}, {"stop": True})
            stopped = stopper.wait_finals(60)
            stop_rec = stopper.records[rid]
        finally:
            stopper.close()
        if not client.wait_finals(60, ids=[rid]):
            return Outcome("stop_cancel", rid, False, "victim got no final")
        victim = client.records[rid]
        ok = stopped and stop_rec.num_finals == 1 and stop_rec.error is None and (
            (victim.error and "cancelled" in victim.error) or victim.error is None)  # it may have just finished
        return Outcome("stop_cancel", rid, bool(ok), (victim.error or "finished first")[:200])

    def _http(self, client, rid, rng) -> Outcome:
        body = {"text_input": rng.choice(PROMPTS), **self._values(rng, False)}
        req = urllib.request.Request(f"{self.endpoints.http_base}/v2/models/{self.endpoints.model}/generate",
                                     data=json.dumps(body).encode(), method="POST")
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return Outcome("http", rid, False, f"HTTP {e.code}: {e.read()[:200]!r}")
        ok = isinstance(out.get("text_output"), str)
        return Outcome("http", rid, ok, "" if ok else f"odd body {out!r:.200}", latency_s=time.monotonic() - t0)

    def _http_drop(self, client, rid, rng) -> Outcome:
        """generate_stream, dropped after its first event: Triton cancels the request."""
        body = {"text_input": rng.choice(PROMPTS), **self._values(rng, True), "max_tokens": 512, "ignore_eos": True}
        req = urllib.request.Request(f"{self.endpoints.http_base}/v2/models/{self.endpoints.model}/generate_stream",
                                     data=json.dumps(body).encode(), method="POST")
        resp = urllib.request.urlopen(req, timeout=300)
        try:
            for line in resp:
                if line.startswith(b"data: "):
                    return Outcome("http_drop", rid, True)
            return Outcome("http_drop", rid, False, "stream ended without an event")
        finally:
            resp.close()


def finals_check(clients: list[StreamClient]) -> tuple[int, int, list[str]]:
    """Over every long-lived stream: (requests with no final, requests with more than one, examples)."""
    missing = duplicate = 0
    examples = []
    for c in clients:
        for rid, (sent, finals) in c.final_counts().items():
            if finals < sent:
                missing += 1
                examples.append(f"{rid}: {finals} final(s) for {sent} send(s)")
            elif finals > sent:
                duplicate += 1
                examples.append(f"{rid}: {finals} finals for {sent} send(s)")
        examples += [f"unmatched error: {m[:120]}" for m in c.unmatched_errors]
        duplicate += len(c.unmatched_errors) + c.unknown_responses
    return missing, duplicate, examples[:20]
