"""Mixed traffic for the soak (perf.soak.run): one worker thread per concurrent client, each picking a
random action per request and recording what came back (finals, latency, errors).

Actions on the in-flight arm (`llm`): gRPC stream, gRPC non-stream, HTTP /generate, a stream cancelled by the
client (gRPC cancel after its first tokens), a stream cancelled by a stop request with its id, an HTTP
generate_stream dropped after its first event, a bad request (must come back as exactly one error), a stream
with a random priority. On the dynamic arm (`llm_ensemble`): streams, non-streams, cancels and bad requests.
Through the OpenAI API: a streamed chat completion read to [DONE], and one dropped after its first chunk.
The "host" mix is the in-flight arm's actions; the "image" mix (the soak in the container) is everything.
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
# Both arms as the A/B drives them, OpenAI streaming and priorities; about 10% cancels (grpc_cancel, ens_cancel,
# stop_cancel) and 7% disconnects (http_drop, openai_drop), 9% bad requests. Few of those on the ensemble: Triton
# counts its refusals as request failures, and docker/prometheus/alerts.yml warns above 5% of a model's requests
# (4 of 25 ensemble requests did, in a 5-minute run).
IMAGE_MIX = {"stream": 14, "priority": 8, "nonstream": 5, "http": 5, "grpc_cancel": 4, "stop_cancel": 2,
             "http_drop": 3, "bad": 8, "ens_stream": 17, "ens_nonstream": 5, "ens_cancel": 4, "ens_bad": 0.5,
             "openai_stream": 20, "openai_drop": 4}
MIXES = {"host": MIX, "image": IMAGE_MIX}
# Actions whose request reaches an engine (so the servers' finished-request counters must grow by one each).
ENGINE_BOUND = ("stream", "nonstream", "http", "grpc_cancel", "stop_cancel", "http_drop", "priority",
                "ens_stream", "ens_nonstream", "ens_cancel", "openai_stream", "openai_drop")


@dataclass
class Outcome:
    action: str
    request_id: str
    ok: bool  # what the action expects happened (a bad request refused, a cancel cancelled, ...)
    detail: str = ""
    latency_s: float | None = None  # send -> final, for requests that ran to their end
    ttft_s: float | None = None
    sent_s: float = 0.0  # time.monotonic() when it was sent (the report's windows: first and last minutes)
    cause: str = "finished"  # how it ended: finished, cancelled, disconnected, refused, or the error's kind


@dataclass
class Endpoints:
    model: str
    grpc_url: str  # host:port
    http_base: str  # http://host:port
    metrics_url: str
    ensemble_model: str = "llm_ensemble"
    openai_base: str | None = None  # http://host:port of the OpenAI API (image mix)


@dataclass
class Traffic:
    endpoints: Endpoints
    concurrency: int
    max_tokens: int
    seed: int = 0
    mix: dict[str, int] = field(default_factory=lambda: dict(MIX))
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
        actions, weights = zip(*self.mix.items())
        n = 0
        while time.monotonic() < deadline:
            action = rng.choices(actions, weights)[0]
            rid = f"w{w}-{n}-{action}"
            n += 1
            sent = time.monotonic()
            try:
                outcome = getattr(self, f"_{action}")(client, rid, rng)
            except Exception as e:  # noqa: BLE001 - a client-side failure is a finding, not a crash
                outcome = Outcome(action, rid, False, f"client exception: {type(e).__name__}: {e}",
                                  cause="client exception")
            outcome.sent_s = sent
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
            return Outcome(action, rid, False, "no final response", cause="no final")
        rec = client.records[rid]
        if rec.error:
            return Outcome(action, rid, False, f"error: {rec.error[:200]}", cause=error_cause(rec.error))
        ttft = (rec.first_response_at - rec.sent_at) if rec.first_response_at else None
        return Outcome(action, rid, True, latency_s=rec.final_at - rec.sent_at, ttft_s=ttft)

    def _stream(self, client, rid, rng, model: str | None = None, action: str = "stream", **extra) -> Outcome:
        client.send(model or self.endpoints.model, rid, rng.choice(PROMPTS), {**self._values(rng, True), **extra})
        return self._await(client, rid, action)

    def _nonstream(self, client, rid, rng, model: str | None = None, action: str = "nonstream") -> Outcome:
        client.send(model or self.endpoints.model, rid, rng.choice(PROMPTS), self._values(rng, False))
        return self._await(client, rid, action)

    def _priority(self, client, rid, rng) -> Outcome:
        """A stream with a priority (lower is served first; it only reorders the engine's waiting queue)."""
        return self._stream(client, rid, rng, action="priority", priority=rng.choice([-10, -1, 0, 1, 10]))

    def _ens_stream(self, client, rid, rng) -> Outcome:
        return self._stream(client, rid, rng, model=self.endpoints.ensemble_model, action="ens_stream")

    def _ens_nonstream(self, client, rid, rng) -> Outcome:
        return self._nonstream(client, rid, rng, model=self.endpoints.ensemble_model, action="ens_nonstream")

    def _bad(self, client, rid, rng, model: str | None = None, action: str = "bad") -> Outcome:
        name = rng.choice(sorted(BAD))
        prompt, values, params = BAD[name]
        client.send(model or self.endpoints.model, rid, prompt, values, params)
        if not client.wait_finals(60, ids=[rid]):
            return Outcome(action, rid, False, f"{name}: no final response", cause="no final")
        rec = client.records[rid]
        ok = rec.error is not None and rec.num_responses == 0
        return Outcome(action, rid, ok, f"{name}: " + (rec.error or "accepted!")[:200],
                       cause="refused: invalid input" if ok else "accepted a bad request")

    def _ens_bad(self, client, rid, rng) -> Outcome:
        return self._bad(client, rid, rng, model=self.endpoints.ensemble_model, action="ens_bad")

    def _grpc_cancel(self, client, rid, rng, model: str | None = None, action: str = "grpc_cancel") -> Outcome:
        """Its own stream, cancelled by the client once tokens flow: the final never reaches us (the stream is
        gone); the server's counters account for it."""
        own = StreamClient(self.endpoints.grpc_url)
        try:
            own.send(model or self.endpoints.model, rid, rng.choice(PROMPTS),
                     {**self._values(rng, True), "max_tokens": 512, "ignore_eos": True})
            if not own.wait_responses(rid, 1, 300):
                return Outcome(action, rid, False, "no first response", cause="no first response")
            if own.records[rid].num_finals:
                return Outcome(action, rid, False, "finished before the cancel", cause="finished early")
        finally:
            own.close(cancel=True)
        return Outcome(action, rid, True, cause="cancelled")

    def _ens_cancel(self, client, rid, rng) -> Outcome:
        """Cancelled at the ensemble: Triton 2.51 does not pass it on to llm_dynamic's running step; the cancel
        relay does (dynamic_arm/cancel_relay.py), at the row's next response."""
        return self._grpc_cancel(client, rid, rng, model=self.endpoints.ensemble_model, action="ens_cancel")

    def _stop_cancel(self, client, rid, rng) -> Outcome:
        client.send(self.endpoints.model, rid, rng.choice(PROMPTS), {**self._values(rng, True), "max_tokens": 512,
                                                                    "ignore_eos": True})
        if not client.wait_responses(rid, 1, 300):
            return Outcome("stop_cancel", rid, False, "no first response", cause="no first response")
        # The stop request must carry the victim's id; on the same stream the two would share one record.
        stopper = StreamClient(self.endpoints.grpc_url)
        try:
            stopper.send(self.endpoints.model, rid, "", {}, {"stop": True})
            stopped = stopper.wait_finals(60)
            stop_rec = stopper.records[rid]
        finally:
            stopper.close()
        if not client.wait_finals(60, ids=[rid]):
            return Outcome("stop_cancel", rid, False, "victim got no final", cause="no final")
        victim = client.records[rid]
        ok = stopped and stop_rec.num_finals == 1 and stop_rec.error is None and (
            (victim.error and "cancelled" in victim.error) or victim.error is None)  # it may have just finished
        return Outcome("stop_cancel", rid, bool(ok), (victim.error or "finished first")[:200],
                       cause="cancelled" if victim.error else "finished")

    def _http(self, client, rid, rng) -> Outcome:
        body = {"text_input": rng.choice(PROMPTS), **self._values(rng, False)}
        req = urllib.request.Request(f"{self.endpoints.http_base}/v2/models/{self.endpoints.model}/generate",
                                     data=json.dumps(body).encode(), method="POST")
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read()[:200].decode(errors="replace")
            return Outcome("http", rid, False, f"HTTP {e.code}: {text}", cause=error_cause(text))
        ok = isinstance(out.get("text_output"), str)
        return Outcome("http", rid, ok, "" if ok else f"odd body {out!r:.200}", latency_s=time.monotonic() - t0,
                       cause="finished" if ok else "odd body")

    def _http_drop(self, client, rid, rng) -> Outcome:
        """generate_stream, dropped after its first event: Triton cancels the request."""
        body = {"text_input": rng.choice(PROMPTS), **self._values(rng, True), "max_tokens": 512, "ignore_eos": True}
        req = urllib.request.Request(f"{self.endpoints.http_base}/v2/models/{self.endpoints.model}/generate_stream",
                                     data=json.dumps(body).encode(), method="POST")
        resp = urllib.request.urlopen(req, timeout=300)
        try:
            for line in resp:
                if line.startswith(b"data: "):
                    return Outcome("http_drop", rid, True, cause="disconnected")
            return Outcome("http_drop", rid, False, "stream ended without an event", cause="no event")
        finally:
            resp.close()

    def _openai_request(self, rng: random.Random, rid: str) -> urllib.request.Request:
        body = {"model": self.endpoints.model, "stream": True, "max_tokens": rng.randint(4, self.max_tokens),
                "temperature": rng.choice([0.0, 0.8]),
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        return urllib.request.Request(f"{self.endpoints.openai_base}/v1/chat/completions",
                                      data=json.dumps(body).encode(), method="POST",
                                      headers={"Content-Type": "application/json"})

    def _openai_stream(self, client, rid, rng) -> Outcome:
        """A streamed chat completion, read to [DONE]: one finish_reason, no error event."""
        t0, ttft, finishes = time.monotonic(), None, 0
        try:
            with urllib.request.urlopen(self._openai_request(rng, rid), timeout=300) as resp:
                for line in resp:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        message = str(event["error"].get("message", ""))[:200]
                        return Outcome("openai_stream", rid, False, f"error event: {message}",
                                       cause=error_cause(message))
                    for choice in event.get("choices", []):
                        if ttft is None and choice.get("delta", {}).get("content"):
                            ttft = time.monotonic() - t0
                        finishes += choice.get("finish_reason") is not None
        except urllib.error.HTTPError as e:
            text = e.read()[:200].decode(errors="replace")
            return Outcome("openai_stream", rid, False, f"HTTP {e.code}: {text}", cause=error_cause(text))
        ok = finishes == 1
        return Outcome("openai_stream", rid, ok, "" if ok else f"{finishes} finish reasons",
                       latency_s=time.monotonic() - t0, ttft_s=ttft, cause="finished" if ok else "no finish")

    def _openai_drop(self, client, rid, rng) -> Outcome:
        """A streamed chat completion dropped after its first chunk: the frontend cancels its gRPC call."""
        with urllib.request.urlopen(self._openai_request(rng, rid), timeout=300) as resp:
            for line in resp:
                if line.startswith(b"data: "):
                    return Outcome("openai_drop", rid, True, cause="disconnected")
        return Outcome("openai_drop", rid, False, "stream ended without an event", cause="no event")


def error_cause(message: str) -> str:
    """An error's kind, for the report's table: what a client would act on."""
    m = (message or "").lower()
    for needle, cause in (("queue is full", "refused: queue full"), ("not healthy", "error: stub died"),
                          ("being unloaded", "cancelled: unloading"), ("shutting down", "cancelled: shutting down"),
                          ("cancelled", "cancelled"), ("engine error", "error: engine"),
                          ("unavailable", "error: unavailable"), ("internal", "error: internal")):
        if needle in m:
            return cause
    return "error: other"


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
