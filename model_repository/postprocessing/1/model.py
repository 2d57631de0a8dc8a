"""Triton model `postprocessing`: one llm_dynamic response in, the public outputs out (stateless; the text
was detokenized incrementally by the engine, see dynamic_arm.interface.to_public_outputs)."""
import logging

import triton_python_backend_utils as pb_utils

from dynamic_arm.interface import to_public_outputs
from serving.errors import INTERNAL, RequestError
from serving.triton_glue import error_response, read_inputs

log = logging.getLogger("postprocessing")

_INPUTS = ["output_ids", "text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
           "cumulative_logprob"]


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs, _ = read_inputs(request, _INPUTS)
                outputs = to_public_outputs(inputs)
            except (KeyError, ValueError) as e:
                log.error("malformed llm_dynamic response: %s", e)
                responses.append(error_response(RequestError(f"internal error in postprocessing: {e}", INTERNAL)))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
        return responses
