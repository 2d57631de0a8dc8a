"""Triton model `postprocessing`: one llm_dynamic response in, the public outputs out (stateless; the text
was detokenized incrementally by the engine, see dynamic_arm.interface.to_public_outputs).

A call that arrives cancelled is the first step Triton scheduled after the client cancelled the ensemble: the
row's key goes to the cancel relay, so that llm_dynamic stops computing it (dynamic_arm/cancel_relay.py). The call
is still answered as usual: in Triton 2.51 an ensemble step that fails while llm_dynamic's step still streams
leaves the ensemble request in flight for good."""
import logging
from collections import deque

import triton_python_backend_utils as pb_utils

from dynamic_arm.cancel_relay import CancelRelay
from dynamic_arm.interface import to_public_outputs
from serving.errors import INTERNAL, RequestError
from serving.triton_glue import error_response, read_inputs

log = logging.getLogger("postprocessing")

_INPUTS = ["output_ids", "text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
           "cumulative_logprob", "num_cached_tokens", "row_key"]


class TritonPythonModel:
    def initialize(self, args):
        self.relay = CancelRelay()
        # Responses llm_dynamic sent before it saw the post bring more marked calls: post each row once (a post
        # made after the row's batch cleared it would linger until swept).
        self._posted: deque[str] = deque(maxlen=1024)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs, _ = read_inputs(request, _INPUTS)
                if request.is_cancelled():
                    self._relay_cancel(inputs)
                outputs = to_public_outputs(inputs)  # even then: an error here would leave the ensemble hanging
            except (KeyError, ValueError) as e:
                log.error("malformed llm_dynamic response: %s", e)
                responses.append(error_response(RequestError(f"internal error in postprocessing: {e}", INTERNAL)))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
        return responses

    def _relay_cancel(self, inputs):
        key = inputs.get("row_key")
        if key is not None and key.size:
            raw = key.reshape(-1)[0]
            row = raw.decode() if isinstance(raw, bytes) else str(raw)
            if row not in self._posted:
                self._posted.append(row)
                self.relay.post(row)
