"""What a Triton model declares (read once from its config), and the request/response tensors of our contract."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inflight.fields import BY_NAME

from .errors import APIError, bad_request

# config.pbtxt data types -> (Triton wire type, numpy type).
_DTYPES = {
    "TYPE_BOOL": ("BOOL", np.bool_), "TYPE_STRING": ("BYTES", np.object_),
    "TYPE_INT32": ("INT32", np.int32), "TYPE_INT64": ("INT64", np.int64),
    "TYPE_UINT32": ("UINT32", np.uint32), "TYPE_UINT64": ("UINT64", np.uint64),
    "TYPE_FP32": ("FP32", np.float32), "TYPE_FP64": ("FP64", np.float64), "TYPE_FP16": ("FP16", np.float16),
}

# Outputs the frontend always asks for: the finish reason marks the final response and maps to OpenAI's
# finish_reason; the two counts are the usage block.
_ALWAYS = {"stream": True, "exclude_input_in_output": True, "return_finish_reason": True,
           "return_num_input_tokens": True, "return_num_output_tokens": True}

# Files any Hugging Face tokenizer folder has; how a config parameter is recognised as the model's folder.
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


@dataclass
class ModelInfo:
    name: str
    inputs: dict[str, tuple[str, Any, list[int]]]  # name -> (wire type, numpy type, dims)
    outputs: set[str]
    parameters: dict[str, str]
    max_batch_size: int = 0
    tokenizer_dir: str | None = None

    @property
    def speaks_contract(self) -> bool:
        return "text_input" in self.inputs and "text_output" in self.outputs

    @classmethod
    def from_config(cls, config: dict, search_roots: list[Path] = ()) -> "ModelInfo":
        inputs = {}
        for spec in config.get("input", []):
            wire, np_type = _DTYPES.get(spec.get("data_type", ""), (None, None))
            if wire is not None:
                inputs[spec["name"]] = (wire, np_type, [int(d) for d in spec.get("dims", [])])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        info = cls(name=config["name"], inputs=inputs, outputs={o["name"] for o in config.get("output", [])},
                   parameters=params, max_batch_size=int(config.get("max_batch_size", 0) or 0))
        info.tokenizer_dir = find_tokenizer_dir(params, search_roots)
        return info


def find_tokenizer_dir(parameters: dict[str, str], search_roots: list[Path]) -> str | None:
    """The model's folder is whichever config parameter names a directory holding tokenizer files. Matching
    on content rather than on a parameter name keeps this working for either arm's config spelling. Relative
    paths are tried against each root (the server's working directory, the model repository)."""
    for value in parameters.values():
        if not value or len(value) > 4096:
            continue
        candidates = [Path(value)] if Path(value).is_absolute() else [root / value for root in search_roots]
        # A GGUF model's tokenizer files sit beside it (inflight/tokenizer.py).
        candidates = [p.parent if p.suffix == ".gguf" else p for p in candidates]
        for path in candidates:
            if any((path / f).is_file() for f in _TOKENIZER_FILES):
                return str(path.resolve())
    return None


def _tensor_value(name: str, value: Any, np_type: Any) -> np.ndarray:
    if np_type is np.object_:
        items = value if isinstance(value, list) else [value]
        return np.array([s.encode("utf-8") if isinstance(s, str) else s for s in items], dtype=np.object_)
    if np.issubdtype(np_type, np.integer):
        bounds = np.iinfo(np_type)
        if not bounds.min <= int(value) <= bounds.max:
            raise bad_request(f"{name}={value!r} is out of range: allowed [{bounds.min}, {bounds.max}]", name)
    return np.array([value], dtype=np_type)


def build_request(info: ModelInfo, prompt: str, sampling: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """Tensors for every value whose input the model declares; the rest go into sampling_parameters JSON
    (the contract's catch-all), or as request parameters when even that input is missing. Returns
    (name -> array with the model's shape, request parameters)."""
    tensors: dict[str, np.ndarray] = {"text_input": _tensor_value("text_input", prompt, np.object_)}
    leftover: dict[str, Any] = {}
    # Prefix-cache hits (usage.prompt_tokens_details.cached_tokens), from a model that declares the output.
    cached = {"return_num_cached_tokens": True} if "num_cached_tokens" in info.outputs else {}
    for key, value in {**_ALWAYS, **cached, **sampling}.items():
        field = BY_NAME.get(key)  # a model may declare a field under any of its input names (the schema's)
        name = next((n for n in (field.input_names if field else (key,)) if n in info.inputs), None)
        if name is None:
            leftover[key] = value
            continue
        tensors[name] = _tensor_value(key, value, info.inputs[name][1])
    params: dict[str, Any] = {}
    if leftover and "sampling_parameters" in info.inputs:
        tensors["sampling_parameters"] = _tensor_value("sampling_parameters", json.dumps(leftover), np.object_)
    else:
        for key, value in leftover.items():
            if isinstance(value, list):
                raise bad_request(f"model {info.name!r} does not take {key!r}", key)
            params[key] = value
    if info.max_batch_size > 0:  # a batching model's dims omit the batch dimension: add it
        tensors = {k: v.reshape(1, -1) for k, v in tensors.items()}
    return tensors, params


def make_infer_inputs(tensors: dict[str, np.ndarray], info: ModelInfo) -> list:
    from tritonclient.grpc import InferInput  # deferred: the mapping is unit-tested without grpc set up

    out = []
    for name, arr in tensors.items():
        wire = info.inputs[name][0] if name in info.inputs else "BYTES"
        inp = InferInput(name, list(arr.shape), wire)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


# A -inf log-probability (a token the model rules out) is not JSON; vLLM's frontend sends this floor instead.
LOGPROB_FLOOR = -9999.0


@dataclass
class TokenLogprob:
    """One output token's log-probability and the most likely tokens at its step (from the model's `logprobs`
    output, whose values are the engine's: the model's raw distribution, as vLLM's)."""
    token_id: int
    token: str
    logprob: float
    top: list[tuple[str, float, int]]  # (text, logprob, rank), most likely first; may end with the sampled token


@dataclass
class Delta:
    """One streamed response of the model: new text, and on the final one why it finished and the counts."""
    text: str = ""
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    index: int = 0  # which of the request's n samples (OpenAI's choice index)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held, when the model reports it
    logprobs: list[TokenLogprob] | None = None  # this response's tokens, when the request asked for logprobs


def _floor(lp: Any) -> float:
    return max(float(lp), LOGPROB_FLOOR)


def token_logprobs(ids: list[int], steps: Any) -> list[TokenLogprob]:
    """The model's logprobs JSON for one sample's tokens in one response (vLLM's layout: per token, {token id:
    {"logprob", "rank", "decoded_token"}} for the top ones and the sampled one) with the sampled ids (output_ids)."""
    if not isinstance(steps, list) or len(steps) != len(ids):
        raise APIError(500, f"the model sent logprobs for {len(steps) if isinstance(steps, list) else steps!r} "
                            f"tokens and {len(ids)} token ids", code="internal_error")
    out = []
    for tid, step in zip(ids, steps):
        entries = sorted(((int(k), v) for k, v in step.items()), key=lambda kv: kv[1]["rank"])
        chosen = step.get(str(tid))
        if chosen is None:
            raise APIError(500, f"the model's logprobs lack its sampled token {tid}", code="internal_error")
        out.append(TokenLogprob(tid, chosen["decoded_token"], _floor(chosen["logprob"]),
                                [(v["decoded_token"], _floor(v["logprob"]), int(v["rank"])) for _, v in entries]))
    return out


def parse_response(get: Any) -> list[Delta]:
    """One Delta per sample of the response: each output holds an element per sample (n); `get(name)` returns
    the output as a numpy array or None (InferResult.as_numpy)."""
    def column(name: str) -> list:
        arr = get(name)
        return [] if arr is None else list(arr.reshape(-1))

    def text(v: Any) -> str:
        return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)

    texts, reasons, n_out = column("text_output"), column("finish_reason"), column("num_output_tokens")
    n_in, logprobs, ids = column("num_input_tokens"), column("logprobs"), [int(t) for t in column("output_ids")]
    n_cached = column("num_cached_tokens")
    deltas, start = [], 0
    for i, t in enumerate(texts or [b""]):
        # vLLM's convention, which our models follow: finish_reason "None" until that sample finishes.
        reason = text(reasons[i]) if i < len(reasons) else None
        delta = Delta(text=text(t), finish_reason=None if reason in (None, "", "None") else reason,
                      num_input_tokens=int(n_in[0]) if n_in else None,
                      num_output_tokens=int(n_out[i]) if i < len(n_out) else None, index=i,
                      num_cached_tokens=int(n_cached[0]) if n_cached else None)
        # output_ids holds every sample's tokens of this response one after the other; num_output_tokens splits it.
        count = delta.num_output_tokens or 0
        if i < len(logprobs):
            steps = json.loads(text(logprobs[i]))
            if steps is not None:
                delta.logprobs = token_logprobs(ids[start:start + count], steps)
        start += count
        deltas.append(delta)
    return deltas


# The model's finish reasons -> OpenAI's. eos and stop strings are both "stop" to OpenAI; cancelled and
# error are not finishes a client should see as success.
def openai_finish_reason(reason: str) -> str:
    if reason in ("eos", "stop"):
        return "stop"
    if reason == "length":
        return "length"
    if reason == "cancelled":
        raise APIError(503, "the request was cancelled by the server (shutting down?)", code="cancelled")
    raise APIError(500, f"the model ended the request with finish_reason={reason!r}", code="internal_error")
