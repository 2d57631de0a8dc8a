"""Triton model `preprocessing`: the public request contract in (serving.contract), token ids and the
parsed request out (backend_src/dynamic_arm/interface.py). A refused request gets its error here."""
import json
import logging
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from transformers import AutoTokenizer

from dynamic_arm.interface import encode_request
from inflight.sequence import InvalidRequestError
from serving.contract import parse_request
from serving.options import flatten_triton_parameters, parse_model_parameters


log = logging.getLogger("preprocessing")


def _error(message: str):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        model_config = json.loads(args["model_config"])
        self._input_names = [i["name"] for i in model_config["input"]]
        options = parse_model_parameters(flatten_triton_parameters(model_config), Path(args["model_repository"]).parent)
        self.limits = options.limits
        # Must be the engine's tokenizer: the engine would encode a text prompt exactly like this.
        self.tokenizer = AutoTokenizer.from_pretrained(options.engine.model)
        log.info("tokenizer from %s", options.engine.model)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            inputs = {}
            for name in self._input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parameters = json.loads(request.parameters() or "{}")
            req = parse_request(inputs, parameters, self.limits)
            if req.cancel:
                raise InvalidRequestError("stop=true (cancel by request id) is not supported by the dynamic-batcher "
                                          "arm: allowed on the in-flight model `llm`; cancel the stream instead")
            ids = self.tokenizer.encode(req.prompt)
        except (InvalidRequestError, ValueError) as e:
            return _error(str(e))
        except Exception as e:  # noqa: BLE001 - this request only
            log.exception("preprocessing failed")
            return _error(f"internal error in preprocessing: {type(e).__name__}: {e}")
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("request_config", np.array([[encode_request(req)]], dtype=np.object_)),
        ])
