"""TensorRT-LLM's tensor shapes, mapped onto the `llm` model's: pure functions, tested without Triton.

TensorRT-LLM's clients talk to a model with max_batch_size > 0: every input has a leading batch dimension
([B, 1] for a scalar, [B, k] for a list) and each response carries one row, named by `batch_index`, with
text_output [1], cum_log_probs [1, beam] and output_log_probs [1, beam, tokens]. `llm` takes one request of
[1]-shaped inputs and answers with 1-D outputs, one element per sample (n).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from inflight.fields import InvalidRequestError

# Outputs only the TensorRT-LLM-shaped models have (declared so its clients may ask for them).
OWN_OUTPUTS = (("batch_index", "TYPE_INT32", [1]), ("sequence_index", "TYPE_INT32", [1]),
               ("context_logits", "TYPE_FP32", [-1, -1]), ("generation_logits", "TYPE_FP32", [-1, -1, -1]))


def split_rows(inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """One `llm` request's inputs per batch row: row b of every input, its batch dimension dropped."""
    if "text_input" not in inputs:
        raise InvalidRequestError("text_input is missing: allowed a BYTES tensor of shape [batch, 1]")
    batch = np.asarray(inputs["text_input"]).shape[0]
    for name, array in inputs.items():
        shape = list(np.asarray(array).shape)
        if not shape or shape[0] != batch:
            raise InvalidRequestError(f"{name}=<tensor of shape {shape}> is invalid: allowed the batch size of "
                                      f"text_input ({batch}) as its first dimension")
    return [{name: np.asarray(array)[b] for name, array in inputs.items()} for b in range(batch)]


_SAMPLING_CHOICES = ("top_k", "runtime_top_k", "top_p", "runtime_top_p")


def with_trtllm_defaults(row: dict[str, np.ndarray], parameters: Mapping[str, object]) -> dict[str, np.ndarray]:
    """TensorRT-LLM's defaults where its client left a field out: the prompt leads a non-streamed output
    (exclude_input_in_output false; a stream ignores the flag, as TensorRT-LLM does), and decoding is greedy
    unless top_k or top_p asks for sampling (its temperature alone samples nothing)."""
    row = dict(row)
    streaming = any(bool(np.asarray(row[n]).reshape(-1)[0]) for n in ("stream", "streaming") if n in row)
    if streaming:
        row.pop("exclude_input_in_output", None)
    elif "exclude_input_in_output" not in row and "exclude_input_in_output" not in parameters:
        row["exclude_input_in_output"] = np.array([False])
    given = set(row) | set(parameters)
    if not given & set(_SAMPLING_CHOICES) and "sampling_parameters" not in given:
        row["temperature"] = np.array([0.0], dtype=np.float32)
    return row


def row_outputs(outputs: Mapping[str, np.ndarray], batch_index: int, sample: int = 0) -> dict[str, np.ndarray]:
    """One `llm` response (1-D outputs, an element per sample) -> one TensorRT-LLM response for `sample` of
    row `batch_index`."""
    out = {"batch_index": np.array([[batch_index]], dtype=np.int32),
           "sequence_index": np.array([[sample]], dtype=np.int32)}
    for name, array in outputs.items():
        array = np.asarray(array)
        if name == "output_log_probs":  # [samples, tokens] -> this sample's [1, beam 1, tokens]
            out[name] = array.reshape(-1, array.shape[-1])[sample].reshape(1, 1, -1)
        elif name == "cum_log_probs":  # [1, beam 1]
            out[name] = array.reshape(-1)[sample:sample + 1].reshape(1, 1)
        else:  # text_output and the rest: [1], this sample's element
            out[name] = array.reshape(-1)[sample:sample + 1]
    return out


def stack_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Whole-request answer of a non-streaming (unary) model: the rows' final outputs, batch first.
    output_log_probs of unequal lengths are padded with 0.0 at the end (their token counts tell the length)."""
    out: dict[str, np.ndarray] = {}
    for name in rows[0]:
        parts = [np.asarray(r[name]) for r in rows]
        if name == "output_log_probs":
            width = max(p.shape[-1] for p in parts)
            parts = [np.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, width - p.shape[-1])]) for p in parts]
        out[name] = np.concatenate(parts, axis=0)
    return out
