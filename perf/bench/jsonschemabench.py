"""JSONSchemaBench (guidance-ai/jsonschemabench) through our structured output.

A seeded sample of its schemas, from every category, goes through the spec parser (refusals counted by reason); the
accepted ones are compiled by GrammarCache over a model's vocabulary, and the compiled ones generate greedily with
the offline engine. Each output is checked with the `jsonschema` package against the schema as written: valid, cut
by max_tokens (then its tokens must be a prefix the grammar's matcher accepts), or invalid (the target is 0).
With --walks K, each compiled grammar is also walked K times at random over a byte vocabulary (any string the
grammar allows can come out, not only what a model prefers) and each walk checked the same way.

    .venv/bin/python -m perf.bench.jsonschemabench --data /work/shared/jsonschemabench/data \\
        [--sample 400] [--seed 0] [--model models/SmolLM2-135M-Instruct] [--max-tokens 96] [--walks 3] [--out DIR]

The data is the repository's data/<category>/*.json (not part of this project). --out DIR writes summary.json
(figures, CPU, load average), rows.json and rows.csv (each schema's way). --floor 0 gives a purely proportional
sample of exactly --sample schemas.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.validators import validator_for

from inflight.fields import BY_NAME, InvalidRequestError, RequestLimits
from inflight.grammar.compile_worker import json_schema_grammar
from inflight.grammar.schema_rewrite import FORMAT_PATTERNS, GRAMMAR_FORMATS
from inflight.grammar.spec import GrammarSpec, from_structured_outputs

from server_harness.host import cpuinfo_field

LIMITS = RequestLimits()  # the server's defaults
# What the parser refused, by the start of its message: the class a refusal is counted under.
_KEYWORD = re.compile(r"schema keyword '([^']+)' at \S+ is not supported: (.*)")


@dataclass
class Row:
    """One schema's way through the benchmark."""
    path: str
    category: str
    stage: str = "parsed"  # refused, compile_error, compiled
    reason: str = ""  # a refusal's class, or the compile error
    message: str = ""
    compile_s: float | None = None
    output: str = ""  # valid, cut, invalid (generation)
    output_detail: str = ""
    walks: dict[str, int] = field(default_factory=dict)  # valid / invalid / unfinished random walks
    walk_failure: str = ""
    annotation_formats: str = ""  # a valid output that misses a format the server takes as an annotation


def load(data: Path) -> dict[str, list[Path]]:
    return {d.name: sorted(d.glob("*.json")) for d in sorted(data.iterdir()) if d.is_dir()}


def sample(by_category: dict[str, list[Path]], total: int, seed: int, floor: int) -> list[Path]:
    """`total` schemas: each category in proportion to its size, at least `floor` of each (all of a smaller one)."""
    rng = random.Random(seed)
    size = sum(len(files) for files in by_category.values())
    picked = []
    for files in by_category.values():
        n = min(len(files), max(floor, round(total * len(files) / size)))
        picked += rng.sample(files, n)
    return picked


def refusal_class(message: str) -> str:
    """A refusal message -> the row of the refusal table."""
    if "bytes" in message and message.startswith("structured_outputs="):
        return f"size cap (max_grammar_bytes {LIMITS.max_grammar_bytes >> 10} KiB)"
    if "too costly to compile" in message:
        return "compile-cost budget (grammar/cost.py MAX_UNITS)"
    if re.search(r"'(minLength|maxLength)' at \S+ beside", message) or "beside 'format': the grammar would" in message:
        return "minLength/maxLength beside pattern or format"
    found = _KEYWORD.search(message)
    if found is None:
        return message[:80]
    keyword, why = found.groups()
    why = re.sub(r"'[^']*'", "'…'", why)  # the reason, not the value it names
    return f"{keyword}: {why.split(':')[0][:70]}"


def parse(row: Row, schema: Any) -> GrammarSpec | None:
    """The spec the server would make of {"structured_outputs": {"json": schema}} (its size caps included)."""
    try:
        return from_structured_outputs(BY_NAME["structured_outputs"].parse({"json": schema}, limits=LIMITS))
    except InvalidRequestError as e:
        row.stage, row.message = "refused", str(e)
        row.reason = refusal_class(row.message)
        return None


# The formats the server enforces (docs/structured_output.md); the others are annotations there, as JSON Schema
# allows, and are checked apart (`annotation_formats`), not counted as invalid.
ENFORCED_FORMATS = GRAMMAR_FORMATS | set(FORMAT_PATTERNS)


def validator(schema: Any, formats: str = "enforced") -> Any:
    """The schema's own draft ($schema), else 2020-12; formats checked where jsonschema has a checker for them:
    those the server enforces, or ("all") every one."""
    cls = validator_for(schema, default=Draft202012Validator)
    known = cls.FORMAT_CHECKER.checkers
    checker = FormatChecker(formats=[f for f in known if formats == "all" or f in ENFORCED_FORMATS])
    return cls(schema, format_checker=checker)


