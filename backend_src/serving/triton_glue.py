"""pb_utils adapters shared by the model.py files: response senders, errors, metric families, inputs and the
model's options. Importable only inside Triton's python-backend stub (it imports triton_python_backend_utils);
everything that decides anything lives in the modules this one serves, which are tested without a server.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from .errors import INVALID_ARG, RequestError
from .options import ServingOptions, flatten_triton_parameters, parse_model_parameters
from .placement import cpu_instances, cpu_threads, engine_device

# Every call our threads make into the stub's IPC (response sends, is_cancelled, custom metrics) takes this
# lock, so at most one of them talks to the server at a time. The python backend aborts on concurrent metric
# calls; we saw one unexplained boost lock_exception abort with sends, cancellation polls and metric exports
# running in parallel, and one lock costs microseconds.
IPC_LOCK = threading.Lock()


def model_options(args: dict) -> tuple[dict, ServingOptions]:
    """The model's config (as Triton passes it to initialize) and its parsed `parameters`. Relative paths
    resolve against the model repository, the folder holding this model's folder."""
    config = json.loads(args["model_config"])
    repository = Path(args["model_repository"]).parent
    return config, parse_model_parameters(flatten_triton_parameters(config), repository)


def streaming_model_options(args: dict) -> tuple[dict, ServingOptions]:
    """model_options() for the models that stream (llm, llm_dynamic, llm_iterative): logging set up, and a config
    that is not decoupled refused at load, naming the setting."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config, options = model_options(args)
    if not pb_utils.using_decoupled_model_transaction_policy(config):
        raise pb_utils.TritonModelException(
            "model_transaction_policy.decoupled=false is not allowed: this model streams; set it to true")
    return config, options


def place_engine(args: dict, model_config: dict, options: ServingOptions) -> None:
    """Give this model instance's engine its device (KIND_GPU: the instance's GPU) and, on the CPU, its share
    of the cores when several instances of the model share them. Call before the engine is built."""
    import logging

    import torch  # only here: importing this module must stay light
    from inflight.cpu_threads import width_set_explicitly

    engine = options.engine
    engine.device = engine_device(engine.device, args.get("model_instance_kind", ""),
                                  int(args.get("model_instance_device_id", 0)))
    if engine.device == "cpu":
        threads = cpu_threads(len(os.sched_getaffinity(0)), cpu_instances(model_config))
        if threads is not None:
            torch.set_num_threads(threads)
            width_set_explicitly()
    logging.getLogger("serving").info("%s: %d torch threads, device %s", args.get("model_instance_name", "?"),
                                      torch.get_num_threads(), engine.device)


def metric_labels(args: dict) -> dict[str, str]:
    """What tells this model instance's metrics apart: model, version and Triton's instance name."""
    return {"model": args["model_name"], "version": str(args["model_version"]),
            "instance": args.get("model_instance_name", "")}


def read_inputs(request, names: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The request's input tensors (absent optional ones left out) and its request parameters."""
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs, json.loads(request.parameters() or "{}")


def error_response(error: RequestError):
    code = getattr(pb_utils.TritonError, error.code, None)  # None where this python backend has no codes
    triton_error = (pb_utils.TritonError(error.message, code) if code is not None
                    else pb_utils.TritonError(f"{error.code}: {error.message}"))
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error)


def unreadable(e: Exception) -> RequestError:
    return RequestError(f"unreadable request: {e}", INVALID_ARG)


class TritonTransport:
    """serving.lifecycle.Transport over pb_utils response senders. batched: the model has max_batch_size > 0,
    so every output gets the leading batch dimension of 1 Triton expects."""

    def __init__(self, batched: bool = False):
        self.batched = batched

    def send(self, sender, outputs, final: bool, error: RequestError | None = None) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            response = error_response(error)
        else:
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, array[None, ...] if self.batched else array) for name, array in outputs.items()])
        with IPC_LOCK:
            sender.send(response, flags=flags)

    def is_cancelled(self, sender) -> bool:
        with IPC_LOCK:
            return sender.is_cancelled()


class _LockedMetric:
    def __init__(self, metric):
        self._metric = metric

    def increment(self, value):
        with IPC_LOCK:
            self._metric.increment(value)

    def set(self, value):
        with IPC_LOCK:
            self._metric.set(value)

    def observe(self, value):
        with IPC_LOCK:
            self._metric.observe(value)


class TritonMetricSink:
    """serving.metrics_export.MetricSink over pb_utils.MetricFamily, one family per name, kept alive here
    (a Metric whose family was collected refuses to update)."""

    def __init__(self):
        self._families = {}

    def _metric(self, name, description, kind, **kwargs):
        with IPC_LOCK:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            return _LockedMetric(family.Metric(**kwargs))

    def counter(self, name, description, labels):
        return self._metric(name, description, pb_utils.MetricFamily.COUNTER, labels=dict(labels))

    def gauge(self, name, description, labels):
        return self._metric(name, description, pb_utils.MetricFamily.GAUGE, labels=dict(labels))

    def histogram(self, name, description, labels, buckets):
        return self._metric(name, description, pb_utils.MetricFamily.HISTOGRAM, labels=dict(labels),
                            buckets=list(buckets))
