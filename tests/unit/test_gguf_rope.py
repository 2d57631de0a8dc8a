"""A GGUF file's RoPE scaling and end-of-turn token (model/config.py): a Llama 3-style file (rope_freqs
tensor) and a linear-scaled one compute what transformers computes with the same scaling on the same weights; a
scaling the engine does not implement is refused by name; tokenizer.ggml.eot_token_id stops generation."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import TINY, hf_greedy, hf_model
from gguf_files import llama3_rope_factors, write_llama_gguf
from inflight import LLM, SamplingParams
from inflight.model import UnsupportedModelError
from inflight.model.config import ModelConfig
from inflight.sequence import FinishReason
from perf.probes.perplexity import prompt_logits

# original_max_position_embeddings is small so that tiny-llama's 8 frequencies span all three llama3 bands
# (kept, blended, divided by factor) and the scaling shows in a short prompt.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}
PROMPT = "The capital of France is a city of museums and parks, of bridges over the river and long avenues"


def _hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(folder)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_scaled_rope_gguf_computes_what_transformers_does(tmp_path, scaling):
    path, reference = write_llama_gguf(TINY, tmp_path / "f32", "F32", rope_scaling=scaling)
    gguf = LLM(str(path), num_kv_blocks=32)
    ids = gguf.tokenizer.encode(PROMPT)
    want = _hf_logits(str(reference), ids)
    # The scaling must matter here, or agreement would prove nothing: unscaled RoPE gives other logits.
    assert (_hf_logits(TINY, ids) - want).abs().max() > 1e-2
    got = prompt_logits(gguf, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert gguf.generate([ids], greedy, use_tqdm=False)[0].token_ids == hf_greedy(str(reference), ids, 12)


def test_scaling_metadata_is_read_as_llama_cpp_reads_it(tmp_path):
    """Type none ignores the factor; the rope_freqs tensor is taken as stored, whatever produced it."""
    none, _ = write_llama_gguf(TINY, tmp_path / "none", "F32", rope_scaling={"rope_type": "none", "factor": 4.0})
    assert ModelConfig.from_path(str(none)).rope_scaling == {}
    llama3, _ = write_llama_gguf(TINY, tmp_path / "llama3", "F32", rope_scaling=LLAMA3)
    cfg = ModelConfig.from_path(str(llama3))
    assert cfg.rope_scaling == {"rope_type": "freq_factors",
                                "factors": llama3_rope_factors(cfg.head_dim, cfg.rope_theta, LLAMA3).tolist()}


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_unsupported_rope_scaling_is_refused_by_name(tmp_path, kind):
    path, _ = write_llama_gguf(TINY, tmp_path / kind, "F32",
                               rope_scaling={"rope_type": kind, "factor": 4.0,
                                             "original_max_position_embeddings": 256})
    with pytest.raises(UnsupportedModelError, match=rf"llama\.rope\.scaling\.type='{kind}' is not supported: "
                                                    r"allowed none, linear"):
        ModelConfig.from_path(str(path))


def test_eot_token_of_the_file_stops_generation(tmp_path):
    plain, _ = write_llama_gguf(TINY, tmp_path / "plain", "Q8_0")
    llm = LLM(str(plain), num_kv_blocks=32)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    before = llm.generate([ids], params, use_tqdm=False)[0]
    assert len(before.token_ids) == 6 and before.finish_reason == FinishReason.LENGTH
    eot = before.token_ids[2]  # a token greedy decoding reaches: naming it the end of turn must stop there
    with_eot, _ = write_llama_gguf(TINY, tmp_path / "eot", "Q8_0", eot_token_id=eot)
    assert ModelConfig.from_path(str(with_eot)).eos_token_ids == [2, eot]
    after = LLM(str(with_eot), num_kv_blocks=32).generate([ids], params, use_tqdm=False)[0]
    stop = before.token_ids.index(eot) + 1
    assert after.token_ids == before.token_ids[:stop] and after.finish_reason == FinishReason.EOS
