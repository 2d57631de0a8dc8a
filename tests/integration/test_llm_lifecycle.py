"""The `llm` model's lifecycle on the real tritonserver: a bad config.pbtxt parameter fails the load
with its name, `make serve`'s scripts/serve.py starts, answers and stops without leftovers, and a copy of
the model repository serves from anywhere on disk."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from engine_helpers import MODEL_REPOSITORY
from server_harness.openai_stack import grpc_generate
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer, free_ports, python_stubs
from serve_script import serve_script

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def tiny_repo(tmp_path):
    if not (TINY / "config.json").exists():
        pytest.skip(f"{TINY} missing: run `make setup`")
    return make_model_repository(MODEL_REPOSITORY, tmp_path / "repo", {"llm": {"model": TINY, "num_kv_blocks": 64,
                                                             "max_model_len": 128}})


def test_a_bad_parameter_fails_the_load_naming_it(tmp_path):
    if not (TINY / "config.json").exists():
        pytest.skip(f"{TINY} missing: run `make setup`")
    # Two broken models in one server (each load is tried, each failure logged): an unknown name, a
    # malformed value.
    repo = make_model_repository(MODEL_REPOSITORY, tmp_path / "repo",
                                 {"llm_unknown": {"model": TINY}, "llm_malformed": {"model": TINY}})
    for model, (old, new) in {"llm_unknown": ('key: "max_num_seqs"', 'key: "max_num_sequences"'),
                              "llm_malformed": ('string_value: "512"', 'string_value: "lots"')}.items():
        cfg = repo / model / "config.pbtxt"
        assert old in cfg.read_text()
        cfg.write_text(cfg.read_text().replace(old, new, 1))
    server = TritonServer(repo, log_path=tmp_path / "server.log", startup_timeout_s=120)
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    log = server.log_text()
    unknown = next(line for line in log.splitlines() if "failed to load 'llm_unknown'" in line)
    assert "max_num_sequences" in unknown and "max_num_seqs" in unknown  # the name, and the allowed names
    malformed = next(line for line in log.splitlines() if "failed to load 'llm_malformed'" in line)
    assert "max_num_batched_tokens" in malformed and "'lots'" in malformed
    assert server.leftovers() == []


def test_serve_script_starts_answers_and_stops_cleanly(tiny_repo, tmp_path):
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "MODEL_REPOSITORY": str(tiny_repo), "HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
           "METRICS_PORT": str(metrics), "EXIT_TIMEOUT_SECS": "5", "OPENAI_PORT": "off"}
    log_path = tmp_path / "serve.log"
    with serve_script(env, log_path, "Ctrl-C stops the server") as proc:
        banner = log_path.read_text()
        assert f"client/generate.py --url localhost:{grpc}" in banner
        assert f"curl -s -X POST http://localhost:{http}/v2/models/llm/generate" in banner
        assert f"http://localhost:{http}/v2/models/llm/generate_stream" in banner
        server_pid = _server_pid(proc.pid)
        # The printed client command works.
        out = subprocess.run([sys.executable, str(ROOT / "client" / "generate.py"), "--url", f"localhost:{grpc}",
                              "Hello", "--max-tokens", "5", "--ignore-eos"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert '"completed": 1, "output_tokens": 5' in out.stderr
        # Admin endpoints are restricted; inference and health are not.
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/repository/index", method="POST")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(req, timeout=10)
    text = log_path.read_text()
    assert "stopped cleanly: no stub process or shared memory region left" in text
    assert not [pid for pid, argv in python_stubs() if len(argv) > 5 and argv[5] == str(server_pid)]


def _server_pid(serve_pid: int) -> int:
    """serve.py's tritonserver child."""
    children = Path(f"/proc/{serve_pid}/task/{serve_pid}/children").read_text().split()
    servers = [int(c) for c in children if b"tritonserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(servers) == 1, children
    return servers[0]


def test_a_copy_of_the_model_repository_serves_from_anywhere(tmp_path):
    """What a Triton user does with a repository (copy it, mount it, bake it into an image): nothing but the
    model path changes, no environment variable is set, and every model loads and answers."""
    if not (TINY / "config.json").exists():
        pytest.skip(f"{TINY} missing: run `make setup`")
    copy = tmp_path / "somewhere" / "else" / "models"
    shutil.copytree(MODEL_REPOSITORY, copy)
    edited = set()
    for cfg in copy.glob("*/config.pbtxt"):
        text, n = re.subn(r'(key: "model"\s*value: \{ string_value: ")[^"]*(")', rf"\g<1>{TINY}\g<2>", cfg.read_text())
        cfg.write_text(text)
        if n:
            edited.add(cfg.parent.name)
    # the models that load a tokenizer or weights name the model folder; nothing else needs editing
    assert edited == {"llm", "llm_dynamic", "llm_iterative", "preprocessing", "tensorrt_llm", "trtllm_preprocessing",
                      "trtllm_postprocessing"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFLIGHT_", "PYTHONPATH"))}
    server = TritonServer(copy, log_path=tmp_path / "server.log", env=env, clear_env=True)
    with server:
        for model in ("llm", "llm_ensemble"):
            text, final = grpc_generate(server.grpc_url, model, "The capital of France is", max_tokens=4,
                                        ignore_eos=True, temperature=0.0)
            assert text and final["finish_reason"] == "length", (model, text, final)
    assert server.leftovers() == []
