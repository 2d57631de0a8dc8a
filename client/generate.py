#!/usr/bin/env python3
"""Stream completions from the `llm` model over gRPC and report TTFT and tokens/s per request.

  python client/generate.py "Why is the sky blue?"
  python client/generate.py --prompts-file prompts.txt --concurrency 8 --max-tokens 64
Ctrl-C cancels every request in flight (the server frees their KV blocks) and still prints the stats.
"""
from __future__ import annotations

import argparse
import json
import queue
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


# Our model ends its error messages with "(request id 'ID')"; Triton's own refusals start "[request id: ID]".
ERROR_ID = re.compile(r"\[request id: ([^\]]*)\]|.*\(request id '([^']*)'\)$", re.S)
NO_TEMPLATE = "this model has no chat template"


@dataclass
class Tracked:
    index: int
    prompt: str
    sent_at: float = 0.0
    first_at: float | None = None
    done_at: float | None = None
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate: tokens after the first over the time after the first."""
        if self.first_at is None or self.done_at is None or self.num_tokens < 2 or self.done_at <= self.first_at:
            return None
        return (self.num_tokens - 1) / (self.done_at - self.first_at)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="*", help="prompt text (several: one request each)")
    p.add_argument("--prompts-file", help="file with one prompt per line (blank lines skipped)")
    p.add_argument("--url", default="localhost:8001", help="gRPC address (default %(default)s)")
    p.add_argument("--model", default="llm", help="model name (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    p.add_argument("--no-stream", action="store_true", help="ask for one response per request")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as raw text (default: as a chat message, in the model's chat template, when "
                        "the model has one)")
    p.add_argument("--quiet", action="store_true", help="print only the stats")
    g = p.add_argument_group("sampling (omitted: the server's default)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--min-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--bad-word", action="append", default=[], help="banned word (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--include-input", action="store_true", help="echo the prompt before the output")
    g.add_argument("--priority", type=int, help="lower is served first")
    return p


def _tensor(name: str, value, datatype: str, batch_dim: bool = False) -> grpcclient.InferInput:
    if datatype == "BYTES":
        values = value if isinstance(value, list) else [value]
        array = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    else:
        array = np.array([value], dtype={"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64,
                                          "BOOL": np.bool_}[datatype])
    if batch_dim:  # a batching model (llm_iterative: max_batch_size > 0) takes [1, ...]
        array = array[None, ...]
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def build_inputs(prompt: str, args: argparse.Namespace) -> list[grpcclient.InferInput]:
    return [_tensor(*spec, args.batch_dim) for spec in _input_specs(prompt, args)]


def _input_specs(prompt: str, args: argparse.Namespace) -> list[tuple]:
    inputs = [("text_input", prompt, "BYTES"), ("stream", not args.no_stream, "BOOL"),
              ("return_num_output_tokens", True, "BOOL"), ("return_finish_reason", True, "BOOL"),
              ("apply_chat_template", not args.raw, "BOOL")]
    optional = [("max_tokens", args.max_tokens, "INT32"), ("min_tokens", args.min_tokens, "INT32"),
                ("temperature", args.temperature, "FP32"), ("top_p", args.top_p, "FP32"),
                ("top_k", args.top_k, "INT32"), ("seed", args.seed, "UINT64"),
                ("repetition_penalty", args.repetition_penalty, "FP32"),
                ("presence_penalty", args.presence_penalty, "FP32"),
                ("frequency_penalty", args.frequency_penalty, "FP32"), ("priority", args.priority, "INT32"),
                ("stop_words", args.stop or None, "BYTES"), ("bad_words", args.bad_word or None, "BYTES")]
    inputs += [(name, value, dt) for name, value, dt in optional if value is not None]
    if args.ignore_eos:
        inputs.append(("ignore_eos", True, "BOOL"))
    if args.include_input:
        inputs.append(("exclude_input_in_output", False, "BOOL"))
    return inputs


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    if not prompts:
        print("no prompt: give one as an argument or --prompts-file", file=sys.stderr)
        return 2
    if args.concurrency < 1:
        print(f"--concurrency={args.concurrency} is out of range: allowed >= 1", file=sys.stderr)
        return 2
    live = args.concurrency == 1 and not args.quiet  # interleaved tokens of several streams are unreadable
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    args.batch_dim = client.get_model_config(args.model).config.max_batch_size > 0
    # tritonclient calls the stream callback with keyword arguments result= and error=.
    client.start_stream(callback=lambda result=None, error=None: events.put((time.monotonic(), result, error)))
    tracked = [Tracked(i, p) for i, p in enumerate(prompts)]
    by_id = {f"gen-{t.index}": t for t in tracked}
    next_index, running = 0, 0
    started = time.monotonic()
    interrupted = False

    def send_next() -> None:
        nonlocal next_index, running
        t = tracked[next_index]
        next_index += 1
        running += 1
        t.sent_at = time.monotonic()
        client.async_stream_infer(args.model, build_inputs(t.prompt, args), request_id=f"gen-{t.index}")

    try:
        while next_index < len(tracked) and running < args.concurrency:
            send_next()
        while running:
            now, result, error = events.get()
            if result is None:
                # Errors on a gRPC stream come without the request id; the llm model puts it
                # at the end of the message. Anything else ends the oldest unfinished request.
                match = ERROR_ID.match(error.message() or "")
                t = by_id.get(match.group(1) or match.group(2)) if match else None
                if t is None or t.done_at is not None:
                    t = next(x for x in tracked if x.sent_at and x.done_at is None)
                if NO_TEMPLATE in (error.message() or ""):  # only a request sent as chat gets this: resend it raw
                    if not args.raw:
                        print("the model has no chat template: sending prompts as raw text", file=sys.stderr)
                    args.raw = True
                    t.sent_at = time.monotonic()
                    client.async_stream_infer(args.model, build_inputs(t.prompt, args), request_id=f"gen-{t.index}")
                    continue
                final = True
                t.error = error.message() or str(error)
            else:
                response = result.get_response()
                t = by_id[response.id]
                final = response.parameters["triton_final_response"].bool_param if \
                    "triton_final_response" in response.parameters else True
                if error is not None:
                    t.error = str(error)
                    final = True
                else:
                    # .reshape(-1): a batching model's outputs carry the batch dimension
                    piece = (result.as_numpy("text_output").reshape(-1)[0] or b"").decode("utf-8", errors="replace")
                    n = result.as_numpy("num_output_tokens")
                    t.num_tokens += int(n.reshape(-1)[0]) if n is not None else 0
                    reason = result.as_numpy("finish_reason")
                    if reason is not None and reason.reshape(-1)[0] != b"None":  # "None" until the last response
                        t.finish_reason = reason.reshape(-1)[0].decode()
                    if piece and t.first_at is None:
                        t.first_at = now
                    t.text.append(piece)
                    if live:
                        print(piece, end="", flush=True)
            if error is not None and t.error is None:
                t.error = str(error)
            if final:
                t.done_at = now
                running -= 1
                if t.first_at is None and t.text:
                    t.first_at = now
                if live:
                    print()
                elif not args.quiet:
                    print(f"--- [{t.index}] {t.prompt[:60]!r}\n{''.join(t.text)}")
                if t.error:
                    print(f"[{t.index}] error: {t.error}", file=sys.stderr)
                if next_index < len(tracked):
                    send_next()
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: cancelling the requests in flight", file=sys.stderr)
        now = time.monotonic()
        for t in tracked:
            if t.sent_at and t.done_at is None:
                t.done_at, t.finish_reason = now, "cancelled"
    finally:
        client.stop_stream(cancel_requests=interrupted)
        client.close()
    report(tracked, time.monotonic() - started)
    if interrupted:
        return 130
    return 1 if any(t.error for t in tracked) else 0


def report(tracked: list[Tracked], wall_s: float) -> None:
    done = [t for t in tracked if t.done_at is not None and not t.error and t.finish_reason != "cancelled"]
    print("\nrequest  tokens  finish    TTFT ms  tokens/s", file=sys.stderr)
    for t in tracked:
        ttft = f"{t.ttft * 1000:8.1f}" if t.ttft is not None else "       -"
        tps = f"{t.tokens_per_s:9.1f}" if t.tokens_per_s is not None else "        -"
        status = t.finish_reason or ("error" if t.error else "unfinished")
        print(f"{t.index:7d}  {t.num_tokens:6d}  {status:8s} {ttft}  {tps}", file=sys.stderr)
    total = sum(t.num_tokens for t in done)
    ttfts = [t.ttft for t in done if t.ttft is not None]
    summary = {"requests": len(tracked), "completed": len(done), "output_tokens": total,
               "wall_s": round(wall_s, 3), "output_tokens_per_s": round(total / wall_s, 2) if wall_s > 0 else None,
               "mean_ttft_ms": round(1000 * sum(ttfts) / len(ttfts), 1) if ttfts else None}
    print("aggregate: " + json.dumps(summary), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Ctrl-C arrives as KeyboardInterrupt in the main thread, which is where run() waits.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(args)
    except InferenceServerException as e:
        print(f"server error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