def check(schema: Any, text: str, formats: str = "enforced") -> str:
    """'' when `text` is valid JSON for the schema, else why not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    error = next(iter(validator(schema, formats).iter_errors(value)), None)
    return "" if error is None else f"{error.message[:160]} at {'/'.join(map(str, error.absolute_path))}"


def compile_all(rows: list[Row], specs: dict[str, GrammarSpec], model: str, timeout_ms: int) -> dict[str, Any]:
    """Every accepted spec through one GrammarCache (SmolLM2's vocabulary by default): path -> handle."""
    from inflight.grammar.compiler import GrammarCache
    from inflight.model.config import ModelConfig
    from inflight.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(model)
    cache = GrammarCache(lambda: load_tokenizer(model), ModelConfig.from_path(model).vocab_size,
                         [tokenizer.eos_token_id], timeout_ms=timeout_ms)
    cache.warm_up()
    handles = {}
    for row in rows:
        if row.path in specs:  # one at a time: each has grammar_compile_timeout_ms of its own, as a lone client
            handles[row.path] = cache.request(specs[row.path])
            compiled = handles[row.path].result()
            row.compile_s = round(compiled.seconds, 3)
            if compiled.error is None:
                row.stage = "compiled"
            else:
                row.stage, row.message = "compile_error", compiled.error
                row.reason = "compile timeout" if compiled.timed_out else "compile error: " + \
                    compiled.error.split("(", 1)[-1][:70]
    return {"cache": cache, "handles": handles}


def prompt_of(schema: Any, limit: int = 1000) -> str:
    text = json.dumps(schema, ensure_ascii=False)
    return "Reply with one JSON value that follows this JSON schema:\n" + text[:limit]


def generate(rows: list[Row], schemas: dict[str, Any], specs: dict[str, GrammarSpec], compiled: dict[str, Any],
             model: str, max_tokens: int) -> None:
    """Greedy outputs of the compiled ones with the offline engine, each checked."""
    from inflight.llm import LLM
    from inflight.sequence import FinishReason, SamplingParams
    todo = [row for row in rows if row.stage == "compiled"]
    # Every request arrives at once here, so its compile may wait behind all the others: no deadline (the compile
    # on its own was measured above, under grammar_compile_timeout_ms).
    llm = LLM(model, max_num_seqs=16, grammar_compile_timeout_ms=3_600_000)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt_of(schemas[r.path])}],
                                                 tokenize=False, add_generation_prompt=True) for r in todo]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                             structured_outputs={"json": json.loads(specs[r.path].text)}) for r in todo]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for row, out in zip(todo, outputs):
        if out.finish_reason == FinishReason.LENGTH:
            matcher = compiled["cache"].new_matcher(compiled["handles"][row.path])
            ok = all(matcher.accept_token(t) for t in out.token_ids)
            row.output = "cut" if ok else "invalid"
            row.output_detail = "" if ok else "the grammar's matcher refuses the output's tokens"
        elif out.finish_reason in (FinishReason.EOS, FinishReason.STOP):
            why = check(schemas[row.path], out.text)
            row.output, row.output_detail = ("valid", "") if not why else ("invalid", why)
            if not why:
                row.annotation_formats = check(schemas[row.path], out.text, "all")
        else:
            row.output, row.output_detail = "error", f"{out.finish_reason}: {out.error}"


class ByteWalker:
    """Random walks through a grammar over a byte vocabulary: every string the grammar allows can come out."""

    def __init__(self, seed: int):
        import xgrammar as xgr
        self.xgr = xgr
        vocab = [bytes([i]) for i in range(256)] + ["<|end|>"]
        self.stop = 256
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=257, stop_token_ids=[self.stop])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.rng = random.Random(seed)
        # Closing bytes and the end are favoured (walks end), whitespace and control bytes rare (walks go on).
        self.weights = [1.0] * 257
        for b in b'"}]':
            self.weights[b] = 6.0
        for b in list(range(32)) + list(range(128, 256)):
            self.weights[b] = 0.05
        self.weights[self.stop] = 30.0

    def grammar(self, spec_text: str) -> Any:
        """The grammar the engine's compile worker makes of a schema spec's text (any whitespace)."""
        return self.compiler.compile_grammar(json_schema_grammar(spec_text, True))

    def walk(self, grammar: Any, limit: int = 4000) -> bytes | None:
        """One string the grammar accepts whole, or None when the walk ran past `limit` bytes."""
        matcher = self.xgr.GrammarMatcher(grammar)
        mask = self.xgr.allocate_token_bitmask(1, 257)
        out = bytearray()
        for _ in range(limit):
            matcher.fill_next_token_bitmask(mask)
            words = mask[0].tolist()
            allowed = [t for t in range(257) if (words[t >> 5] >> (t & 31)) & 1]
            token = self.rng.choices(allowed, [self.weights[t] * (1 + len(out) / 200 if t in (34, 93, 125, 256)
                                                                  else 1) for t in allowed])[0]
            if not matcher.accept_token(token):
                raise AssertionError(f"the matcher refused a token its own mask allowed: {token}")
            if token == self.stop:
                return bytes(out)
            out.append(token)
        return None


