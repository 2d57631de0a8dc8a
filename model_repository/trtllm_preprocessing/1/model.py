"""Triton model `trtllm_preprocessing`: TensorRT-LLM's `preprocessing` interface (QUERY -> INPUT_ID ...) for the
tools that drive its inner models one by one. Glue only: serving.trtllm_pipeline does the work."""
import logging

import triton_python_backend_utils as pb_utils
from inflight.tokenizer import load_tokenizer

from serving.errors import INVALID_ARG, RequestError
from serving.triton_glue import error_response, model_options, read_inputs
from serving.trtllm_pipeline import preprocess

log = logging.getLogger("trtllm_preprocessing")


class TritonPythonModel:
    def initialize(self, args):
        model_config, options = model_options(args)
        self.input_names = [i["name"] for i in model_config["input"]]
        self.tokenizer = load_tokenizer(options.engine.model)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs, _ = read_inputs(request, self.input_names)
                outputs = preprocess(self.tokenizer, inputs)
            except (KeyError, ValueError, UnicodeDecodeError) as e:
                responses.append(error_response(RequestError(f"unreadable request: {e}", INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
        return responses
