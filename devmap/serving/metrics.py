"""Prometheus metrics of one service, in two registries: the API's (HTTP requests, tokens in and out, time to first
token, queue depth as the API sees it) and the engine core's (batches, steps, the loop's phases, memory, models),
which may live in another process. `/metrics` shows both, each family once."""

from __future__ import annotations

from typing import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..planning.devices import DeviceKey, device_label

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class ApiMetrics:
    """Requests, tokens, latencies and the queue, as the HTTP side sees them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("devmap_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("devmap_prompt_tokens", "Prompt tokens received", ["model"], registry=r)
        self.completion_tokens = Counter("devmap_completion_tokens", "Tokens generated and returned", ["model"],
                                         registry=r)
        self.queue_depth = Gauge("devmap_queue_depth", "Requests submitted that have no token yet (waiting for a "
                                 "batch, or in their prefill)", registry=r)
        self.latency = Histogram("devmap_request_seconds", "Request latency, arrival to last byte", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("devmap_time_to_first_token_seconds", "Arrival to the first generated token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.ready_seconds = Gauge("devmap_serve_ready_seconds", "Seconds from devmap serve's start until it "
                                   "starts answering HTTP: its engine core started, the models on its command line "
                                   "loaded (the core's part: devmap_startup_seconds)", registry=r)
        self.gc_pauses = Histogram("devmap_api_gc_pause_seconds", "Python garbage collections in the API's process "
                                   "(each holds every stream of it)", buckets=GC_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    """Batches, decode steps, the engine loop's phases, garbage collections, resident models and device memory."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("devmap_running_requests", "Requests in the batch running now", registry=r)
        self.batch_size = Histogram("devmap_batch_size", "Requests a continuous batch started with",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.preemptions = Counter("devmap_preemptions", "Batches stopped between steps for requests that could not "
                                   "join them, their unfinished ones continuing in a later batch", registry=r)
        self.engine_seconds = Counter("devmap_engine_seconds", "The engine loop's time by phase: launch (joins and a "
                                      "decode step launched), collect (waiting for tokens to come back: the GPUs' "
                                      "time the host could not hide), hand_back (tokens out to the API), "
                                      "schedule (the queue and the scheduler), idle (every row free, waiting for "
                                      "requests)", ["phase"], registry=r)
        self.decode_steps = Counter("devmap_decode_steps", "Decode steps issued by continuous batches", registry=r)
        self.failed_steps = Counter("devmap_failed_steps", "Steps (or batch starts) that failed: the requests whose "
                                    "prompts ran in them ended or joined alone, the others continued", registry=r)
        self.joined = Counter("devmap_joined_requests", "Requests that took a free row of a running batch "
                              "(continuous batching)", registry=r)
        self.gc_pauses = Histogram("devmap_gc_pause_seconds", "Python garbage collections in the engine core's "
                                   "process (each holds every thread of it)",
                                   buckets=GC_BUCKETS, registry=r)
        self.stage_busy = Gauge("devmap_stage_busy_share", "How busy each pipeline stage's GPU was in the last "
                                "sampled window of a batch's steps: its work's time over the span from its first work "
                                "to its last (near 1 where the stages overlap and the host keeps up)",
                                ["stage", "device"], registry=r)
        self.stage_busy_seconds = Counter("devmap_stage_busy_seconds", "Time each pipeline stage's GPU ran work in "
                                          "sampled windows of steps (beside devmap_stage_sampled_seconds)",
                                          ["stage", "device"], registry=r)
        self.stage_sampled_seconds = Counter("devmap_stage_sampled_seconds", "The spans of the sampled windows of "
                                             "steps, per pipeline stage", ["stage", "device"], registry=r)
        self.models = Gauge("devmap_resident_models", "Models loaded", registry=r)
        self.startup = Gauge("devmap_startup_seconds", "Seconds the service's start took by phase: core_process "
                             "(the engine core's process from its spawn to ready: interpreter and imports), "
                             "api_imports (devmap serve's process from its start through its own imports, beside "
                             "the core's), command_line_loads (the models devmap serve was given, one after the "
                             "other; each load's phases are devmap_model_load_seconds)", ["phase"], registry=r)
        self.load_seconds = Gauge("devmap_model_load_seconds", "Seconds each phase of a resident model's load took "
                                  "(plan, weights, prepare, compile: torch.compile, from the compile cache or not, "
                                  "capture: its steps' CUDA graphs, warm_up: the rest of its warm-up batch)",
                                  ["model", "phase"], registry=r)
        self.compiled_graphs = Gauge("devmap_model_compiled_graphs", "Graphs a resident model's compile made, by "
                                     "where they came from (cache: the compile cache; new: compiled)",
                                     ["model", "source"], registry=r)
        self.device_memory = Gauge("devmap_device_memory_bytes", "Memory allocated by torch on each GPU",
                                   ["device"], registry=r)
        self.device_memory_peak = Gauge("devmap_device_memory_peak_bytes", "The most memory torch has allocated on "
                                        "each GPU since the service started", ["device"], registry=r)
        self.device_memory_reserved = Gauge("devmap_device_memory_reserved_bytes", "Memory torch's caching "
                                            "allocator holds on each GPU (allocated, cached, CUDA graph pools)",
                                            ["device"], registry=r)
        self.planned_memory = Gauge("devmap_device_memory_planned_bytes", "What the resident models' plans hold on "
                                    "each device at their largest batches (weights, KV cache, activations)",
                                    ["device"], registry=r)

    def render(self, planned: Mapping[DeviceKey, int] | None = None) -> bytes:
        """The text exposition format, with device memory read now beside `planned` (bytes per device)."""
        import torch

        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                label = f"cuda:{index}"
                self.device_memory.labels(device=label).set(torch.cuda.memory_allocated(index))
                self.device_memory_peak.labels(device=label).set(torch.cuda.max_memory_allocated(index))
                self.device_memory_reserved.labels(device=label).set(torch.cuda.memory_reserved(index))
        self.planned_memory.clear()
        for key, size in (planned or {}).items():
            self.planned_memory.labels(device=device_label(key)).set(size)
        return generate_latest(self.registry)
