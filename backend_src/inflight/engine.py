"""The engine: add_request / abort_request / step(), and the background loop thread that drives it."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .fields import BY_NAME, InvalidRequestError
from .grammar.bitmask import StepMask
from .grammar.compiler import GrammarCache
from .metrics import EngineMetrics
from .model_runner import ModelRunner
from .logprobs import top_logprobs
from .prompt import PromptEncoder
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import FinishReason, RequestOutput, SamplingParams, Sequence, SequenceStatus, TokenLogprobs
from .speculation import Speculator, num_accepted, verification_rows
from .tokenizer import load_tokenizer
from .step_timer import NULL_TIMER

log = logging.getLogger(__name__)

GAUGE_PERIOD_S = 0.05  # how often a busy engine refreshes its gauges (the exporter reads them every ~1 s)


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_size; the caller should retry later (HTTP 503 / UNAVAILABLE)."""


class LLMEngine:
    """Single-threaded core: every method but make_sequence must be called from one thread."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        # Two tokenizer objects: encoding runs in request threads, decoding in the engine thread,
        # and a Rust tokenizer object must not be used from two threads at once.
        self.tokenizer = load_tokenizer(config.model)
        self._decode_tokenizer = load_tokenizer(config.model)
        self.detokenizer = IncrementalDetokenizer(self._decode_tokenizer)
        self.scheduler = Scheduler(config, self.runner.num_blocks)
        self.sampler = Sampler(seed=config.seed)
        self.speculator = Speculator.from_config(config)  # None: no drafts (speculative_method)
        self.metrics = EngineMetrics(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
                                     config.num_speculative_tokens)
        eos = set(self.runner.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.prompts = PromptEncoder(self.tokenizer, config.max_model_len, config.max_prompt_bytes)
        self.seqs: dict[str, Sequence] = {}  # live sequences by id (a request's samples are sequences of their own)
        self.groups: dict[str, list[str]] = {}  # request id -> its live samples' sequence ids
        self._last_prefix = (0, 0)
        self._gauges_at = -1.0  # when the gauges were last set (time.monotonic)
        # Render text one step late, while the next forward runs, for requests whose finish needs no text (see
        # _render_deferred). Only where the forward runs asynchronously: on CPU it would only add a step of latency.
        self.defer_detokenize = self.runner.is_cuda
        self._deferred: dict[Sequence, int] = {}  # request -> its newest token, not rendered yet
        # Structured output: grammars compiled by worker processes (never this thread), cached by their text;
        # requests waiting for theirs, in arrival order; the step's bitmask of the constrained rows.
        vocab = self.runner.model_config.vocab_size
        # The vocabulary is read from a tokenizer object of its own, loaded as the engine's are.
        self.grammars = GrammarCache(lambda: load_tokenizer(config.model), vocab, sorted(eos),
                                     config.grammar_cache_entries, config.grammar_compile_timeout_ms,
                                     on_compiled=self.metrics.on_grammar_compile)
        self._awaiting_grammar: dict[Sequence, None] = {}
        self.step_mask = StepMask(vocab, sorted(eos))
        self.step_hook: Callable[[], None] | None = None  # tests inject faults here
        self.timer = NULL_TIMER  # a StepTimer while a benchmark measures phases: set_step_timer()
        self._update_gauges()  # the pool is whole from the start, not "0 free" until the first step

    @property
    def block_manager(self) -> BlockManager:
        """Read-only use (gauges, checks): the scheduler owns the pool and is the only one to change it."""
        return self.scheduler.bm

    # ---- requests ---------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                      priority: int = 0, arrival_time: float | None = None,
                      apply_chat_template: bool = False) -> Sequence:
        """Validate and tokenize; thread-safe (touches no engine state). Raises InvalidRequestError."""
        params = params or SamplingParams()
        priority = BY_NAME["priority"].parse(priority)
        if isinstance(prompt, str):
            prompt_ids = self.prompts.encode(prompt, chat=apply_chat_template)
        else:
            prompt_ids = list(prompt)
            vocab = self.runner.model_config.vocab_size
            bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]!r} is out of range: allowed [0, {vocab})")
        if not prompt_ids:
            raise InvalidRequestError("prompt has 0 tokens: allowed a prompt of at least 1 token")
        max_tokens = params.max_tokens or min(self.config.default_max_tokens,
                                              max(1, self.config.max_model_len - len(prompt_ids)))
        total = len(prompt_ids) + max_tokens
        if total > self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} = {total} is out of range: "
                f"allowed at most max_model_len={self.config.max_model_len}")
        blocks = self.block_manager.blocks_needed(total)
        if blocks > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} needs {blocks} KV blocks: "
                f"allowed at most the whole pool of {self.block_manager.num_blocks}")
        seq = Sequence(request_id, prompt_ids, params, max_tokens, priority, arrival_time,
                       prompt if isinstance(prompt, str) else None)
        seq.bad_word_ids = [self.tokenizer.encode(w) for w in params.bad_words] + \
            [self.tokenizer.encode(" " + w) for w in params.bad_words]
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise InvalidRequestError(f"request_id={seq.request_id!r} is already in flight: allowed a unique id")
        self.seqs[seq.request_id] = seq
        self.groups[seq.group_id] = [seq.request_id]
        if seq.params.grammar is not None:
            # Compiled by a worker (or found in the cache); the request waits in the queue, holding no KV block.
            seq.grammar = self.grammars.request(seq.params.grammar)
            self.metrics.on_grammar_request(seq.grammar.cache_hit)
            self._awaiting_grammar[seq] = None
        self.scheduler.add(seq)
        self.metrics.on_request(seq.params.n)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    apply_chat_template: bool = False) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params, priority, arrival_time, apply_chat_template)
        self.add_sequence(seq)
        return seq

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Cancel a live request, every sample of it: blocks are freed now and each final output says CANCELLED."""
        now = time.monotonic()
        outs = [self._finish(self.seqs[seq_id], FinishReason.CANCELLED, now)
                for seq_id in list(self.groups.get(request_id, ()))]
        self._update_gauges()  # an idle loop takes no further step that would refresh them
        return outs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an engine error: every live request gets an ERROR final and the pool is reset."""
        now = time.monotonic()
        outs = []
        for seq in list(self.seqs.values()):
            seq.error = message
            outs.append(self._finish(seq, FinishReason.ERROR, now))
        self._update_gauges()
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    def waits_only_for_grammars(self) -> bool:
        """Nothing can run until a grammar compiles: the loop should sleep, not spin (it is woken when one is)."""
        return bool(self._awaiting_grammar) and not self.scheduler.running and \
            all(seq.waits_for_grammar for seq in self.scheduler.waiting)

    def _check_grammars(self, now: float) -> list[RequestOutput]:
        """Give each waiting request whose grammar compiled its matcher; refuse those whose grammar could not be
        compiled or ran past grammar_compile_timeout_ms (INVALID_ARG, before any KV block was taken). The static
        arm first waits for its batch's grammars: its batch joins together or not at all."""
        if not self._awaiting_grammar:
            return []
        timeout_s = self.config.grammar_compile_timeout_ms / 1000.0
        if self.config.static_batching and not self.scheduler.running:
            pending = [s.grammar.future for s in self._awaiting_grammar if not s.grammar.is_ready]
            if pending:
                first = min(s.grammar.requested_at for s in self._awaiting_grammar)
                concurrent.futures.wait(pending, timeout=max(0.0, first + timeout_s - time.monotonic()))
                now = time.monotonic()
        outs = []
        for seq in list(self._awaiting_grammar):
            handle = seq.grammar
            if handle.is_ready:
                del self._awaiting_grammar[seq]
                compiled = handle.result()
                if compiled.error is None:
                    seq.grammar_matcher = self.grammars.new_matcher(handle)
                else:
                    outs.append(self._refuse(seq, compiled.error, now))
                    if compiled.timed_out:  # the pool stopped it at the deadline (this request's, or an earlier one's)
                        self.metrics.on_grammar_timeout()
            elif now - handle.requested_at > timeout_s:
                del self._awaiting_grammar[seq]
                spec = handle.spec
                outs.append(self._refuse(seq, (
                    f"{spec.source} is too costly to compile: its compile ran past grammar_compile_timeout_ms="
                    f"{self.config.grammar_compile_timeout_ms}; allowed a smaller schema, regex or grammar"), now))
                self.metrics.on_grammar_timeout()
        return outs

    def _refuse(self, seq: Sequence, message: str, now: float) -> RequestOutput:
        seq.error = message
        out = self._finish(seq, FinishReason.ERROR, now)
        out.refused = True
        return out

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def set_step_timer(self, timer) -> None:
        """Time each step's phases (inflight.step_timer.StepTimer); None turns it off."""
        self.timer = self.runner.timer = timer or NULL_TIMER

    # ---- one iteration ----------------------------------------------------------------------
    def step(self, members: set[Sequence] | None = None) -> list[RequestOutput]:
        """One iteration over the requests the scheduler picks, or over exactly `members` (live sequences) when
        the caller decides membership (the iterative-sequence arm: Triton hands each execute its requests)."""
        t0 = time.monotonic()
        timer = self.timer
        timer.start()
        refused = self._check_grammars(t0)
        if self.speculator is not None:  # drafts only for this step's members when Triton picks them
            candidates = self.scheduler.running if members is None else [
                s for s in self.scheduler.running if s in members]
            self.scheduler.speculating = self.speculator.propose(candidates)
        sched = self.scheduler.schedule(members)
        decode_rows = self.speculator.decode_rows(sched.scheduled) if self.speculator is not None else 0
        for _ in sched.preempted:
            self.metrics.on_preemption()
        if sched.is_empty:
            self._update_gauges()
            return refused
        for seq, _ in sched.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = t0
                self.metrics.on_scheduled(seq, t0)
                self.metrics.on_prompt_tokens(seq.num_prompt_tokens)
        if self.step_hook is not None:
            self.step_hook()
        timer.lap("schedule")
        if self.block_manager.pending_copies:  # copy-on-write of blocks that forked samples shared
            self.runner.copy_blocks(self.block_manager.pending_copies)
            self.block_manager.pending_copies = []
        logits, sample_seqs = self.runner.execute(sched.scheduled)
        # On CUDA the forward runs now (nothing above waited for it): host work up to the sampler's read of its
        # tokens overlaps it, so the step does not wait for that work.
        self.scheduler.advance(sched.scheduled)
        rendered = self._render_deferred()
        timer.lap("overlap")
        outputs = []
        checked: list[int] = []
        if sample_seqs:
            # The constrained rows' bitmask, applied in place: sampling and logprobs see the masked distribution.
            # On CPU the rows that can be are checked after sampling instead (`checked`; grammar/bitmask.py says
            # when that is exact). (Requests with a grammar never draft, so a drafted request's rows are left as
            # they are.)
            checked = self.step_mask.apply(logits, sample_seqs, check_first=not sched.drafted)
            timer.lap("mask")
        if sched.drafted:
            outputs = self._sample_and_verify(logits, sample_seqs, rendered)
            timer.lap("detokenize")
        elif sample_seqs:
            sampled = self.sampler(logits, sample_seqs, self.eos_token_ids)
            tokens, logprobs = list(sampled.token_ids), list(sampled.logprobs)
            if checked:
                timer.lap("sample")
                self.step_mask.settle(logits, sample_seqs, checked, tokens, logprobs, self.sampler, self.eos_token_ids)
                timer.lap("mask")
            if any(not seq.forked for seq in sample_seqs):
                logits, sample_seqs = self._fork_samples(logits, sample_seqs, tokens, logprobs)
            tops = self._top_logprobs(logits, sample_seqs, tokens)
            timer.lap("sample")
            outputs = self._on_tokens(sample_seqs, tokens, logprobs, tops, rendered)
            timer.lap("detokenize")  # with stop checks and per-token metrics: the per-token host work
        outputs[:0] = rendered.values()
        outputs[:0] = refused
        self._record_prefix_stats()
        now = time.monotonic()
        self.metrics.on_step(now - t0, sched.num_batched_tokens)
        if decode_rows:  # what the draft policy weighs drafts against (speculation/policy.py)
            self.speculator.record_step(decode_rows, now - t0)
        # Gauges are read about once a second and cost a pass over the running requests: a busy engine
        # refreshes them every GAUGE_PERIOD_S. A step after which nothing runs refreshes them, since the next
        # step may be a long way off.
        if now - self._gauges_at >= GAUGE_PERIOD_S or not self.scheduler.running:
            self._update_gauges()
        timer.end_step()
        return outputs

    def _fork_samples(self, logits, seqs: list[Sequence], tokens: list[int], logprobs: list[float]):
        """A request with n > 1 has just computed its prompt: start its other n - 1 samples now, sharing the
        prompt's KV blocks, each drawing its first token from the same logits row. Returns the logits and the
        sequences with the new samples' rows appended (tokens and logprobs are extended in place)."""
        rows, children = [], []
        for row, parent in enumerate(seqs):
            if parent.forked:
                continue
            parent.forked = True
            p = parent.params
            for i in range(1, p.n):
                # A seeded request's samples differ, and each is reproducible: sample i draws from seed + i.
                params = dataclasses.replace(p, seed=None if p.seed is None else (p.seed + i) % 2**64)
                child = Sequence(f"{parent.request_id}/{i}", parent.prompt_token_ids, params, parent.max_tokens,
                                 parent.priority, parent.arrival_time, parent.prompt)
                child.group_id, child.sample_index, child.forked = parent.group_id, i, True
                child.bad_word_ids = parent.bad_word_ids
                child.first_scheduled_time = parent.first_scheduled_time
                if parent.grammar is not None:  # its own matcher, at the start: it draws its first token now
                    child.grammar = parent.grammar
                    child.grammar_matcher = self.grammars.new_matcher(parent.grammar)
                self.scheduler.fork(parent, child)
                self.seqs[child.request_id] = child
                self.groups[parent.group_id].append(child.request_id)
                rows.append(row)
                children.append(child)
        if not children:
            return logits, seqs
        child_logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        sampled = self.sampler(child_logits, children, self.eos_token_ids)
        tokens += sampled.token_ids
        logprobs += sampled.logprobs
        return torch.cat([logits, child_logits]), seqs + children

    def _top_logprobs(self, logits, seqs: list[Sequence], tokens: list[int]) -> list:
        """Per row: the top-k entries (logprobs.top_logprobs) for rows that asked for logprobs, else None."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        tops: list = [None] * len(seqs)
        if rows:
            found = top_logprobs(logits, rows, [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows])
            for i, top in zip(rows, found):
                tops[i] = top
        return tops

    def _on_tokens(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float], tops: list,
                   rendered: dict[str, RequestOutput]) -> list[RequestOutput]:
        """Append each row's new token, check for a finish, and render its text (now, or next step: see
        _render_deferred): the per-token host work of a step. It runs for every running request every step,
        so it is one tight loop with few calls. A sample that finishes takes its entry out of `rendered`."""
        now = time.monotonic()
        first_token_waits, gaps = [], []
        for seq, token, logprob in zip(seqs, token_ids, logprobs):
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
            if seq.last_token_time is None:
                seq.first_token_time = now
                first_token_waits.append(now - seq.arrival_time)
            else:
                gaps.append(now - seq.last_token_time)
            seq.last_token_time = now
        self.metrics.on_step_tokens(first_token_waits, gaps)

        detok, max_len, defer = self.detokenizer, self.config.max_model_len, self.defer_detokenize
        outputs = []
        for seq, token, logprob, top in zip(seqs, token_ids, logprobs, tops):
            params = seq.params
            stop_string_matched = False
            token_logprobs = None
            # Text is needed now for a stop string (it may end the request at this token) and for logprobs
            # (they carry the token's text); otherwise it may wait for the next step.
            render_now = bool(params.stop) or top is not None or not defer
            if render_now:
                prev_len = len(seq.output_text)
                detok.update(seq)
                if top is not None:
                    # The sampled token's text is what it added to the output; the others' are decoded alone.
                    texts = {t: seq.output_text[prev_len:] if t == token else detok.tokenizer.decode([t])
                             for t in top}
                    token_logprobs = [TokenLogprobs(token, logprob,
                                                    {t: (lp, rank, texts[t]) for t, (lp, rank) in top.items()})]
                stop_string_matched = bool(params.stop) and detok.find_stop(seq, prev_len)
            grammar_done = False
            matcher = seq.grammar_matcher
            if matcher is not None:
                if not matcher.accept_token(token):  # the mask allowed it: only a bug (or a fully banned row) gets here
                    seq.error = f"internal error: the grammar refused token {token} that the step's mask allowed"
                    outputs.append(self._finish(seq, FinishReason.ERROR, now, [token], False, token_logprobs,
                                                rendered.pop(seq.request_id, None)))
                    continue
                grammar_done = matcher.is_terminated()
            reason = self._finish_reason(seq, token, stop_string_matched, grammar_done, max_len)
            if reason is None:
                if not render_now:
                    self._deferred[seq] = token
                    continue
                num_prompt = len(seq.prompt_token_ids)
                outputs.append(RequestOutput(seq.group_id, [token], detok.take_delta(seq, False), False, None,
                                             num_prompt, len(seq.token_ids) - num_prompt, seq.cumulative_logprob,
                                             None, token_logprobs, seq.sample_index,
                                             num_cached_tokens=seq.num_cached_tokens))
                continue
            outputs.append(self._finish(seq, reason, now, [token], stop_string_matched, token_logprobs,
                                        rendered.pop(seq.request_id, None)))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int, stop_string_matched: bool, grammar_done: bool,
                       max_len: int) -> FinishReason | None:
        """Why the token just appended ends the sample, or None: a stop string, EOS (or end_id) unless ignored,
        a stop token id, the grammar's end (it took its stop token: complete, also with ignore_eos), max_tokens or
        max_model_len."""
        params = seq.params
        if stop_string_matched:
            return FinishReason.STOP
        if token in (self.eos_token_ids if params.end_id is None else (params.end_id,)) and not params.ignore_eos:
            return FinishReason.EOS
        if params.stop_token_ids and token in params.stop_token_ids:
            return FinishReason.STOP
        if grammar_done:
            return FinishReason.STOP
        num_tokens = len(seq.token_ids)
        if num_tokens - len(seq.prompt_token_ids) >= seq.max_tokens or num_tokens >= max_len:
            return FinishReason.LENGTH
        return None

    def _sample_and_verify(self, logits, sample_seqs: list[Sequence],
                           rendered: dict[str, RequestOutput]) -> list[RequestOutput]:
        """Sampling in a step where some rows verify drafts (speculation/verify.py): a drafted sequence has
        len(drafts) + 1 consecutive rows, each sampled as a plain decode at its position would be, in one sampler
        pass with every other row. Other rows go on as in step()."""
        rows: list = []
        groups: list[tuple[Sequence, int]] = []  # (drafted sequence, its first row)
        i = 0
        while i < len(sample_seqs):
            seq = sample_seqs[i]
            if seq.spec_token_ids:
                groups.append((seq, len(rows)))
                rows += verification_rows(seq, seq.spec_token_ids)
                i += len(seq.spec_token_ids) + 1
            else:
                rows.append(seq)
                i += 1
        sampled = self.sampler(logits, rows, self.eos_token_ids)
        tokens, logprobs = list(sampled.token_ids), list(sampled.logprobs)
        if any(not seq.forked for seq in rows):
            logits, rows = self._fork_samples(logits, rows, tokens, logprobs)
        tops = self._top_logprobs(logits, rows, tokens)
        verifying = set()
        for seq, first in groups:
            verifying.update(range(first, first + len(seq.spec_token_ids) + 1))
        plain = [i for i in range(len(rows)) if i not in verifying]
        outputs = self._on_tokens([rows[i] for i in plain], [tokens[i] for i in plain], [logprobs[i] for i in plain],
                                  [tops[i] for i in plain], rendered)
        return outputs + self._on_draft_tokens(groups, tokens, logprobs, tops, rendered)

    def _on_draft_tokens(self, groups: list[tuple[Sequence, int]], tokens: list[int], logprobs: list[float],
                         tops: list, rendered: dict[str, RequestOutput]) -> list[RequestOutput]:
        """Per drafted sequence: the accepted drafts and the token after them, appended one at a time with the
        checks _on_tokens makes, so a stop string, EOS, a stop token or the length limit ends the sample at the same
        token as without drafts and nothing past it is kept; then the rejected drafts are rolled back. One output
        per sample; the tokens that arrived together share the gap since the last."""
        now = time.monotonic()
        detok, max_len = self.detokenizer, self.config.max_model_len
        outputs, gaps = [], []
        per_position = [0] * self.config.num_speculative_tokens
        num_draft_tokens = num_accepted_total = 0
        for seq, first in groups:
            drafts, params = seq.spec_token_ids, seq.params
            accepted = num_accepted(drafts, tokens[first:first + len(drafts) + 1])
            self.speculator.observe(seq, len(drafts), accepted)
            num_draft_tokens += len(drafts)
            num_accepted_total += accepted
            for pos in range(accepted):
                per_position[pos] += 1
            emitted: list[int] = []
            token_logprobs: list[TokenLogprobs] | None = None
            reason, stop_string_matched = None, False
            for row in range(first, first + accepted + 1):
                token, top = tokens[row], tops[row]
                seq.token_ids.append(token)
                seq.cumulative_logprob += logprobs[row]
                emitted.append(token)
                if params.stop or top is not None:
                    prev_len = len(seq.output_text)
                    detok.update(seq)
                    if top is not None:
                        texts = {t: seq.output_text[prev_len:] if t == token else detok.tokenizer.decode([t])
                                 for t in top}
                        token_logprobs = (token_logprobs or []) + [TokenLogprobs(
                            token, logprobs[row], {t: (lp, rank, texts[t]) for t, (lp, rank) in top.items()})]
                    stop_string_matched = bool(params.stop) and detok.find_stop(seq, prev_len)
                reason = self._finish_reason(seq, token, stop_string_matched, False, max_len)  # no grammar: no drafts
                if reason is not None:
                    break
            gaps += [(now - seq.last_token_time) / len(emitted)] * len(emitted)
            seq.last_token_time = now
            previous = rendered.pop(seq.request_id, None)  # the last step's token, rendered late (CUDA)
            if reason is not None:
                outputs.append(self._finish(seq, reason, now, emitted, stop_string_matched, token_logprobs, previous))
                continue
            self.scheduler.commit_drafts(seq, len(emitted) - 1)
            detok.update(seq)
            text = detok.take_delta(seq, False)
            if previous is not None:
                emitted, text = previous.new_token_ids + emitted, previous.text_delta + text
            num_prompt = len(seq.prompt_token_ids)
            outputs.append(RequestOutput(seq.group_id, emitted, text, False, None, num_prompt,
                                         len(seq.token_ids) - num_prompt, seq.cumulative_logprob, None,
                                         token_logprobs, seq.sample_index,
                                         num_cached_tokens=seq.num_cached_tokens))
        self.metrics.on_step_tokens([], gaps)
        self.metrics.on_spec_decode(len(groups), num_draft_tokens, num_accepted_total, per_position)
        return outputs

    def _render_deferred(self) -> dict[str, RequestOutput]:
        """Outputs for the tokens whose text was put off last step, by sample (Sequence.request_id).

        With defer_detokenize (CUDA), a request without stop strings or logprobs has nothing in its finish
        decision or output that needs the new token's text now (EOS, stop token ids and length are token
        checks), so rendering it waits for the next step, where it runs while that step's forward does: its
        output arrives one step later, and the step's critical path loses the detokenizer. Text and tokens
        are those an immediate rendering gives.
        """
        deferred, self._deferred = self._deferred, {}
        detok = self.detokenizer
        rendered = {}
        for seq, token in deferred.items():
            detok.update(seq)
            num_prompt = len(seq.prompt_token_ids)
            rendered[seq.request_id] = RequestOutput(
                seq.group_id, [token], detok.take_delta(seq, False), False, None, num_prompt,
                len(seq.token_ids) - num_prompt, seq.cumulative_logprob, None, None, seq.sample_index,
                num_cached_tokens=seq.num_cached_tokens)
        return rendered

    def _finish(self, seq: Sequence, reason: FinishReason, now: float, new_token_ids: list[int] | None = None,
                stop_string_matched: bool = False, logprobs: list | None = None,
                rendered: RequestOutput | None = None) -> RequestOutput:
        """The final output. It also carries a token whose rendering was deferred (finalize renders it) and,
        when given, the output rendered for the previous token this step, so a sample gets one output a step."""
        token_ids = new_token_ids or []
        deferred = self._deferred.pop(seq, None)
        if deferred is not None:
            token_ids = [deferred, *token_ids]
        text = ""
        if rendered is not None:
            token_ids, text = rendered.new_token_ids + token_ids, rendered.text_delta
        if not stop_string_matched:  # the text was cut at the stop string: finalize would restore it
            self.detokenizer.finalize(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        self._awaiting_grammar.pop(seq, None)
        seq.grammar_matcher = None
        num_cached = seq.num_cached_tokens  # freeing the blocks below zeroes it
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        del self.seqs[seq.request_id]
        samples = self.groups[seq.group_id]
        samples.remove(seq.request_id)
        if not samples:
            del self.groups[seq.group_id]
        self.metrics.on_finish(seq, now)
        return RequestOutput(seq.group_id, token_ids, text + self.detokenizer.take_delta(seq, finished=True),
                             True, reason, seq.num_prompt_tokens, seq.num_output_tokens, seq.cumulative_logprob,
                             seq.error, logprobs, seq.sample_index, num_cached_tokens=num_cached)

    def _record_prefix_stats(self) -> None:
        bm = self.block_manager
        q0, h0 = self._last_prefix
        if bm.prefix_queries != q0:
            self.metrics.on_prefix_lookup(bm.prefix_queries - q0, bm.prefix_hits - h0)
            self._last_prefix = (bm.prefix_queries, bm.prefix_hits)

    def _update_gauges(self) -> None:
        self._gauges_at = time.monotonic()
        bm, sch = self.block_manager, self.scheduler
        self.metrics.set_gauges(
            num_requests_running=len(sch.running),
            num_requests_waiting=len(sch.waiting),
            num_requests_preempted=sum(1 for s in sch.waiting if s.status == SequenceStatus.PREEMPTED),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
            kv_internal_waste=bm.internal_waste(sch.running),
        )


class EngineLoop:
    """Owns the engine thread: steps while there is work, sleeps when idle, applies adds/aborts between
    steps. `on_outputs` is called from the engine thread with each step's outputs (keep it quick)."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 idle_wait_s: float = 0.05):
        self.engine = engine
        self.on_outputs = on_outputs
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self.num_engine_errors = 0

    def start(self) -> None:
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + self.engine.num_waiting

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, apply_chat_template: bool = False) -> None:
        """Validate here, in the caller's thread (errors go to that caller only), then hand over."""
        if self._stopping.is_set():
            raise QueueFullError("engine is shutting down")
        if self.num_waiting >= self.engine.config.max_queue_size:
            self.engine.metrics.on_queue_full()
            raise QueueFullError(f"queue is full: {self.num_waiting} waiting, "
                                 f"max_queue_size={self.engine.config.max_queue_size}")
        seq = self.engine.make_sequence(request_id, prompt, params, priority, apply_chat_template=apply_chat_template)
        self._inbox.put(("add", seq))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop stepping; every request still in flight gets a CANCELLED final through on_outputs."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout_s)
        self.engine.grammars.close()  # its compile processes (they also end with this process)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        outs = []
        while True:
            kind, payload = item
            if kind == "add":
                try:
                    self.engine.add_sequence(payload)
                except InvalidRequestError as e:  # duplicate id: only this request fails
                    outs.append(RequestOutput(payload.request_id, [], "", True, FinishReason.ERROR, error=str(e)))
            elif kind == "abort":
                outs += self.engine.abort_request(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        if outs:
            self._deliver(outs)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        try:
            self.on_outputs(outs)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine thread
            log.exception("on_outputs callback failed")

    def _run(self) -> None:
        # A compiled grammar wakes the loop: a request that waited for it may now be admitted.
        self.engine.grammars.on_ready = lambda: self._inbox.put(("wake", None))
        while not self._stopping.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished_requests() or self.engine.waits_only_for_grammars())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - any engine fault must end requests, not the server
                self.num_engine_errors += 1
                log.exception("engine step failed; failing all in-flight requests")
                outs = self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")
            if outs:
                self._deliver(outs)
        # Shutdown: whatever is still queued or running gets its final response.
        self._drain_inbox(block=False)
        outs = [o for rid in list(self.engine.groups) for o in self.engine.abort_request(rid)]
        if outs:
            self._deliver(outs)
