"""Compiling a model's steps in a process of its own (`devmap.serving.compile_worker`): the one-layer-per-stage map a
worker mirrors, when no worker stands in, a worker's entries loaded by the whole model without compiling (CPU,
aot_eager, where this torch keeps its entries), and a worker that fails or ends leaving the compile to the serving
process."""

import dataclasses
import json
import logging
import subprocess

import pytest
import torch

import devmap
from devmap.compat import ahead_of_time_keeps
from devmap.generation import region_store
from devmap.serving import compile_worker
from devmap.serving.compile_worker import WorkerJob, compile_apart, compiled_before, worker_job
from devmap.serving.warm_up import warm_up


def test_a_worker_mirrors_each_stage_with_one_layer():
    mirror = compile_worker._one_layer_per_stage
    assert mirror({"": "cuda:0"}) == {"": "cuda:0"}
    split = {"model.embed_tokens": 0, **{f"model.layers.{i}": 0 if i < 4 else 1 for i in range(8)},
             "model.norm": 1, "lm_head": 1}
    assert mirror(split) == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                             "lm_head": 1}
    assert mirror({"model.layers.0": "cuda:0", "model.layers.1": "cuda:0", "lm_head": "cuda:0"}) == {
        "model.layers.0": "cuda:0", "lm_head": "cuda:0"}
    assert mirror({"model.layers.0": 0, "model.layers.1": "cpu", "lm_head": 0}) is None  # offloaded: no worker
    assert mirror({"model.layers.0": 0, "model.layers.1.mlp": 1, "model.layers.1.self_attn": 0}) is None
    assert mirror({"": "cpu"}) is None and mirror({}) is None


def test_no_worker_without_a_store_or_off_gpus(model_root, tmp_path):
    model = devmap.load(str(model_root / "tiny"), device_map="cpu")
    assert worker_job(model, None, 8, 256, None, {}) is None  # no store
    region_store.keep_regions_in(tmp_path)
    try:
        assert worker_job(model, None, 8, 256, None, {}) is None  # a CPU model
    finally:
        region_store.keep_regions_in(None)


def _job(model, layers: int) -> WorkerJob:
    config = model.config.to_dict()
    config["num_hidden_layers"] = layers
    return WorkerJob(config, {"": "cpu"}, "float32", None, 8, 64, None, torch.get_num_threads())


def test_the_whole_model_loads_a_one_layer_workers_entries_and_compiles_none(model_root, tmp_path, compiled_on_cpu,
                                                                             monkeypatch):
    if not ahead_of_time_keeps("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves inductor's entries only")
    model = devmap.load(str(model_root / "tiny"), device_map="cpu", dtype="float32")
    assert model.config.num_hidden_layers > 1
    monkeypatch.setenv("DEVMAP_REGION_STORE", str(tmp_path / "regions"))
    try:
        compile_worker.run(_job(model, 1))  # in this process: its backend is the test's (aot_eager)
        made = region_store.region_totals()
        assert made.compiled >= 4 and list((tmp_path / "regions").rglob(f"*{region_store.SUFFIX}"))

        region_store.keep_regions_in(tmp_path / "regions")  # as the serving process: the store read afresh
        torch._dynamo.reset()
        from devmap.serving.prepare import pin_attention, prepare_weights

        prepare_weights(model, "tiny")
        pin_attention(model)
        before = region_store.region_totals()
        warm_up(model, 8, 64, beside_serving=True)
        after = region_store.region_totals()
        assert after.compiled == before.compiled and after.loaded > before.loaded
    finally:
        region_store.keep_regions_in(None)


def test_a_worker_that_fails_is_logged_and_leaves_no_marker(model_root, tmp_path, caplog):
    model = devmap.load(str(model_root / "tiny"), device_map="cpu")
    job = _job(model, 1)
    job = dataclasses.replace(job, config={**job.config, "model_type": "no-such-model"})
    region_store.keep_regions_in(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="devmap.serving"):
            assert not compile_apart(job, lambda: False)
        assert not compiled_before(job)
        failed = [r.getMessage() for r in caplog.records if "process of its own failed" in r.getMessage()]
        assert len(failed) == 1 and "no-such-model" in failed[0]
    finally:
        region_store.keep_regions_in(None)


class _Finished:
    def __init__(self, code: int, stdin) -> None:
        self.returncode, self.stdin, self.killed = code, stdin, False

    def poll(self):
        return None if self.returncode is None else self.returncode

    def kill(self):
        self.killed, self.returncode = True, -9

    def wait(self):
        return self.returncode


def test_a_finished_worker_marks_its_job_and_a_stopped_one_is_killed(model_root, tmp_path, monkeypatch):
    model = devmap.load(str(model_root / "tiny"), device_map="cpu")
    job, sent, started = _job(model, 1), [], []

    class Pipe:
        def write(self, data):
            sent.append(json.loads(data))

        def close(self):
            pass

    def popen(command, **kwargs):
        started.append(_Finished(code, Pipe()))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    region_store.keep_regions_in(tmp_path)
    try:
        code = None  # still running: stopped
        assert not compile_apart(job, lambda: True) and started[-1].killed and not compiled_before(job)
        code = 0
        assert compile_apart(job, lambda: False) and compiled_before(job)
        assert WorkerJob(**sent[-1]).key() == job.key()  # what the worker reads is the job (JSON: string keys)
    finally:
        region_store.keep_regions_in(None)

