"""The tasks of the speculative-decoding benchmark (perf.bench.spec), each with a check that it was done.

- grounded: text nobody in this project wrote, shipped with the environment: Python's own standard library
  (function sources, docstrings, a module's documentation) and its LICENSE.txt, under the base interpreter's
  lib/pythonX.Y. Quote it, extract from it, rename a variable in it, add a docstring to it, correct a spelling
  in it, summarize it. Which function, paragraph or module is picked is seeded, so every run and every server
  sees the same prompts on the same interpreter (each task names its source).
- copy-heavy: the generated template files this benchmark first used (same function body with two nouns swapped,
  minutes whose lines end alike), kept as one labelled row: prompt lookup on near-verbatim repetition.
- open-ended: a story asked for with no source text in the prompt, greedy and at temperature 1 (seeded): the
  control where drafts rarely hold, which shows what drafting costs.

Every prompt is SmolLM2's chat template around one user message, rendered once and sent as plain text. A check
reads the output text and says whether the task was done (passed) with a score in [0, 1] (how much of the
expected text is there, in order), so the speed of a task is never read apart from whether the model did it.
"""
from __future__ import annotations

import ast
import difflib
import functools
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

GROUNDED, COPY_HEAVY, OPEN_ENDED = "grounded", "copy-heavy", "open-ended"
STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
# Modules whose text is not prose or code a reader would ask about (easter eggs, generated tables).
SKIP_MODULES = {"this", "antigravity", "__hello__", "__phello__", "keyword", "token", "sre_constants"}


@dataclass(frozen=True)
class Check:
    passed: bool
    score: float
    what: str  # what was checked, for the report


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # GROUNDED, COPY_HEAVY or OPEN_ENDED
    prompt: str  # the chat-templated text, as sent
    max_tokens: int
    check: Callable[[str], Check]
    source: str = ""  # where the text came from
    temperature: float = 0.0
    seed: int | None = None


# ---- checks -------------------------------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return text.split()


def coverage(reference: str, output: str) -> float:
    """Share of the reference's words that the output has in the same order (whitespace ignored)."""
    ref = _words(reference)
    if not ref:
        return 1.0
    blocks = difflib.SequenceMatcher(None, ref, _words(output), autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks) / len(ref)


def contains(reference: str, output: str) -> bool:
    """The reference appears in the output word for word (whitespace, line breaks and indentation ignored)."""
    return " ".join(_words(reference)) in " ".join(_words(output))


def code_of(output: str) -> str:
    """The first fenced block of the output, else all of it."""
    m = re.search(r"```[a-zA-Z]*\n(.*?)(```|$)", output, re.S)
    return m.group(1) if m else output


def check_verbatim(reference: str, output: str) -> Check:
    return Check(contains(reference, output), coverage(reference, output), "the passage appears word for word")


def check_renamed(expected: str, old: str, output: str) -> Check:
    code = code_of(output)
    passed = contains(expected, code) and not re.search(rf"\b{re.escape(old)}\b", code)
    return Check(passed, coverage(expected, code), f"the code with {old!r} renamed, and {old!r} gone")


