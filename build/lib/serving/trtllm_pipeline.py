"""TensorRT-LLM's inner models, for the tools that drive them one by one (its end_to_end_test.py): preprocessing
(text -> token ids), tensorrt_llm (token ids -> token ids, by `llm` through BLS) and postprocessing (token ids ->
text), with its tensor names and shapes. Pure array work here; the glue is in the three model.py files.
"""
from __future__ import annotations

import numpy as np


def column(inputs: dict, name: str, default=None) -> list:
    """Row values of a [batch, 1] input (its first element per row); default for an absent input."""
    array = inputs.get(name)
    if array is None:
        return [default] * len(next(iter(inputs.values())))
    return [row.reshape(-1)[0] if row.size else default for row in np.asarray(array)]


def padded(rows: list[list[int]], pad: int, width: int | None = None) -> np.ndarray:
    """[batch, width] int32, each row padded at the end."""
    width = max([len(r) for r in rows] + [1]) if width is None else width
    return np.array([list(r) + [pad] * (width - len(r)) for r in rows], dtype=np.int32)


def word_list(tokenizer, words_per_row: list[list[str]]) -> np.ndarray:
    """TensorRT-LLM's [batch, 2, length] word list: every word's token ids end to end, and the offsets where
    each word ends, padded with 0 and -1."""
    ids_rows, offsets_rows = [], []
    for words in words_per_row:
        ids, offsets = [], []
        for word in words:
            if word:
                ids += tokenizer.encode(word, add_special_tokens=False)
                offsets.append(len(ids))
        ids_rows.append(ids)
        offsets_rows.append(offsets)
    width = max([len(r) for r in ids_rows + offsets_rows] + [1])
    return np.stack([padded(ids_rows, 0, width), padded(offsets_rows, -1, width)], axis=1)


def texts(array) -> list[list[str]]:
    """A [batch, k] BYTES input as Python strings per row (an absent input: no rows)."""
    if array is None:
        return []
    return [[w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in row.reshape(-1)]
            for row in np.asarray(array)]


def preprocess(tokenizer, inputs: dict) -> dict[str, np.ndarray]:
    """preprocessing: QUERY, REQUEST_OUTPUT_LEN, BAD_WORDS_DICT, STOP_WORDS_DICT, END_ID, PAD_ID -> INPUT_ID
    (padded), REQUEST_INPUT_LEN, BAD_WORDS_IDS, STOP_WORDS_IDS, REQUEST_OUTPUT_LEN, OUT_END_ID, OUT_PAD_ID, and
    the encoder-decoder inputs a decoder-only model leaves empty (DECODER_INPUT_ID is one pad token)."""
    queries = [row[0] for row in texts(inputs["QUERY"])]
    ids = [tokenizer.encode(q) for q in queries]
    end_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    ends = [int(v) if v is not None else end_id for v in column(inputs, "END_ID")]
    pads = [int(v) if v is not None else pad_id for v in column(inputs, "PAD_ID")]
    batch = len(ids)
    none = [[] for _ in range(batch)]
    return {
        "INPUT_ID": padded(ids, pads[0]),
        "REQUEST_INPUT_LEN": np.array([[len(i)] for i in ids], dtype=np.int32),
        "DECODER_INPUT_ID": np.array([[pads[0]]] * batch, dtype=np.int32),
        "REQUEST_DECODER_INPUT_LEN": np.zeros((batch, 1), dtype=np.int32),
        "BAD_WORDS_IDS": word_list(tokenizer, texts(inputs.get("BAD_WORDS_DICT")) or none),
        "STOP_WORDS_IDS": word_list(tokenizer, texts(inputs.get("STOP_WORDS_DICT")) or none),
        "EMBEDDING_BIAS": np.zeros((batch, 0), dtype=np.float32),
        "REQUEST_OUTPUT_LEN": np.asarray(inputs["REQUEST_OUTPUT_LEN"], dtype=np.int32).reshape(batch, 1),
        "OUT_END_ID": np.array([[e] for e in ends], dtype=np.int32),
        "OUT_PAD_ID": np.array([[p] for p in pads], dtype=np.int32),
    }


def generation_outputs(prompts: list[list[int]], generated: list[list[int]], logprobs: list[list[float]],
                       pad_id: int) -> dict[str, np.ndarray]:
    """tensorrt_llm's outputs for a batch: output_ids [batch, beam 1, prompt + output] (padded),
    sequence_length [batch, 1], cum_log_probs [batch, 1], output_log_probs [batch, 1, output] (padded)."""
    full = [p + g for p, g in zip(prompts, generated)]
    return {
        "output_ids": padded(full, pad_id)[:, None, :],
        "sequence_length": np.array([[len(f)] for f in full], dtype=np.int32),
        "cum_log_probs": np.array([[sum(lp)] for lp in logprobs], dtype=np.float32),
        "output_log_probs": np.array([[row + [0.0] * (max(map(len, logprobs)) - len(row))] for row in logprobs],
                                     dtype=np.float32).reshape(len(full), 1, -1),
    }


def postprocess(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """postprocessing: TOKENS_BATCH [batch, beam, length] and SEQUENCE_LENGTH [batch, beam] -> OUTPUT
    [batch, beam], each beam's first `length` tokens decoded."""
    out = [[tokenizer.decode(list(beam[:n]), skip_special_tokens=True).encode("utf-8")
            for beam, n in zip(row, row_lengths)] for row, row_lengths in zip(tokens, lengths)]
    return np.array(out, dtype=np.object_)
