"""Triton model `trtllm_postprocessing`: TensorRT-LLM's `postprocessing` interface (TOKENS_BATCH, SEQUENCE_LENGTH
-> OUTPUT). Glue only: serving.trtllm_pipeline does the work."""
import triton_python_backend_utils as pb_utils
from inflight.tokenizer import load_tokenizer

from serving.errors import INVALID_ARG, RequestError
from serving.triton_glue import error_response, model_options, read_inputs
from serving.trtllm_pipeline import postprocess


class TritonPythonModel:
    def initialize(self, args):
        _, options = model_options(args)
        self.tokenizer = load_tokenizer(options.engine.model)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs, _ = read_inputs(request, ["TOKENS_BATCH", "SEQUENCE_LENGTH"])
                output = postprocess(self.tokenizer, inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"])
            except (KeyError, ValueError) as e:
                responses.append(error_response(RequestError(f"unreadable request: {e}", INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)]))
        return responses