def _function(code: str, name: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    return next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def check_docstring_added(source: str, names: tuple[str, ...], output: str) -> Check:
    """Each named function is in the output's code with a docstring and, under it, the body it had."""
    code = code_of(output)
    done = 0
    for name in names:
        got, want = _function(code, name), _function(source, name)
        if got is None or ast.get_docstring(got) is None:
            continue
        body, want_body = got.body[1:], want.body[1:] if ast.get_docstring(want) else want.body
        done += [ast.dump(s) for s in body] == [ast.dump(s) for s in want_body]
    return Check(done == len(names), coverage(source, code),
                 "each function with a docstring added and its body unchanged")


def check_corrected(expected: str, wrong: str, output: str) -> Check:
    passed = contains(expected, output) and wrong not in output
    return Check(passed, coverage(expected, output), f"the text in full with {wrong!r} corrected")


def _content_words(text: str) -> list[str]:
    return re.findall(r"[a-z]{4,}", text.lower())


def check_summary(source: str, output: str) -> Check:
    """Shorter than the source, at least ten words, and most of its words the source's own."""
    words, known = _content_words(output), set(_content_words(source))
    share = sum(w in known for w in words) / len(words) if words else 0.0
    passed = 10 <= len(_words(output)) < len(_words(source)) and share >= 0.6
    return Check(passed, share, "a summary shorter than the text that reuses its words")


def check_story(output: str) -> Check:
    """At least 60 words that do not loop: the share of distinct 4-word runs (a loop repeats them)."""
    words = [w.lower() for w in _words(output)]
    runs = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    distinct = len(set(runs)) / len(runs) if runs else 0.0
    return Check(len(words) >= 60 and distinct >= 0.8, distinct, "60+ words, 4-word runs at least 80% distinct")


# ---- chat ---------------------------------------------------------------------------------------------------
def chat(tokenizer, message: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def fenced(body: str, language: str = "") -> str:
    return f"```{language}\n{body}\n```"


# ---- real text: the standard library and its license --------------------------------------------------------
@dataclass(frozen=True)
class Function:
    module: str
    name: str
    source: str  # its lines as in the file (dedented: top-level functions only)
    node: ast.FunctionDef

    @property
    def where(self) -> str:
        return f"{STDLIB.name}/{self.module}.py: {self.name}"


def stdlib_modules() -> list[Path]:
    return sorted(p for p in STDLIB.glob("*.py") if not p.stem.startswith("_") and p.stem not in SKIP_MODULES)


def _parse(path: Path) -> tuple[str, ast.Module] | None:
    try:
        text = path.read_text(encoding="utf-8")
        return text, ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def module_functions(path: Path) -> list[Function]:
    """Top-level functions without decorators, ASCII only, in file order."""
    parsed = _parse(path)
    if parsed is None:
        return []
    text, tree = parsed
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.decorator_list:
            source = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if source.isascii():
                out.append(Function(path.stem, node.name, source, node))
    return out


def _lines(text: str) -> int:
    return len(text.splitlines())


def pick_function(rng: random.Random, modules: list[Path], used: set[str],
                  fits: Callable[[Function], bool]) -> Function:
    """A seeded choice among the stdlib's functions that fit, one per module across the tasks."""
    for path in rng.sample(modules, len(modules)):
        if path.stem in used:
            continue
        candidates = [f for f in module_functions(path) if fits(f)]
        if candidates:
            used.add(path.stem)
            return rng.choice(candidates)
    raise LookupError(f"no function in {STDLIB} fits")


def local_variable(fn: Function) -> str | None:
    """A local name assigned in the function (not a parameter), used at least three times, three letters or
    more: the variable a rename task asks about."""
    params = {a.arg for a in ast.walk(fn.node.args) if isinstance(a, ast.arg)}
    stored = sorted({n.id for n in ast.walk(fn.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
    for name in stored:
        if name not in params and len(name) >= 3 and len(re.findall(rf"\b{name}\b", fn.source)) >= 3:
            return name
    return None


def license_paragraphs() -> list[str]:
    """The paragraphs of the interpreter's LICENSE.txt of 50 to 130 words."""
    text = (STDLIB / "LICENSE.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text)]
    return [p for p in paragraphs if 50 <= len(p.split()) <= 130 and p.isascii()]


def misspell(rng: random.Random, paragraph: str) -> tuple[str, str, str]:
    """(paragraph with one word's two inner letters swapped, the misspelled word, the word)."""
    # Plain words only (a whitespace-delimited run of letters, perhaps ending a clause): not part of a URL or name.
    words = sorted({w for w in re.findall(r"(?<!\S)([a-z]{7,})[,.;:]?(?!\S)", paragraph) if len(set(w[2:-2])) > 1})
    word = rng.choice(words)
    i = next(i for i in range(2, len(word) - 3) if word[i] != word[i + 1])
    wrong = word[:i] + word[i + 1] + word[i] + word[i + 2:]
    return re.sub(rf"\b{word}\b", wrong, paragraph, count=1), wrong, word


def grounded_tasks(tokenizer, seed: int = 0, max_tokens: int = 256) -> list[Task]:
    """Seven tasks over real text: quote a docstring, quote a license paragraph, extract a function from three,
    rename a variable, add a docstring, correct a misspelling, summarize a module's documentation."""
    rng = random.Random(seed)
    modules = stdlib_modules()
    used: set[str] = set()
    tasks = []

    def add(name: str, message: str, check: Callable[[str], Check], source: str) -> None:
        tasks.append(Task(name, GROUNDED, chat(tokenizer, message), max_tokens, check, source))

    def docstring(f: Function) -> str:
        return ast.get_docstring(f.node) or ""

    fn = pick_function(rng, modules, used, lambda f: 4 <= _lines(docstring(f)) <= 14
                       and 250 <= len(docstring(f)) <= 900)
    doc = docstring(fn)
    add("quote_docstring", f"Repeat the following text exactly, word for word.\n\n{fenced(doc)}",
        functools.partial(check_verbatim, doc), f"docstring of {fn.where}")

    paragraphs = license_paragraphs()
    quote, to_correct = rng.sample(paragraphs, 2)
    add("quote_license", f"Quote the following paragraph exactly.\n\n{fenced(quote)}",
        functools.partial(check_verbatim, quote), f"{STDLIB.name}/LICENSE.txt, a paragraph")

    group = _three_functions(rng, modules, used)
    block = "\n\n\n".join(f.source for f in group)
    wanted = group[1]
    add("extract_function", f"Copy the function `{wanted.name}` from this Python code exactly, and nothing "
        f"else.\n\n{fenced(block, 'python')}", functools.partial(check_verbatim, wanted.source),
        f"{STDLIB.name}/{wanted.module}.py: {', '.join(f.name for f in group)}")

    fn = pick_function(rng, modules, used, lambda f: 8 <= _lines(f.source) <= 25 and local_variable(f) is not None)
    old = local_variable(fn)
    new = f"new_{old}"
    expected = re.sub(rf"\b{old}\b", new, fn.source)
    add("rename_variable", f"Rename the variable `{old}` to `{new}` everywhere in this Python function and show "
        f"the whole function.\n\n{fenced(fn.source, 'python')}",
        functools.partial(check_renamed, expected, old), fn.where)

    fn = pick_function(rng, modules, used, lambda f: 6 <= _lines(f.source) <= 20 and not docstring(f))
    add("add_docstring", f"Add a one-line docstring to this Python function and show the whole function."
        f"\n\n{fenced(fn.source, 'python')}",
        functools.partial(check_docstring_added, fn.source, (fn.name,)), fn.where)

    wrong_text, wrong, word = misspell(rng, to_correct)
    add("fix_spelling", f"One word in this paragraph is misspelled. Correct it and show the corrected paragraph "
        f"in full.\n\n{fenced(wrong_text)}", functools.partial(check_corrected, to_correct, wrong),
        f"{STDLIB.name}/LICENSE.txt, a paragraph with {word!r} misspelled {wrong!r}")

    path, doc = _module_documentation(rng, modules, used)
    add("summarize_docs", f"Summarize this documentation in a few sentences, reusing its words.\n\n{fenced(doc)}",
        functools.partial(check_summary, doc), f"{STDLIB.name}/{path.name}: module docstring")
    return tasks


def _three_functions(rng: random.Random, modules: list[Path], used: set[str]) -> list[Function]:
    """Three consecutive top-level functions of 5-25 lines each, from one module."""
    for path in rng.sample(modules, len(modules)):
        if path.stem in used:
            continue
        fns = module_functions(path)
        runs = [fns[i:i + 3] for i in range(len(fns) - 2)
                if all(5 <= _lines(f.source) <= 25 for f in fns[i:i + 3])
                and len({f.name for f in fns[i:i + 3]}) == 3]
        if runs:
            used.add(path.stem)
            return rng.choice(runs)
    raise LookupError(f"no module in {STDLIB} has three short functions in a row")


def _module_documentation(rng: random.Random, modules: list[Path], used: set[str]) -> tuple[Path, str]:
    """A module docstring of 12-40 lines."""
    for path in rng.sample(modules, len(modules)):
        parsed = None if path.stem in used else _parse(path)
        doc = ast.get_docstring(parsed[1]) if parsed else None
        if doc and 12 <= _lines(doc) <= 40 and 600 <= len(doc) <= 2500 and doc.isascii():
            used.add(path.stem)
            return path, doc
    raise LookupError(f"no module in {STDLIB} has a docstring of 12-40 lines")


# ---- the open-ended control ---------------------------------------------------------------------------------
STORIES = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Write a short story about a fox who learns to play the violin.")


def open_ended_tasks(tokenizer, seed: int = 0, max_tokens: int = 256) -> list[Task]:
    """Each story greedy and at temperature 1 (seeded): no source text in the prompt for drafts to copy."""
    tasks = []
    for i, message in enumerate(STORIES):
        prompt = chat(tokenizer, message)
        tasks.append(Task(f"story_{i}_greedy", OPEN_ENDED, prompt, max_tokens, check_story, "none"))
        tasks.append(Task(f"story_{i}_t1", OPEN_ENDED, prompt, max_tokens, check_story, "none", temperature=1.0,
                          seed=seed + i))
    return tasks


# ---- the generated copy-heavy files (the benchmark's first tasks) --------------------------------------------
_NOUNS = ("order", "invoice", "customer", "item", "price", "tax", "discount", "record", "account", "payment",
          "balance", "shipment", "refund", "coupon", "ledger")
_VERBS = ("compute", "update", "validate", "merge", "collect", "apply", "summarize", "check")
_TEAMS = ("finance", "library", "planning", "transport", "parks", "housing", "health", "schools")
_THINGS = ("annual budget", "bridge repair", "summer festival", "new bus routes", "reading programme",
           "street lighting", "recycling scheme", "sports hall")
_ACTIONS = ("approved", "postponed", "discussed", "rejected", "reviewed", "welcomed")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


def code_file(rng: random.Random, num_functions: int) -> str:
    """A small Python module: functions that loop over records, add, compare and return a total."""
    parts = []
    for _ in range(num_functions):
        verb, a, b = rng.choice(_VERBS), *rng.sample(_NOUNS, 2)
        limit = rng.randint(2, 9) * 10
        parts.append(
            f"def {verb}_{a}_{b}(records, rate):\n"
            f"    total = 0\n"
            f"    for record in records:\n"
            f"        if record.{a} > {limit}:\n"
            f"            total += record.{a} * rate\n"
            f"        else:\n"
            f"            total += record.{b}\n"
            f"    return total\n")
    return "\n\n".join(parts)


def report_text(rng: random.Random, num_sentences: int) -> str:
    """Minutes of a council meeting, one line per decision."""
    lines = []
    for _ in range(num_sentences):
        lines.append(f"On {rng.choice(_DAYS)} the {rng.choice(_TEAMS)} committee {rng.choice(_ACTIONS)} the "
                     f"{rng.choice(_THINGS)}, and the members agreed to recieve a report next month.")
    return "\n".join(lines)


COPY_HEAVY_INSTRUCTIONS = (
    ("rename", "code", "Rename the variable total to amount everywhere in this Python file and show the whole file."),
    ("docstrings", "code", "Add a one-line docstring to each function in this Python file and show the whole file."),
    ("quote", "text", "Repeat the following minutes exactly, line by line."),
    ("spelling", "text", "Correct the spelling of 'recieve' in these minutes and show the corrected minutes in full."),
    ("summary", "text", "Summarize these minutes in a few sentences, reusing their words."),
    ("extract", "code", "Copy the first two functions of this Python file."),
)


def _copy_heavy_check(name: str, body: str) -> Callable[[str], Check]:
    if name == "rename":
        return functools.partial(check_renamed, re.sub(r"\btotal\b", "amount", body), "total")
    if name == "docstrings":
        names = tuple(re.findall(r"^def (\w+)", body, re.M))
        return functools.partial(check_docstring_added, body, names)
    if name == "quote":
        return functools.partial(check_verbatim, body)
    if name == "spelling":
        return functools.partial(check_corrected, body.replace("recieve", "receive"), "recieve")
    if name == "summary":
        return functools.partial(check_summary, body)
    return functools.partial(check_verbatim, "\n\n".join(body.split("\n\n")[:2]))


def copy_heavy_tasks(tokenizer, seed: int = 0, max_tokens: int = 256) -> list[Task]:
    """One task per instruction, each over its own generated file (the benchmark's tasks before issue 40)."""
    rng = random.Random(seed)
    tasks = []
    for name, kind, instruction in COPY_HEAVY_INSTRUCTIONS:
        body = code_file(rng, 3) if kind == "code" else report_text(rng, 5)
        message = f"{instruction}\n\n{fenced(body, 'python' if kind == 'code' else '')}"
        tasks.append(Task(f"copy_{name}", COPY_HEAVY, chat(tokenizer, message), max_tokens,
                          _copy_heavy_check(name, body), "generated (perf/bench/spec_tasks.py)"))
    return tasks


def all_tasks(tokenizer, seed: int = 0, max_tokens: int = 256) -> list[Task]:
    return (grounded_tasks(tokenizer, seed, max_tokens) + copy_heavy_tasks(tokenizer, seed, max_tokens)
            + open_ended_tasks(tokenizer, seed, max_tokens))
