"""One streaming gRPC request read to its end, for the integration tests of the served arms."""
from __future__ import annotations

import queue
import time

import tritonclient.grpc as grpcclient


def stream_to_final(url: str, model: str, inputs: list) -> tuple[list[dict], str | None]:
    """Every response of one streaming request (outputs as Python values) and the error, if any; fails the test
    unless exactly one response is final and nothing follows it."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        got = []
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return got, str(error)
            response = result.get_response()
            got.append({o.name: result.as_numpy(o.name).tolist() for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                break
        time.sleep(0.2)  # room for a response that should not come
        assert responses.empty(), f"{model}: a response after the final"
        return got, None
    finally:
        client.stop_stream()
        client.close()
