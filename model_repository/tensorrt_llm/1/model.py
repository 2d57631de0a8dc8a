"""Triton model `tensorrt_llm`: TensorRT-LLM's engine interface (input_ids, input_lengths, request_output_len ->
output_ids, sequence_length), answered by the in-flight model `llm` through BLS, one request per batch row.
Glue only: serving.trtllm_pipeline and serving.bls_front do the work."""
import itertools

import numpy as np
import triton_python_backend_utils as pb_utils
from inflight.tokenizer import load_tokenizer

from inflight.fields import InvalidRequestError
from serving.batch_rows import with_trtllm_defaults
from serving.bls_front import call_llm
from serving.errors import INVALID_ARG, RequestError
from serving.triton_glue import error_response, model_options, read_inputs
from serving.trtllm_pipeline import column, generation_outputs

# Its sampling inputs that `llm` takes under the same names; the rest of its inputs shape the batch.
_PASSED = ("temperature", "runtime_top_k", "runtime_top_p", "random_seed", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "min_length", "beam_width", "return_context_logits",
           "return_generation_logits", "guided_decoding_guide_type", "guided_decoding_guide")


class TritonPythonModel:
    def initialize(self, args):
        model_config, options = model_options(args)
        self.input_names = [i["name"] for i in model_config["input"]]
        self.tokenizer = load_tokenizer(options.engine.model)
        self.ids = itertools.count()

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            inputs, _ = read_inputs(request, self.input_names)
            lengths = [int(n) for n in column(inputs, "input_lengths")]
            prompts = [list(map(int, row[:n])) for row, n in zip(np.asarray(inputs["input_ids"]), lengths)]
            pads = column(inputs, "pad_id", self.tokenizer.eos_token_id)
            generated, logprobs = [], []
            for b, prompt in enumerate(prompts):
                row = {"text_input": np.array([self.tokenizer.decode(prompt).encode("utf-8")], dtype=np.object_),
                       "max_tokens": np.asarray(inputs["request_output_len"][b], dtype=np.int32).reshape(1),
                       "return_output_ids": np.array([True]), "return_log_probs": np.array([True]),
                       "exclude_input_in_output": np.array([True])}
                if inputs.get("end_id") is not None:
                    row["end_id"] = np.asarray(inputs["end_id"][b], dtype=np.int32).reshape(1)
                for name in _PASSED:
                    if inputs.get(name) is not None:
                        row[name] = np.asarray(inputs[name][b]).reshape(1)
                out = call_llm(with_trtllm_defaults(row, {}), f"{request.request_id() or 'trt'}/{next(self.ids)}")
                generated.append([int(t) for t in out["output_ids"].reshape(-1)])
                logprobs.append([float(x) for x in out["output_log_probs"].reshape(-1)])
            outputs = generation_outputs(prompts, generated, logprobs, int(pads[0]))
        except (InvalidRequestError, KeyError, ValueError) as e:
            return error_response(RequestError(str(e), INVALID_ARG))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])
