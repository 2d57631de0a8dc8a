"""Compiled grammars, cached by their text and compiled in worker processes, never on the engine's step thread.

A chat application sends the same schema again and again: the second request finds its grammar in the cache
and is admitted at once. A new grammar is compiled by a worker process while the request waits in the queue (it
takes no KV block until its grammar is ready); the engine polls the handle each step. A compile past its deadline
is killed and its spec stays cached as refused, so sending it again costs nothing (grammar/compile_pool.py has the
lanes that keep cheap grammars from waiting behind costly ones). The library is xgrammar (what vLLM, SGLang and
TensorRT-LLM use; docs/structured_output.md has the measurements that chose it).
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..fields import Shown, refuse
from .compile_pool import ERROR, EXPIRED, GRAMMAR, TIMED_OUT, CompileJob, CompilePool, Outcome
from .spec import CHOICE, EBNF, JSON_ANY, JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, GrammarSpec

log = logging.getLogger(__name__)

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the client needs the reason after it.
_LIBRARY_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


@dataclass
class Compiled:
    """A finished compile: the grammar, or the client-facing reason it could not be compiled."""
    grammar: Any = None  # xgrammar.CompiledGrammar
    error: str | None = None
    seconds: float = 0.0
    timed_out: bool = False  # killed at grammar_compile_timeout_ms (or waited that long for a worker)


@dataclass
class GrammarHandle:
    """One request's grammar: done when its compile is (at once on a cache hit)."""
    spec: GrammarSpec
    future: concurrent.futures.Future
    requested_at: float = field(default_factory=time.monotonic)
    cache_hit: bool = False

    @property
    def is_ready(self) -> bool:
        return self.future.done()

    def result(self) -> Compiled:
        return self.future.result()


def library_reason(error: BaseException) -> str:
    """The library's own words, without its source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _LIBRARY_PREFIX.sub("", text)


def refusal(spec: GrammarSpec, reason: str) -> str:
    """The client's message for a grammar that cannot be compiled, in the contract's form (field=value ...)."""
    shown = spec.text if spec.text else Shown(f"<{spec.kind}>")
    return str(refuse(spec.source, shown, f"a constraint xgrammar can compile ({reason})", "is invalid"))


def _choice_grammar(choices: list[str]) -> str:
    # JSON's string escapes are what xgrammar's EBNF literals take (\", \\, \n, \uXXXX); raw UTF-8 otherwise.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def worker_request(spec: GrammarSpec) -> bytes:
    """The compile worker's job for a spec (grammar/compile_worker.py)."""
    kind, text = spec.kind, spec.text
    if spec.kind == JSON_OBJECT:
        kind, text = JSON_SCHEMA, '{"type": "object"}'
    elif spec.kind == JSON_ANY:
        kind = "builtin_json"
    elif spec.kind == CHOICE:
        kind, text = EBNF, _choice_grammar(json.loads(spec.text))
    elif spec.kind not in (JSON_SCHEMA, REGEX, EBNF, LARK):
        raise ValueError(f"grammar kind={spec.kind!r} is unknown")
    return json.dumps({"kind": kind, "text": text, "any_whitespace": spec.any_whitespace}).encode()