def walk_all(rows: list[Row], schemas: dict[str, Any], specs: dict[str, GrammarSpec], walks: int, seed: int) -> None:
    walker = ByteWalker(seed)
    for row in rows:
        if row.stage != "compiled":
            continue
        grammar = walker.grammar(specs[row.path].text)
        counts = collections.Counter()
        for _ in range(walks):
            data = walker.walk(grammar)
            if data is None:
                counts["unfinished"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:  # xgrammar allows UTF-8-encoded surrogates: not text, counted apart
                counts["not_utf8"] += 1
                continue
            why = check(schemas[row.path], text)
            counts["invalid" if why else "valid"] += 1
            if why and not row.walk_failure:
                row.walk_failure = f"{why} in {data[:300]!r}"
            if not why and check(schemas[row.path], text, "all"):
                counts["annotation_formats_unmet"] += 1
        row.walks = dict(counts)


def summarize(rows: list[Row]) -> dict[str, Any]:
    n = len(rows)
    compiled = [r for r in rows if r.stage == "compiled"]
    outputs = collections.Counter(r.output for r in compiled)
    walks = collections.Counter()
    for r in compiled:
        walks.update(r.walks)
    per_category = {}
    for cat in sorted({r.category for r in rows}):
        mine = [r for r in rows if r.category == cat]
        done = [r for r in mine if r.stage == "compiled"]
        per_category[cat] = {"sampled": len(mine), "compiled": len(done),
                             "valid": sum(r.output == "valid" for r in done),
                             "cut": sum(r.output == "cut" for r in done),
                             "invalid": sum(r.output == "invalid" for r in done)}
    compile_times = sorted(r.compile_s for r in compiled if r.compile_s is not None)
    return {
        "sampled": n, "compiled": len(compiled), "compiled_pct": round(100 * len(compiled) / n, 1),
        "valid": outputs["valid"], "cut_valid_prefix": outputs["cut"], "invalid": outputs["invalid"],
        "errors": outputs["error"],
        "valid_among_compiled_pct": round(100 * (outputs["valid"] + outputs["cut"]) / max(1, len(compiled)), 1),
        "complete_valid_among_compiled_pct": round(100 * outputs["valid"] / max(1, len(compiled)), 1),
        "walks": dict(walks),
        "valid_outputs_missing_an_annotation_format": sum(bool(r.annotation_formats) for r in compiled),
        "refusals": collections.Counter(r.reason for r in rows if r.stage != "compiled").most_common(),
        "per_category": per_category,
        "compile_s": {"median": compile_times[len(compile_times) // 2] if compile_times else None,
                      "p95": compile_times[min(len(compile_times) - 1, int(0.95 * len(compile_times)))]
                      if compile_times else None,
                      "max": compile_times[-1] if compile_times else None},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="jsonschemabench's data/ folder")
    parser.add_argument("--sample", type=int, default=400)
    parser.add_argument("--floor", type=int, default=20, help="at least this many of each category")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--timeout-ms", type=int, default=10_000, help="grammar_compile_timeout_ms")
    parser.add_argument("--walks", type=int, default=0, help="random walks per compiled grammar (byte vocabulary)")
    parser.add_argument("--no-generate", action="store_true", help="parse and compile only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    load_before = os.getloadavg()
    t_start = time.monotonic()
    picked = sample(load(args.data), args.sample, args.seed, args.floor)
    rows, schemas, specs = [], {}, {}
    for path in picked:
        row = Row(str(path.relative_to(args.data)), path.parent.name)
        rows.append(row)
        schemas[row.path] = json.loads(path.read_text())
        spec = parse(row, schemas[row.path])
        if spec is not None:
            specs[row.path] = spec
    t0 = time.monotonic()
    compiled = compile_all(rows, specs, args.model, args.timeout_ms)
    compile_wall = time.monotonic() - t0
    if args.walks:
        walk_all(rows, schemas, specs, args.walks, args.seed)
    t0 = time.monotonic()
    if not args.no_generate:
        generate(rows, schemas, specs, compiled, args.model, args.max_tokens)
    generate_wall = time.monotonic() - t0
    compiled["cache"].close()
    summary = summarize(rows)
    summary.update({"cpu": {k: cpuinfo_field(k) for k in ("model name", "cpu family", "model")},
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "compile_wall_s": round(compile_wall, 1), "generate_wall_s": round(generate_wall, 1),
                    "total_wall_s": round(time.monotonic() - t_start, 1),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
    print(json.dumps({k: v for k, v in summary.items() if k != "per_category"}, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
        with open(args.out / "rows.csv", "w", newline="") as f:
            walk_kinds = ("valid", "invalid", "unfinished", "not_utf8", "annotation_formats_unmet")
            names = [n for n in Row.__dataclass_fields__ if n != "walks"] + [f"walks_{k}" for k in walk_kinds]
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            for r in rows:
                d = {k: v for k, v in asdict(r).items() if k != "walks"}
                d.update({f"walks_{k}": r.walks.get(k, 0) for k in walk_kinds})
                writer.writerow(d)


if __name__ == "__main__":
    main()
