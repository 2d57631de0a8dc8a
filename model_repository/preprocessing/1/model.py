"""Triton model `preprocessing`: the public request contract in (serving.contract), token ids and the parsed
request out (dynamic_arm.interface). A refused request gets its error here."""
import logging
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from inflight.tokenizer import load_tokenizer

from dynamic_arm.interface import encode_request
from inflight.fields import InvalidRequestError
from inflight.prompt import PromptEncoder
from serving.contract import parse_request
from serving.errors import INVALID_ARG, RequestError
from serving.lifecycle import naming_request
from serving.triton_glue import error_response, model_options, read_inputs

log = logging.getLogger("preprocessing")


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        model_config, options = model_options(args)
        self._input_names = [i["name"] for i in model_config["input"]]
        self.limits = options.limits
        self.request_defaults = options.request_defaults
        # Must be the engine's tokenizer and limits: the engine would encode a text prompt exactly like this.
        engine = options.engine
        self.prompts = PromptEncoder(load_tokenizer(engine.model), engine.max_model_len,
                                     engine.max_prompt_bytes)
        log.info("tokenizer from %s", engine.model)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        arrival_unix = time.time()
        try:
            inputs, parameters = read_inputs(request, self._input_names)
            req = parse_request(inputs, parameters, self.limits, self.request_defaults)
            if req.cancel:
                raise InvalidRequestError("stop=true (cancel by request id) is not supported by the dynamic-batcher "
                                          "arm: allowed on the in-flight model `llm`; cancel the stream instead")
            ids = self.prompts.encode(req.prompt, chat=req.apply_chat_template)
        except (InvalidRequestError, ValueError) as e:
            return error_response(naming_request(RequestError(str(e), INVALID_ARG), request.request_id()))
        except Exception as e:  # noqa: BLE001 - this request only
            log.exception("preprocessing failed")
            return error_response(naming_request(
                RequestError(f"internal error in preprocessing: {type(e).__name__}: {e}", "INTERNAL"),
                request.request_id()))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("request_config", np.array([[encode_request(req, arrival_unix)]], dtype=np.object_)),
        ])
