"""Triton model `llm_iterative`: Triton's own continuous batching (`sequence_batching { iterative_sequence: true }`)
around the in-flight engine's step. Each execute gets the requests Triton's sequence batcher chose, runs one engine
step over exactly them (iterative_arm.step_runner) and reschedules the unfinished ones.

Glue only: pb_utils requests -> HandedRequest, the runner's answers -> release flags, and the engine's metrics.
Also served as `llm` by `--model-config-name=iterative` (model_repository/llm/1/iterative.py links here).
"""
import logging

import triton_python_backend_utils as pb_utils

from serving.health_probe import HealthProbe, discover_base_url
from serving.request_hooks import load_request_hook
from serving.triton_glue import (TritonMetricSink, TritonTransport, metric_labels, streaming_model_options,
                                 place_engine, read_inputs)

log = logging.getLogger("llm_iterative")

TRITON_DEFAULT_IDLE_US = 1_000_000  # what Triton uses when the config leaves max_sequence_idle_microseconds out
SHORT_IDLE_S = 60.0  # below this, a long prefill step on a CPU can outlast it: warn at load


def _sequence_batching(model_config: dict) -> tuple[float, str]:
    """The idle timeout (seconds) and the strategy, refusing a config this model cannot run under."""
    batching = model_config.get("sequence_batching")
    if not batching or not batching.get("iterative_sequence"):
        raise pb_utils.TritonModelException("sequence_batching { iterative_sequence: true } is missing: this model "
                                            "runs one engine step per execute and reschedules; add it")
    if model_config.get("max_batch_size", 0) < 1:
        raise pb_utils.TritonModelException(f"max_batch_size={model_config.get('max_batch_size')} is not allowed: "
                                            "it is the number of sequence slots; allowed >= 1")
    strategy = "oldest" if "oldest" in batching else "direct"
    idle_us = int(batching.get("max_sequence_idle_microseconds") or 0) or TRITON_DEFAULT_IDLE_US
    return idle_us / 1e6, strategy


class TritonPythonModel:
    def initialize(self, args):
        model_config, options = streaming_model_options(args)
        idle_s, strategy = _sequence_batching(model_config)
        slots = model_config["max_batch_size"]
        if options.engine.max_num_seqs < slots:
            raise pb_utils.TritonModelException(
                f"max_num_seqs={options.engine.max_num_seqs} < max_batch_size={slots}: every sequence Triton gives a "
                f"slot must fit in the engine; allowed max_num_seqs >= max_batch_size")
        if idle_s < SHORT_IDLE_S:
            log.warning("max_sequence_idle_microseconds=%d: a step longer than that ends its requests with an error "
                        "(Triton releases their slots); raise it", round(idle_s * 1e6))
        self._input_names = [i["name"] for i in model_config["input"]]
        request_hook = load_request_hook(options.request_hook_module)  # tests only: fault injection
        from inflight.engine import LLMEngine
        from iterative_arm.step_runner import IterativeStepRunner
        from serving.metrics_export import MetricsExporter

        place_engine(args, model_config, options)  # this instance's GPU, or its share of the CPU cores
        log.info("loading %s with %s (%d sequence slots, %s strategy, idle timeout %.0f s)", options.engine.model,
                 options.engine, slots, strategy, idle_s)
        self.engine = LLMEngine(options.engine)
        self.transport = TritonTransport(batched=True)
        self.runner = IterativeStepRunner(
            self.engine, self.transport, options.limits, options.request_defaults, idle_s,
            is_serving=HealthProbe.for_model(discover_base_url(), args["model_name"], str(args["model_version"])),
            request_hook=request_hook)
        self.runner.start_idle_poller(options.cancel_check_period_s)
        self.sink, labels = TritonMetricSink(), metric_labels(args)
        self.exporter = MetricsExporter(self._metrics_snapshot, self.sink, labels, options.metrics_interval_s)
        self.exporter.start()
        self._counters = {name: self.sink.counter(f"llm_iterative_{name}_total", help_text, labels)
                          for name, help_text in (
                              ("executes", "Executes Triton's sequence batcher ran."),
                              ("null_requests", "NULL requests padding empty sequence slots (direct strategy)."),
                              ("held_back", "Live sequences left out of an execute (their inputs differ from the "
                                            "slot-0 request's), summed over executes."),
                              ("cancelled_between", "Sequences Triton cancelled between executes (it answered "
                                                    "them; their KV was freed at the next execute or by the idle "
                                                    "poller)."))}
        self._cancelled_reported = 0

    def _metrics_snapshot(self):
        snap = self.engine.metrics.snapshot()
        snap["gauges"]["num_requests_inflight"] = self.runner.num_live
        return snap

    def execute(self, requests):
        from iterative_arm.step_runner import HandedRequest

        handed = []
        for request in requests:
            cid = request.correlation_id()
            handed.append(HandedRequest(
                correlation_id=cid,
                is_start=bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
                client_id=request.request_id() if cid else "",
                sender=request.get_response_sender() if cid else None,  # a NULL request is never answered
                read_inputs=lambda request=request: read_inputs(request, self._input_names)))
        try:
            reschedule, stats = self.runner.execute(handed)
        except Exception:  # noqa: BLE001 - a bug here must not leave requests rescheduled forever
            log.exception("execute failed; ending every live request")
            self.runner.end_all("ended: internal error in execute")  # not close(): the idle poller must go on
            return None
        for request, again in zip(requests, reschedule):
            if again:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        try:
            self._record(stats)
        except Exception:  # noqa: BLE001 - metrics must never cost a step
            log.exception("recording the execute failed")
        return None

    def _record(self, stats) -> None:
        self._counters["executes"].increment(1)
        cancelled = self.runner.num_cancelled_between  # the idle poller's too (it touches no metric itself)
        for name, value in (("null_requests", stats.num_null), ("held_back", stats.num_absent),
                            ("cancelled_between", cancelled - self._cancelled_reported)):
            if value:
                self._counters[name].increment(value)
        self._cancelled_reported = cancelled

    def finalize(self):
        log.info("finalize: %d live sequence(s)", self.runner.num_live)
        self.runner.close()
        self.exporter.stop()
        log.info("finalize: done")
