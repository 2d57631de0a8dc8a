"""The documented examples, run as a reader would run them, against the real default model: every curl command
of the README's quick start and of docs/contract.md's examples, and the first client command of each, must answer
with text (an instruct model given a raw question can answer with nothing at all, which is what this guards
against)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from engine_helpers import MODEL_REPOSITORY, SMOLLM2
from server_harness.repository import copy_model
from server_harness.server import TritonServer

ROOT = MODEL_REPOSITORY.parent
pytestmark = pytest.mark.timeout(600)


# (page, heading of its section): the shell blocks after that heading hold the examples.
EXAMPLE_SECTIONS = (("README.md", "## Quick start"), ("docs/contract.md", "## Examples"))


def section_blocks(page: str, heading: str) -> list[str]:
    text = (ROOT / page).read_text()
    section = text[text.index(heading):]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def curl_examples() -> list[str]:
    return [c for page, heading in EXAMPLE_SECTIONS for block in section_blocks(page, heading)
            for c in commands(block) if c.startswith("curl ")]


def client_examples() -> list[str]:
    """The first client command of each page's examples, each once."""
    found = []
    for page, heading in EXAMPLE_SECTIONS:
        clients = [c for block in section_blocks(page, heading) for c in commands(block)
                   if c.startswith(".venv/bin/python client/")]
        found += clients[:1]
    return list(dict.fromkeys(found))


def commands(block: str) -> list[str]:
    """Shell commands of a block: each starts a line with the program it runs; the lines up to the next one
    (backslash continuations, a quoted JSON body spread over lines) belong to it. Comments are dropped."""
    found: list[str] = []
    for line in block.splitlines():
        line = line.rstrip().removesuffix("\\").strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("curl ", ".venv/")):
            found.append(line)
        else:
            found[-1] += " " + line
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("readme") / "repo"
    copy_model(MODEL_REPOSITORY, "llm", repo, params={"model": SMOLLM2, "num_kv_blocks": 256})
    copy_model(MODEL_REPOSITORY, "ensemble", repo)
    with TritonServer(repo, log_path=repo.parent / "server.log") as srv:
        yield srv
    assert srv.leftovers() == []


def answer_text(output: str) -> str:
    """text_output of a generate answer, or of every event of a generate_stream answer, joined."""
    events = [json.loads(line[len("data: "):]) for line in output.splitlines() if line.startswith("data: ")]
    return "".join(e["text_output"] for e in events) if events else json.loads(output)["text_output"]


def test_every_page_has_examples():
    assert len(curl_examples()) >= 6 and client_examples()


@pytest.mark.parametrize("index", range(len(curl_examples())))
def test_each_curl_example_answers_with_text(server, index):
    command = curl_examples()[index].replace("localhost:8000", server.http_url)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert answer_text(done.stdout).strip(), f"{command}\n-> {done.stdout}"


@pytest.mark.parametrize("index", range(len(client_examples())))
def test_the_first_client_example_answers_with_text(server, index):
    command = client_examples()[index]
    assert command.startswith(".venv/bin/python client/generate.py")
    args = re.findall(r'"[^"]*"|\S+', command)[2:]
    done = subprocess.run([sys.executable, str(ROOT / "client" / "generate.py"), "--url", server.grpc_url,
                           *[a.strip('"') for a in args]], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().split()) > 5, done.stdout  # a sentence, not an empty answer
