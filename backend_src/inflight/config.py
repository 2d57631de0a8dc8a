"""Engine configuration: one dataclass, parsed from keyword options or Triton config.pbtxt parameters.

Every field is a `setting(default, allowed, doc)` (settings.py): validation, parsing and docs/parameters.md
all read it. An operator may override some fields from the environment (env_overrides.py); the overrides are
applied when the config is built from options, and win over config.pbtxt and `LLM(**options)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .env_overrides import apply_env_overrides
from .settings import AutoOrInts, Bools, Choices, Floats, Ints, Pattern, Text, check_fields, parse_value, setting

_COUNT = 1 << 20


@dataclass
class EngineConfig:
    model: str = setting("", Text("a Hugging Face model folder (config.json + *.safetensors)"), (
        "The model folder. In config.pbtxt a relative path resolves against the model repository (the folder "
        "given to `--model-repository`), so a repository and its models move together; a copy elsewhere names "
        "it absolutely. Default there: `../models/SmolLM2-135M-Instruct`."))
    dtype: str = setting("auto", Choices(("auto", "float32", "float16", "bfloat16")),
                         "Weights and activations. auto: float32 on CPU, bfloat16 on CUDA. On CPU bfloat16 "
                         "stores the weights in bf16 and computes in float32 (docs/quantization.md).")
    quantization: str = setting("none", Choices(("none", "int8", "int4")), (
        "CPU, weight-only (activations stay float32): int8 one scale per output channel, int4 blocks of 32 with "
        "a scale and a min (GGUF's Q4_1 rule); the lm_head and embedding take int8 either way. A GGUF model "
        "keeps its own Q8_0 / Q4_0 / Q4_1 tensors as they are, and quantizes its other linears as this asks "
        "(none: float32). docs/quantization.md."))
    device: str = setting("cpu", Pattern(r"cpu|cuda(:\d+)?", "cpu, cuda, cuda:N"), "Where the model runs.")
    block_size: int = setting(16, Ints(1, 1024), "Tokens per KV-cache block.")
    num_kv_blocks: int = setting(0, Ints(0, 1 << 30), (
        "KV pool size in blocks; > 0 wins. 0: derive it from kv_cache_memory_bytes (CPU) or "
        "gpu_memory_utilization (CUDA)."))
    kv_cache_memory_bytes: int = setting(512 * 1024 * 1024, Ints(1, 1 << 50),
                                         "CPU: the KV pool's memory budget (512 MiB) when num_kv_blocks is 0.")
    # The shares of engines on one device must add up to what it can give (kv_sizing.py).
    gpu_memory_utilization: float = setting(0.9, Floats(0.0, 1.0, lo_open=True), (
        "CUDA: this engine's share of the whole device's memory for weights + activations + KV cache; the KV "
        "pool gets what a warm-up forward of max_num_batched_tokens leaves (when num_kv_blocks is 0). Two "
        "engines on one GPU need shares that add up, e.g. 0.45 each."))
    enforce_eager: bool = setting(False, Bools(), (
        "CUDA: run decode steps eagerly instead of replaying CUDA graphs (CPU is always eager)."))
    max_num_seqs: int = setting(64, Ints(1, _COUNT), "Running requests at most (the decode batch).")
    max_num_batched_tokens: int = setting(512, Ints(1, 1 << 24), "Tokens per engine step at most.")
    max_model_len: int = setting(2048, Ints(1, 1 << 24), (
        "Prompt + output tokens per request; longer requests are refused."))
    enable_prefix_caching: bool = setting(True, Bools(), "Reuse the KV blocks of a shared prompt prefix.")
    enable_chunked_prefill: bool = setting(True, Bools(), (
        "Split long prompts into chunks under the step's token budget. Off, max_num_batched_tokens must be "
        ">= max_model_len."))
    # Finished requests leave their slot idle until the longest one ends: what a dynamic batcher does.
    static_batching: bool = setting(False, Bools(), (
        "Static batching (the dynamic-batcher arm): admit a batch only when none runs, never mid-batch."))
    fast_lane_share: float = setting(0.25, Floats(0.0, 1.0, hi_open=True), (
        "Share of each step's token budget kept for the fast lane (short requests)."))
    fast_lane_max_prompt_tokens: int = setting(64, Ints(0, 1 << 24), "A \"short\" prompt, for the fast lane.")
    fast_lane_max_tokens: int = setting(32, Ints(0, 1 << 24), "A \"small\" max_tokens, for the fast lane.")
    watermark: float = setting(0.02, Floats(0.0, 1.0, hi_open=True), (
        "Fraction of KV blocks kept free at admission, against thrashing."))
    max_queue_size: int = setting(256, Ints(1, 1 << 30), (
        "Waiting requests beyond this are refused (Triton: `UNAVAILABLE`)."))
    max_prompt_bytes: int = setting(1 << 20, Ints(1, 1 << 40), (
        "Prompt text beyond this many bytes is refused before tokenizing (a prompt is also held to what "
        "max_model_len tokens can hold; prompt.py)."))
    default_max_tokens: int = setting(256, Ints(1, 1 << 24), (
        "max_tokens of a request that gives none (vLLM's backend: 16)."))
    seed: int = setting(0, Ints(0, (1 << 64) - 1), "Seed of the sampler for requests without their own seed.")
    # Structured output (docs/structured_output.md).
    grammar_compile_timeout_ms: int = setting(10_000, Ints(1, 3_600_000), (
        "A request whose grammar (JSON schema, regex, choice, EBNF) has not compiled this long after it arrived "
        "is refused (INVALID_ARG) before it takes any KV block; the compile is stopped (its worker process "
        "killed) and the spec stays cached as refused."))
    grammar_cache_entries: int = setting(256, Ints(1, 1 << 20), (
        "Compiled grammars kept, least recently used first out; a request with a cached grammar is admitted "
        "without compiling."))

    # Speculative decoding (speculation/, docs/speculative.md): outputs are those of decoding without it.
    speculative_method: str = setting("auto", Choices(("auto", "off", "ngram")), (
        "Draft tokens verified several per forward. ngram: prompt lookup (the request's last n tokens found "
        "earlier in its prompt or output propose what followed them). auto: ngram on CPU, off on CUDA (not "
        "measured there yet). A request may opt out with speculative_decoding=false."))
    num_speculative_tokens: int = setting(5, Ints(1, 64), "Draft tokens per request and step at most.")
    prompt_lookup_min: int = setting(2, Ints(1, 64), "Shortest n-gram the ngram method matches.")
    prompt_lookup_max: int = setting(4, Ints(1, 64), "Longest n-gram the ngram method matches (tried first).")
    speculative_disable_by_batch_size: int = setting(8, Ints(0, _COUNT), (
        "No drafts while more requests than this run: past it verification can cost more than it saves (the "
        "break-even of a low-acceptance load on this project's CPU; copy-heavy loads still gain at 16-20: "
        "docs/speculative.md). 0: never draft."))
    speculative_draft_policy: str = setting("cost", Choices(("cost", "always")), (
        "cost: a request drafts only as many tokens as its guesses (drafted or not) are expected to be worth the "
        "rows they add, by the decode step costs per row count this engine measures as it runs, so text that "
        "prompt lookup cannot guess costs next to nothing (docs/speculative.md). always: every guess is drafted "
        "(at the per-request length that follows its acceptance)."))

    # Engine switches. "auto" is resolved when the model loads, per CPU or device, in one place
    # (cpu_defaults.resolve_cpu_defaults), which logs what it chose and why. docs/cpu.md has the measurements.
    cpu_gemm: str = setting("auto", Choices(("auto", "onednn", "blas")), (
        "CPU linears: onednn (weights prepacked at load) or blas (torch's default, MKL: about 2x slower on the "
        "AMD CPUs measured). auto: onednn where torch's build has it, else blas (also what onednn falls back "
        "to there)."))
    cpu_gemv_rows: int | str = setting("auto", AutoOrInts(0, 64), (
        "CPU, float32: steps of up to this many rows run the linears on a dense copy of each weight kept beside "
        "oneDNN's packed one (faster at a few rows): through MKL's BLAS on Intel CPUs, through the native decode "
        "step's own product elsewhere. It costs the linears' weights in memory once more (425 MB for SmolLM2); "
        "0 keeps no copy, and where nothing reads the copy (not Intel, native step off) it is released. auto: "
        "3 on Intel CPUs, 4 on others."))
    cpu_native_decode: bool = setting(True, Bools(), (
        "CPU, float32: decode-only steps of up to cpu_gemv_rows rows run every layer in one native call, larger "
        "ones the native norms, attention and SiLU between torch's linears (model/native/decode_step.c, "
        "compiled on first use with the system's cc into INFLIGHT_NATIVE_CACHE; without a compiler a warning "
        "says so and the torch forward runs)."))
    cpu_compile: bool = setting(False, Bools(), (
        "CPU: compile the decoder layer with torch's inductor where a C++ compiler ($CXX, else g++) is on PATH. "
        "Off until measured faster: each new step shape compiles a graph (seconds each, a minute cold)."))
    cpu_thread_governor: bool = setting(True, Bools(), (
        "CPU: adapt the OpenMP thread count to the cores other processes leave (down to one thread while they "
        "hold the engine's cores); false keeps it fixed (cpu_threads.py)."))
    fused_ops: str = setting("auto", Choices(("auto", "0", "1")), (
        "The Triton RMSNorm and SiLU-and-mul kernels. auto: on CUDA, torch ops elsewhere; 0: torch ops "
        "everywhere; 1: the kernels everywhere (on CPU that needs TRITON_INTERPRET=1)."))
    attention_backend: str = setting("auto", Choices(("auto", "triton", "torch")), (
        "Paged attention. auto: the Triton kernels on CUDA, the torch reference on CPU; triton: always the "
        "kernels (on CPU that needs TRITON_INTERPRET=1); torch: always the reference (no CUDA graphs then)."))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_fields(self)
        if self.quantization != "none" and (str(self.device).startswith("cuda") or
                                            self.dtype not in ("auto", "float32")):
            raise ValueError(f"quantization={self.quantization!r} is CPU float32 only (device={self.device}, "
                             f"dtype={self.dtype}): allowed none there")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                f"{self.max_model_len} when chunked prefill is disabled")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} is out of range: allowed [1, "
                             f"prompt_lookup_max={self.prompt_lookup_max}]")

    @classmethod
    def from_options(cls, environ=None, **options) -> "EngineConfig":
        """Build from keyword options (strings are parsed as config.pbtxt's are; unknown names raise), then
        apply the operator's environment overrides (env_overrides.py; `environ` defaults to os.environ)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
        kwargs = {name: parse_value(fields[name], raw) for name, raw in options.items()}
        return apply_env_overrides(cls(**kwargs), environ)
