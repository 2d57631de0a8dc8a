"""Triton model `llm`: decoupled Python-backend glue that hands each request to the in-flight engine.

Decisions live in backend_src/serving (contract, lifecycle, frontend, metrics export); this file only wires
pb_utils to them.
"""
import logging


# Light imports only: a bad config.pbtxt parameter fails the load before torch is imported.
from serving.health_probe import HealthProbe, discover_base_url
from serving.lifecycle import send_error
from serving.request_hooks import load_request_hook
from serving.triton_glue import (TritonMetricSink, TritonTransport, metric_labels, streaming_model_options,
                                 place_engine, read_inputs, unreadable)

log = logging.getLogger("llm")


class TritonPythonModel:
    def initialize(self, args):
        model_config, options = streaming_model_options(args)
        self._input_names = [i["name"] for i in model_config["input"]]
        request_hook = load_request_hook(options.request_hook_module)  # tests only: fault injection
        from inflight.engine import LLMEngine
        from serving.frontend import InflightFrontend
        from serving.metrics_export import MetricsExporter

        place_engine(args, model_config, options)  # this instance's GPU, or its share of the CPU cores
        log.info("loading %s with %s", options.engine.model, options.engine)
        self.engine = LLMEngine(options.engine)
        self.transport = TritonTransport()
        self.frontend = InflightFrontend(
            self.engine, self.transport, options.limits, options.cancel_check_period_s,
            # Triton unloads the model only after every in-flight request had its final: notice the unload
            # (or server shutdown) and end them, or shutdown waits out --exit-timeout-secs and then crashes.
            is_ready=HealthProbe.for_model(discover_base_url(), args["model_name"], str(args["model_version"])),
            request_hook=request_hook,
            request_defaults=options.request_defaults)
        self.exporter = MetricsExporter(self._metrics_snapshot, TritonMetricSink(), metric_labels(args),
                                        options.metrics_interval_s)
        self.frontend.start()
        self.exporter.start()

    def _metrics_snapshot(self):
        snap = self.engine.metrics.snapshot()
        snap["gauges"]["num_requests_inflight"] = self.frontend.num_inflight
        return snap

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs, parameters = read_inputs(request, self._input_names)
            except Exception as e:  # noqa: BLE001 - this request only
                send_error(self.transport, sender, unreadable(e))
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
