"""Triton model `llm`: decoupled Python-backend glue that hands each request to the in-flight engine.

Decisions live in backend_src/serving (contract, frontend, metrics export); this file only adapts
pb_utils: it reads tensors and parameters, wraps response senders and metric families.
"""
import json
import logging
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils


# Light imports only: a bad config.pbtxt parameter fails the load before torch is imported.
from serving.errors import RequestError
from serving.options import flatten_triton_parameters, parse_model_parameters
from serving.health_probe import HealthProbe, discover_base_url
from serving.test_hooks import FaultInjector


log = logging.getLogger("llm")


def _error_code(name: str):
    """pb_utils.TritonError code by name, or None where this python backend has no codes."""
    return getattr(pb_utils.TritonError, name, None)


# Every call our threads make into the stub's IPC (response sends, is_cancelled, custom metrics) takes this
# lock, so at most one of them talks to the server at a time. The python backend is documented to abort on
# concurrent metric calls; we saw one unexplained boost lock_exception abort with sends, cancellation polls
# and metric exports running in parallel, and one lock costs microseconds.
_IPC_LOCK = threading.Lock()


class _TritonTransport:
    def send(self, sender, outputs, final: bool, error: RequestError | None = None) -> None:
        with _IPC_LOCK:
            self._send(sender, outputs, final, error)

    def _send(self, sender, outputs, final: bool, error: RequestError | None) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            code = _error_code(error.code)
            triton_error = (pb_utils.TritonError(error.message, code) if code is not None
                            else pb_utils.TritonError(f"{error.code}: {error.message}"))
            response = pb_utils.InferenceResponse(output_tensors=[], error=triton_error)
        else:
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()])
        sender.send(response, flags=flags)

    def is_cancelled(self, sender) -> bool:
        with _IPC_LOCK:
            return sender.is_cancelled()


class _LockedMetric:
    def __init__(self, metric):
        self._metric = metric

    def increment(self, value):
        with _IPC_LOCK:
            self._metric.increment(value)

    def set(self, value):
        with _IPC_LOCK:
            self._metric.set(value)

    def observe(self, value):
        with _IPC_LOCK:
            self._metric.observe(value)


class _TritonMetricSink:
    """pb_utils.MetricFamily per name (kept alive here); used from the exporter thread only."""

    def __init__(self):
        self._families = {}

    def _metric(self, name, description, kind, **kwargs):
        with _IPC_LOCK:
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


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "model_transaction_policy.decoupled=false is not allowed: this model streams; set it to true")
        self._input_names = [i["name"] for i in model_config["input"]]
        options = parse_model_parameters(flatten_triton_parameters(model_config), Path(args["model_repository"]).parent)
        from inflight.engine import LLMEngine
        from serving.frontend import InflightFrontend
        from serving.metrics_export import MetricsExporter

        log.info("loading %s with %s", options.engine.model, options.engine)
        self.engine = LLMEngine(options.engine)
        name, version = args["model_name"], args["model_version"]
        if options.enable_test_hooks:
            log.warning("enable_test_hooks=true: requests may inject engine faults (inject_fault); tests only")
        self.frontend = InflightFrontend(
            self.engine, _TritonTransport(), options.limits, options.cancel_check_period_s,
            # Triton unloads the model only after every in-flight request had its final: notice the unload
            # (or server shutdown) and end them, or shutdown waits out --exit-timeout-secs and then crashes.
            is_ready=self._health_probe(name, str(version)),
            fault_injector=FaultInjector() if options.enable_test_hooks else None)
        self.exporter = MetricsExporter(self._metrics_snapshot, _TritonMetricSink(),
                                        {"model": name, "version": version}, options.metrics_interval_s)
        self.frontend.start()
        self.exporter.start()

    @staticmethod
    def _health_probe(name: str, version: str):
        base = discover_base_url()
        if base is None:
            log.warning("no HTTP endpoint to ask whether %s is still served: requests in flight at shutdown will "
                        "wait for --exit-timeout-secs", name)
            return None
        return HealthProbe(base, name, version)

    def _metrics_snapshot(self):
        snap = self.engine.metrics.snapshot()
        snap["gauges"]["num_requests_inflight"] = self.frontend.num_inflight
        return snap

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for name in self._input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                parameters = json.loads(request.parameters() or "{}")
            except Exception as e:  # noqa: BLE001 - this request only
                _TritonTransport().send(sender, None, True, RequestError(f"unreadable request: {e}", "INVALID_ARG"))
                continue
            self.frontend.submit(sender, request.request_id(), inputs, parameters)
        return None

    def finalize(self):
        # Every request still in flight gets its final (CANCELLED: server shutting down) before the threads
        # end. (Triton 2.51 calls finalize only once no decoupled request is in flight, so normally none is.)
        log.info("finalize: stopping the engine loop (%d request(s) in flight)", self.frontend.num_inflight)
        self.frontend.close()
        self.exporter.stop()
        log.info("finalize: done")
