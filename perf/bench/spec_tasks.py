"""The grounded task of the speculative-decoding benchmark: edit, quote or summarize a file given in the prompt, so
that much of the answer copies from it. The files are generated here (Python code and a meeting report from
templates, seeded), so every run and every server sees the same prompts; each prompt is the model's chat
template around one instruction and one file, rendered once, and sent as plain text to every server.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str  # the chat-templated text, as sent
    max_tokens: int


INSTRUCTIONS = (
    ("rename", "code", "Rename the variable total to amount everywhere in this Python file and show the whole file."),
    ("docstrings", "code", "Add a one-line docstring to each function in this Python file and show the whole file."),
    ("quote", "text", "Repeat the following minutes exactly, line by line."),
    ("spelling", "text", "Correct the spelling of 'recieve' in these minutes and show the corrected minutes in full."),
    ("summary", "text", "Summarize these minutes in a few sentences, reusing their words."),
    ("extract", "code", "Copy the first two functions of this Python file."),
)


def grounded_tasks(tokenizer, seed: int = 0, max_tokens: int = 256) -> list[Task]:
    """One task per instruction, each over its own generated file."""
    rng = random.Random(seed)
    tasks = []
    for name, kind, instruction in INSTRUCTIONS:
        body = code_file(rng, 3) if kind == "code" else report_text(rng, 5)
        fence = "```python\n" if kind == "code" else "```\n"
        message = f"{instruction}\n\n{fence}{body}\n```"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                               add_generation_prompt=True)
        tasks.append(Task(name, prompt, max_tokens))
    return tasks
