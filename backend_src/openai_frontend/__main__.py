"""CLI: python -m openai_frontend --triton-grpc 127.0.0.1:8001 --host 127.0.0.1 --port 9000

TRITON_ADMIN_KEY in the environment: the admin key of a tritonserver that restricts its model-repository
protocol (as `make serve` does), needed to list models."""
from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from .app import create_app
from .reasoning import PARSERS


def _tokenizer_map(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--tokenizer {item!r}: expected MODEL=DIR")
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"--tokenizer {item!r}: {path} is not a directory")
        out[name] = os.path.abspath(path)
    return out


def _reasoning_parsers(items: list[str]) -> dict[str, str]:
    """--reasoning-parser values -> model name ("*": every model not named) -> parser name."""
    out = {}
    for item in items:
        model, sep, name = item.rpartition("=")
        if sep and not model or name not in PARSERS:
            raise ValueError(f"--reasoning-parser {item!r}: expected [MODEL=]PARSER, PARSER one of "
                             f"{', '.join(PARSERS)}")
        out[model if sep else "*"] = name
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    ap.add_argument("--triton-grpc", default="127.0.0.1:8001", help="tritonserver gRPC address")
    # Loopback by default: the API has no authentication of its own.
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=DIR",
                    help="tokenizer folder (chat template) of a model, when its config.pbtxt does not name one")
    ap.add_argument("--model-repository", default=None,
                    help="the server's model repository, to resolve relative model paths in config.pbtxt")
    ap.add_argument("--reasoning-parser", action="append", default=[], metavar="[MODEL=]PARSER",
                    help=f"split chat replies into reasoning and content (vLLM's option; {', '.join(PARSERS)}): "
                         "for MODEL, or for every model when no MODEL is given; off by default")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--access-log", action="store_true", help="log every HTTP request")
    args = ap.parse_args(argv)
    try:
        tokenizers = _tokenizer_map(args.tokenizer)
        reasoning = _reasoning_parsers(args.reasoning_parser)
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # From the environment, not argv, so the key does not show in `ps`.
    app = create_app(args.triton_grpc, tokenizers, args.model_repository, os.environ.get("TRITON_ADMIN_KEY"),
                     reasoning)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)


if __name__ == "__main__":
    main()
