"""A grammar compile process: reads the tokenizer's vocabulary, then compiles one spec at a time and writes back the
compiled grammar as xgrammar's JSON. Run as a script (`python compile_worker.py`) by grammar/compile_pool.py, which
kills it when a compile runs past its deadline; it imports nothing of ours.

Frames on stdin and stdout: an 8-byte big-endian length, then that many bytes. In: the TokenizerInfo JSON, then
one JSON object per job ({"kind", "text", "any_whitespace"}). Out: b"ready" once, then per job b"G" + the compiled
grammar's JSON, or b"E" + the library's error text.
"""
from __future__ import annotations

import json
import sys
import types


def _read(stream) -> bytes | None:
    head = stream.read(8)
    if len(head) < 8:
        return None  # the engine closed the pipe (or died): nothing more to do
    size = int.from_bytes(head, "big")
    data = stream.read(size)
    return data if len(data) == size else None


def _write(stream, data: bytes) -> None:
    stream.write(len(data).to_bytes(8, "big") + data)
    stream.flush()


def _die_with_parent() -> None:
    """SIGKILL this process when the engine's process ends, even in the middle of a compile (Linux only)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _import_compiler():
    """xgrammar's compiler without torch and transformers. The package imports both at its top (for its token
    matcher and its Hugging Face reader, neither used here): 185 MB of private memory and ~2 s per process, against
    35 MB and 0.4 s without. tvm_ffi imports torch only where it can; transformers is read only by
    TokenizerInfo.from_huggingface, which runs in the engine's process, not here."""
    import importlib.util
    sys.modules["torch"] = None  # type: ignore[assignment]
    placeholder = types.ModuleType("transformers")
    placeholder.PreTrainedTokenizerBase = placeholder.PreTrainedTokenizerFast = type("NotLoadedHere", (), {})
    sys.modules["transformers"] = placeholder
    package = types.ModuleType("xgrammar")  # its submodules, without its __init__
    package.__path__ = list(importlib.util.find_spec("xgrammar").submodule_search_locations)
    sys.modules["xgrammar"] = package
    import xgrammar.load_binding  # noqa: F401 - registers the native types before any module uses them
    from xgrammar.compiler import GrammarCompiler
    from xgrammar.tokenizer_info import TokenizerInfo
    return GrammarCompiler, TokenizerInfo


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this class, which lets raw control
# characters through (a tab, U+0000-U+001F): JSON allows none in a string. Its other strings exclude them.
_LENGTH_CHARACTERS, _JSON_CHARACTERS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def json_schema_grammar(text: str, any_ws: bool) -> str:
    """The EBNF grammar xgrammar writes for a JSON schema, its length-bounded strings without control characters."""
    from xgrammar.grammar import Grammar
    return str(Grammar.from_json_schema(text, any_whitespace=any_ws)).replace(_LENGTH_CHARACTERS, _JSON_CHARACTERS)


def _compile(compiler, job: dict):
    kind, text, any_ws = job["kind"], job["text"], job["any_whitespace"]
    if kind == "json_schema":
        return compiler.compile_grammar(json_schema_grammar(text, any_ws))
    if kind == "builtin_json":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "lark":
        return compiler.compile_lark(text)
    raise ValueError(f"grammar kind={kind!r} is unknown")


def main() -> int:
    _die_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    GrammarCompiler, TokenizerInfo = _import_compiler()
    info = _read(stdin)
    if info is None:
        return 1
    compiler = GrammarCompiler(TokenizerInfo.deserialize_json(info.decode()), max_threads=1, cache_enabled=False)
    _write(stdout, b"ready")
    while (frame := _read(stdin)) is not None:
        try:
            reply = b"G" + _compile(compiler, json.loads(frame)).serialize_json().encode()
        except Exception as e:  # noqa: BLE001 - the library's reason goes back to the request
            reply = b"E" + (str(e) or type(e).__name__).encode()
        _write(stdout, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
