"""OpenAI-shaped errors, and how a Triton failure becomes one (400 / 404 / 503 / 500)."""
from __future__ import annotations

import re
from typing import Any

# Our model validates every request and its messages follow one pattern (see inflight/sequence.py):
# "<field>=<value> is out of range: allowed ...". Anything the model refuses as a bad request says so;
# these fragments cover that pattern plus Triton's own refusals of malformed inputs.
_BAD_REQUEST_HINTS = ("out of range", "allowed", "invalid", "must be", "expected", "unexpected",
                      "not supported", "unsupported", "is empty", "missing", "is unknown", "conflicts with")
# Queue full and shutdown are the two "try again later" cases; both come as UNAVAILABLE over gRPC.
_UNAVAILABLE_HINTS = ("queue is full", "shutting down", "unavailable", "exceeds maximum queue size")

# The model names its own inputs in errors; OpenAI clients know the OpenAI names.
_PARAM_NAMES = {"stop_words": "stop", "request_output_len": "max_tokens", "runtime_top_p": "top_p",
                "runtime_top_k": "top_k", "min_length": "min_tokens", "text_input": "prompt"}


class APIError(Exception):
    """An error the HTTP layer returns as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: Any) -> APIError:
    return APIError(404, f"The model {model!r} does not exist or does not speak the text_input/text_output "
                         f"contract", param="model", code="model_not_found")


def _param_from_message(message: str) -> str | None:
    m = re.match(r"\s*(?:\w+:\s*)?([a-z_]+)\s*=", message)
    if not m:
        return None
    return _PARAM_NAMES.get(m.group(1), m.group(1))


def from_triton(message: str, grpc_status: str | None = None) -> APIError:
    """Classify a Triton error. In-stream errors carry only a message (the gRPC stream response has no
    status field), so the message decides when no gRPC status came with it."""
    status_name = (grpc_status or "").rsplit(".", 1)[-1]
    low = message.lower()
    if low.startswith(("engine error", "internal error")):  # our model's words for its own faults
        return APIError(500, message, code="internal_error")
    if status_name == "UNAVAILABLE" or any(h in low for h in _UNAVAILABLE_HINTS):
        return APIError(503, message, code="unavailable", type_="server_error")
    if status_name == "NOT_FOUND" or ("unknown model" in low) or ("is not found" in low):
        return APIError(404, message, param="model", code="model_not_found")
    if status_name == "INVALID_ARGUMENT" or any(h in low for h in _BAD_REQUEST_HINTS):
        return APIError(400, message, param=_param_from_message(message))
    return APIError(500, message, code="internal_error")
