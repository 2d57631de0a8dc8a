"""Compiled grammars, cached by their text and compiled in a worker thread, never on the engine's step thread.

A chat application sends the same schema again and again: the second request finds its grammar in the cache
and is admitted at once. A new grammar is compiled by a worker while the request waits in the queue (it takes
no KV block until its grammar is ready); the engine polls the handle each step. The library is xgrammar (what
vLLM, SGLang and TensorRT-LLM use; docs/structured_output.md has the measurements that chose it).
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


class GrammarCache:
    """Thread-safe front of the compiler: request(spec) from the engine thread, compiles on `workers` threads.

    tokenizer_loader builds the tokenizer the library reads its vocabulary from; it runs once, in a worker (a
    Rust tokenizer object must not be shared with the threads that encode and decode). on_compiled(seconds,
    ok) is called from the worker after each compile (metrics; EngineMetrics locks); on_ready() once each
    compile's result is set, so an engine idle waiting on a grammar wakes up.
    """

    def __init__(self, tokenizer_loader: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 max_entries: int = 256, workers: int = 1,
                 on_compiled: Callable[[float, bool], None] | None = None):
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self.on_compiled = on_compiled
        self.on_ready: Callable[[], None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = collections.OrderedDict()
        self._compiler = None  # xgrammar.GrammarCompiler, made by the first compile
        self._compiler_lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    # ---- the engine thread ----------------------------------------------------------------------
    def request(self, spec: GrammarSpec) -> GrammarHandle:
        """A handle on the spec's compiled grammar: from the cache (compiled, or still compiling for an earlier
        request), else a compile is started."""
        with self._lock:
            future = self._entries.get(spec)
            if future is not None:
                self._entries.move_to_end(spec)
                self.num_hits += 1
                return GrammarHandle(spec, future, cache_hit=True)
            self.num_misses += 1
            future = self._pool.submit(self._compile, spec)
            future.add_done_callback(self._done)  # runs once the result is set: the engine may take it
            self._entries[spec] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)  # the least recently used; its holders keep their handle
        return GrammarHandle(spec, future)

    def new_matcher(self, handle: GrammarHandle) -> Any:
        """A fresh matcher at the grammar's start (one per sample)."""
        import xgrammar as xgr
        return xgr.GrammarMatcher(handle.result().grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the workers ------------------------------------------------------------------------------
    def compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                t0 = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer_loader(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # Its own cache off: ours is keyed by the request's spec and counts hits for /metrics.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                log.info("grammar compiler ready (xgrammar, vocabulary %d) in %.0f ms", self.vocab_size,
                         (time.perf_counter() - t0) * 1e3)
            return self._compiler

    def _compile(self, spec: GrammarSpec) -> Compiled:
        t0 = time.perf_counter()
        try:
            compiled = Compiled(grammar=self._compile_with(self.compiler(), spec))
        except Exception as e:  # noqa: BLE001 - the library's reason goes to that client (and is cached too)
            compiled = Compiled(error=refusal(spec, library_reason(e)))
        compiled.seconds = time.perf_counter() - t0
        if self.on_compiled is not None:
            self.on_compiled(compiled.seconds, compiled.error is None)
        return compiled

    def _done(self, _: concurrent.futures.Future) -> None:
        if self.on_ready is not None:
            self.on_ready()

    @staticmethod
    def _compile_with(compiler: Any, spec: GrammarSpec) -> Any:
        if spec.kind == JSON_SCHEMA:
            return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
        if spec.kind == JSON_ANY:
            return compiler.compile_builtin_json_grammar()
        if spec.kind == REGEX:
            return compiler.compile_regex(spec.text)
        if spec.kind == CHOICE:
            return compiler.compile_grammar(_choice_grammar(json.loads(spec.text)))
        if spec.kind == EBNF:
            return compiler.compile_grammar(spec.text)
        if spec.kind == LARK:
            return compiler.compile_lark(spec.text)
        raise ValueError(f"grammar kind={spec.kind!r} is unknown")
