"""gRPC requests for the integration tests: inputs from numpy arrays, one streaming request read to its end."""
from __future__ import annotations

import queue
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype


def infer_inputs(values: dict[str, np.ndarray], client=grpcclient) -> list:
    """One InferInput per array, its shape and Triton type taken from the array (object arrays: BYTES); `client`:
    tritonclient.grpc (default) or tritonclient.http."""
    inputs = []
    for name, array in values.items():
        tensor = client.InferInput(name, list(array.shape), "BYTES" if array.dtype == object
                                   else np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


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