class GrammarCache:
    """Thread-safe front of the compiler: request(spec) from the engine thread; compiles in a CompilePool.

    tokenizer_loader builds the tokenizer the library reads its vocabulary from; it runs once, in a lane's thread (a
    Rust tokenizer object must not be shared with the threads that encode and decode). timeout_ms: a compile still
    running this long after its first request is killed and the spec cached as refused. on_compiled(seconds, ok) is
    called from a lane's thread after each compile (metrics; EngineMetrics locks); on_ready() once each compile's
    result is set, so an engine idle waiting on a grammar wakes up.
    """

    def __init__(self, tokenizer_loader: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 max_entries: int = 256, timeout_ms: int = 10_000,
                 on_compiled: Callable[[float, bool], None] | None = None):
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self.timeout_ms = timeout_ms
        self.on_compiled = on_compiled
        self.on_ready: Callable[[], None] | None = None
        self.pool = CompilePool(self._tokenizer_info_json, self._finish)
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = collections.OrderedDict()
        self._info = None  # xgrammar.TokenizerInfo, made by the first compile
        self._info_json: bytes | None = None
        self._info_lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    # ---- the engine thread ----------------------------------------------------------------------
    def request(self, spec: GrammarSpec) -> GrammarHandle:
        """A handle on the spec's compiled grammar: from the cache (compiled, refused, or still compiling for an
        earlier request), else a compile is started."""
        with self._lock:
            future = self._entries.get(spec)
            if future is not None:
                self._entries.move_to_end(spec)
                self.num_hits += 1
                return GrammarHandle(spec, future, cache_hit=True)
            self.num_misses += 1
            future = concurrent.futures.Future()
            future.add_done_callback(self._done)  # runs once the result is set: the engine may take it
            self._entries[spec] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)  # the least recently used; its holders keep their handle
        handle = GrammarHandle(spec, future)
        self.pool.submit(CompileJob(spec, worker_request(spec), future,
                                    handle.requested_at + self.timeout_ms / 1000.0, spec.cost.is_light))
        return handle

    def new_matcher(self, handle: GrammarHandle) -> Any:
        """A fresh matcher at the grammar's start (one per sample)."""
        import xgrammar as xgr
        return xgr.GrammarMatcher(handle.result().grammar)

    def warm_up(self) -> None:
        """Read the vocabulary and start the compile processes now (about a second and a half on CPU) instead of
        at the first compile."""
        self._tokenizer_info_json()
        self.pool.start()

    def close(self) -> None:
        """End every compile and its processes; a later request starts new ones."""
        closed, self.pool = self.pool, CompilePool(self._tokenizer_info_json, self._finish)
        closed.close()

    # ---- the lanes' threads -----------------------------------------------------------------------
    def _tokenizer_info_json(self) -> bytes:
        with self._info_lock:
            if self._info_json is None:
                import xgrammar as xgr
                t0 = time.perf_counter()
                self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer_loader(), vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids)
                self._info_json = self._info.serialize_json().encode()
                log.info("grammar vocabulary ready (xgrammar, %d tokens) in %.0f ms", self.vocab_size,
                         (time.perf_counter() - t0) * 1e3)
            return self._info_json

    def _finish(self, job: CompileJob, outcome: Outcome) -> None:
        """A job's outcome -> its Compiled. What ran past its deadline stays cached as refused; what only waited past
        it for a worker, or was cut by close(), is forgotten, so the next request compiles it afresh."""
        spec = job.spec
        if outcome.kind == GRAMMAR:
            try:
                import xgrammar as xgr
                compiled = Compiled(grammar=xgr.CompiledGrammar.deserialize_json(outcome.payload.decode(), self._info))
            except Exception as e:  # noqa: BLE001 - e.g. a worker of another xgrammar version
                compiled = Compiled(error=refusal(spec, library_reason(e)))
        elif outcome.kind == ERROR:
            reason = library_reason(Exception(outcome.payload.decode(errors="replace")))
            compiled = Compiled(error=refusal(spec, reason))
        elif outcome.kind == TIMED_OUT:
            compiled = Compiled(error=timeout_refusal(spec, self.timeout_ms), timed_out=True)
        else:  # EXPIRED or CLOSED: nothing is known of the spec itself
            compiled = Compiled(error=(
                f"{spec.source} waited past grammar_compile_timeout_ms={self.timeout_ms} for a compile worker (busy "
                f"with other grammars); try again" if outcome.kind == EXPIRED else
                f"{spec.source} was not compiled: the engine is shutting down"), timed_out=outcome.kind == EXPIRED)
            with self._lock:
                if self._entries.get(spec) is job.future:
                    del self._entries[spec]
        compiled.seconds = outcome.seconds
        if self.on_compiled is not None and outcome.kind in (GRAMMAR, ERROR):  # a timeout is counted apart
            self.on_compiled(compiled.seconds, compiled.error is None)
        job.future.set_result(compiled)

    def _done(self, _: concurrent.futures.Future) -> None:
        if self.on_ready is not None:
            self.on_ready()


def timeout_refusal(spec: GrammarSpec, timeout_ms: int) -> str:
    return (f"{spec.source} is too costly to compile: its compile ran past grammar_compile_timeout_ms={timeout_ms}; "
            f"allowed a smaller schema, regex or grammar")
