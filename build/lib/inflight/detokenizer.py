"""Incremental detokenization: each new output token costs a decode of a few tokens, multi-byte
characters are never split, and stop strings are found and cut across token boundaries."""
from __future__ import annotations

import logging

from .sequence import Sequence

try:
    from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
except ImportError:  # pragma: no cover - older tokenizers: the window code alone
    DecodeStream = None

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder yields for bytes that do not (yet) form a character


class IncrementalDetokenizer:
    """Turns a sequence's output tokens into seq.output_text, a few tokens at a time.

    State lives on the Sequence so it survives preemption. seq.detok_prefix_offset and
    seq.detok_read_offset index seq's *output* tokens (0 = first generated token): text for tokens
    before read_offset is already in output_text, and tokens from prefix_offset on are the window
    that gets decoded, the part before read_offset only as context so a token's text is rendered
    as it would be in the full decode. Only output tokens are decoded, so output_text converges
    on decode(output_token_ids), which finalize() makes exact.

    With a transformers fast tokenizer (and no clean-up pass), the same window rule runs inside the
    tokenizers library: a DecodeStream per sequence takes one call per token instead of two decodes
    and the slicing around them, and the offsets are kept as if the window code had run, so it takes
    over if the stream ever fails. stream=False forces the window code.

    Engine protocol per new token: prev = len(output_text); update(); find_stop(seq, prev) when the
    request has stop strings; at a finish without a stop-string match, finalize(); then take_delta().
    The tokenizer is used from the calling thread only (Rust tokenizers are not shareable).
    """

    def __init__(self, tokenizer, stream: bool = True):
        self.tokenizer = tokenizer
        self._decode = self._hf_decode
        self._backend = None
        # A transformers fast tokenizer decodes with its Rust backend and then, only when
        # clean_up_tokenization_spaces is set, runs a Python clean-up. Without that clean-up, calling the
        # backend directly returns the same string for a fifth of the cost.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
            self._decode = backend.decode
            if stream and DecodeStream is not None:
                self._backend = backend

    def _hf_decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def update(self, seq: Sequence) -> None:
        """Append the text of output tokens not yet rendered, holding back a trailing partial character."""
        base = len(seq.prompt_token_ids)
        tokens = seq.token_ids
        stream = seq.detok_stream
        if stream is None and self._backend is not None and seq.detok_num_fed == 0 and len(tokens) > base:
            stream = seq.detok_stream = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
        if stream:
            try:
                for i in range(base + seq.detok_num_fed, len(tokens)):
                    text = stream.step(self._backend, tokens[i])
                    seq.detok_num_fed += 1
                    if text is not None:
                        seq.output_text += text
                        seq.detok_prefix_offset = seq.detok_read_offset
                        seq.detok_read_offset = i + 1 - base
                return
            except Exception:  # noqa: BLE001 - whatever the stream refuses, the window code below renders
                log.warning("request %s: streaming decoder failed; decoding windows instead", seq.request_id,
                            exc_info=True)
                seq.detok_stream = False
        read_offset = seq.detok_read_offset
        if len(tokens) - base <= read_offset:
            return
        skip = seq.params.skip_special_tokens
        prefix, read = base + seq.detok_prefix_offset, base + read_offset
        prefix_text = self._decode(tokens[prefix:read], skip) if read > prefix else ""
        window_text = self._decode(tokens[prefix:], skip)
        # A trailing U+FFFD may be the first bytes of a character the next token completes: wait.
        # Otherwise the window ends on a character boundary and its text is final. (A special token
        # skipped by the decode adds no text; it simply stays in the window until something follows.)
        if len(window_text) > len(prefix_text) and window_text[-1] != _REPLACEMENT:
            seq.output_text += window_text[len(prefix_text):]
            seq.detok_prefix_offset = read_offset
            seq.detok_read_offset = len(tokens) - base

    def find_stop(self, seq: Sequence, prev_text_len: int) -> bool:
        """Cut output_text before the earliest stop string that ends in text added since prev_text_len.

        Only positions where a new match can start are searched (the last max(len(stop)) - 1 characters
        before prev_text_len, and what follows), so the cost does not grow with the output. The stop
        string itself is dropped (vLLM's default). Returns True when a stop string was found.
        """
        stops = seq.params.stop
        if not stops or len(seq.output_text) <= prev_text_len:
            return False
        text = seq.output_text
        longest = max(len(s) for s in stops)
        start = max(0, prev_text_len - longest + 1)
        cut = -1
        for stop in stops:
            at = text.find(stop, start)
            if at != -1 and (cut == -1 or at < cut):
                cut = at
        if cut == -1:
            return False
        seq.output_text = text[:cut]
        # Sent text never reaches into a stop string (take_delta holds it back), but clamp regardless.
        seq.num_text_sent = min(seq.num_text_sent, cut)
        return True

    def finalize(self, seq: Sequence) -> None:
        """At a finish without a stop-string match: output_text becomes the full decode of the output.

        This adds what update() held back (a trailing partial character decodes to U+FFFD, and
        trailing skipped-special context). If the revealed tail completes a stop string, the text is
        still cut there, so a stop string is never returned.
        """
        full = self._decode(seq.output_token_ids, seq.params.skip_special_tokens)
        sent = seq.output_text[:seq.num_text_sent]
        if not full.startswith(sent):
            # Only a tokenizer whose decode is not plain byte concatenation gets here. The full decode
            # wins for the final text; what was streamed cannot be taken back, so we resume after it.
            log.warning("request %s: streamed text diverged from the full decode at character %d",
                        seq.request_id, _common_prefix_len(sent, full))
        prev_len = min(len(seq.output_text), len(full))
        seq.output_text = full
        seq.detok_prefix_offset = seq.detok_read_offset = seq.num_output_tokens
        seq.detok_stream = False  # the text is whole: any later token goes through the window code
        self.find_stop(seq, prev_len)

    def take_delta(self, seq: Sequence, finished: bool) -> str:
        """The part of output_text not yet handed out; advances seq.num_text_sent.

        While unfinished, a request with stop strings keeps back its last max(len(stop)) - 1
        characters: they could be the start of a stop string that the next tokens complete.
        """
        end = len(seq.output_text)
        if not finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1
        if end <= seq.num_text_sent:
            return ""
        delta = seq.output_text[seq.num_text_sent:end]
        seq.num_text_sent = end
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
