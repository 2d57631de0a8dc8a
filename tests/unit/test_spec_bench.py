"""perf.bench.spec without a server: its tasks come from real text shipped with the interpreter, picked the same
way for a seed; every check passes on the answer it asks for and fails on the usual wrong ones; the controls carry
no source text; the figures are the medians of per-round ratios, the open-ended headline the worse control."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine_helpers import SMOLLM2
from perf.bench import spec, spec_tasks


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def tasks(tokenizer):
    return spec_tasks.all_tasks(tokenizer)


def test_grounded_tasks_are_real_text_picked_by_the_seed(tokenizer, tasks):
    grounded = [t for t in tasks if t.kind == spec_tasks.GROUNDED]
    assert [t.name for t in grounded] == ["quote_docstring", "quote_license", "extract_function", "rename_variable",
                                          "add_docstring", "fix_spelling", "summarize_docs"]
    assert all(t.source.startswith(("docstring of python3", "python3")) for t in grounded)
    again = spec_tasks.grounded_tasks(tokenizer)
    assert [t.prompt for t in again] == [t.prompt for t in grounded]
    other = spec_tasks.grounded_tasks(tokenizer, seed=1)
    assert sum(a.prompt != b.prompt for a, b in zip(other, grounded)) >= 5
    license_text = (spec_tasks.STDLIB / "LICENSE.txt").read_text()
    quoted = grounded[1].prompt.split("```\n")[1].split("\n```")[0]
    assert quoted in license_text


def test_each_check_passes_the_answer_it_asks_for_and_fails_wrong_ones():
    source = "def f(items):\n    total = 0\n    for x in items:\n        total += x\n    return total\n"
    renamed = spec_tasks.check_renamed(source.replace("total", "new_total"), "total", "")
    assert not renamed.passed and renamed.score == 0.0
    answer = "Here it is:\n```python\n" + source.replace("total", "new_total") + "```"
    assert spec_tasks.check_renamed(source.replace("total", "new_total"), "total", answer).passed
    assert not spec_tasks.check_renamed(source.replace("total", "new_total"), "total", source).passed  # unchanged

    with_doc = source.replace("):\n", '):\n    """Add them up."""\n', 1)
    assert spec_tasks.check_docstring_added(source, ("f",), f"```python\n{with_doc}```").passed
    assert not spec_tasks.check_docstring_added(source, ("f",), f"```python\n{source}```").passed  # none added
    changed = with_doc.replace("return total", "return 0")
    assert not spec_tasks.check_docstring_added(source, ("f",), changed).passed  # body changed

    text = "The quick brown fox jumps over the lazy dog\nand runs away."
    assert spec_tasks.check_verbatim(text, "Sure: " + text.replace("\n", " ")).passed  # line breaks aside
    half = spec_tasks.check_verbatim(text, "The quick brown fox jumps")
    assert not half.passed and half.score == pytest.approx(5 / 12)
    assert spec_tasks.check_corrected(text, "qiuck", text).passed
    assert not spec_tasks.check_corrected(text, "qiuck", text.replace("quick", "qiuck")).passed

    doc = ("The tempfile module creates temporary files and directories securely. " * 4).strip()
    assert spec_tasks.check_summary(doc, "The module creates temporary files and directories securely for "
                                         "programs.").passed
    assert not spec_tasks.check_summary(doc, doc + " " + doc).passed  # longer than the text
    story = " ".join(f"word{i}" for i in range(80))
    assert spec_tasks.check_story(story).passed
    assert not spec_tasks.check_story("the cat sat on the mat " * 20).passed  # a loop


def test_the_spelling_task_misspells_a_plain_word_of_the_paragraph(tasks):
    task = next(t for t in tasks if t.name == "fix_spelling")
    word, wrong = task.source.split("'")[1], task.source.split("'")[3]
    assert wrong in task.prompt and f" {word}" not in task.prompt.split("```")[1].split(wrong)[0][-50:]
    assert sorted(word) == sorted(wrong) and word != wrong


def test_the_controls_have_no_source_text_and_sample_seeded(tasks):
    controls = [t for t in tasks if t.kind == spec_tasks.OPEN_ENDED]
    assert {t.temperature for t in controls} == {0.0, 1.0}
    assert all((t.seed is None) == (t.temperature == 0) for t in controls)
    assert all("```" not in t.prompt and len(t.prompt) < 400 for t in controls)
    assert sum(t.kind == spec_tasks.COPY_HEAVY for t in tasks) == 6


def test_figures_are_medians_of_per_round_ratios_and_the_headline_takes_the_worse_control(tasks):
    chosen = [t for t in tasks if t.name in ("quote_license", "story_0_greedy", "story_0_t1")]
    # (seconds, tokens) per round: drafts on twice as fast on the quote, 1% and 4% slower on the stories.
    on = {"quote_license": [(1.0, 100), (1.2, 100), (1.0, 100)], "story_0_greedy": [(2.0, 100)] * 3,
          "story_0_t1": [(2.0, 100)] * 3}
    off = {"quote_license": [(2.0, 100), (2.0, 100), (2.2, 100)], "story_0_greedy": [(1.98, 100)] * 3,
           "story_0_t1": [(1.92, 100)] * 3}
    measured = {"runs": {t.name: {"on": on[t.name], "off": off[t.name]} for t in chosen},
                "texts": {t.name: {"on": ["x"] * 3, "off": ["x"] * 3} for t in chosen},
                "drafts": {t.name: {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                                    "spec_decode_num_accepted_tokens": 30} for t in chosen}}
    summary = spec.summarize(measured, chosen, 3)
    grounded = summary["groups"]["grounded"]
    assert grounded["ratio_rounds"] == [2.0, pytest.approx(1.667, abs=1e-3), 2.2] and grounded["ratio"] == 2.0
    assert grounded["acceptance_rate"] == 0.75 and grounded["draft_tokens_per_output_token"] == pytest.approx(0.133,
                                                                                                           abs=1e-3)
    assert summary["tasks"]["quote_license"]["ms_per_token_on"] == 10.0
    assert summary["tasks"]["story_0_t1"]["identical_on_off"] is True
    top = spec.headline(summary)
    assert top["open_ended_ratio"] == top["open_ended_ratio_t1"] == 0.96 and top["open_ended_ratio_greedy"] == 0.99
    assert top["single_speedup"] == 2.0


def test_an_unknown_task_group_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        spec.parse_args(["--groups", "grounded,stories"])
    assert "stories unknown; allowed grounded, copy-heavy, open-ended greedy, open-ended t1" in capsys.readouterr().err
