"""The server's engine thread after a fatal GPU error (a CUDA error such as a device-side assert
leaves the process's CUDA context unusable): the running and waiting requests fail, new ones are
refused with 503, /health says so. Simulated on the CPU: Batch.step raises an error of the type and
message torch gives (torch.AcceleratorError, "CUDA error: ...")."""

from __future__ import annotations

import asyncio

import pytest

import kiln
from kiln.engine import Batch
from kiln.server.app import _failure
from kiln.server.worker import EngineDead, Job, Worker, fatal


class AcceleratorError(RuntimeError):
    """Stands in for torch.AcceleratorError (matched by name: older torch has no such class)."""


def test_a_fatal_gpu_error_fails_every_job_and_refuses_new_ones(monkeypatch):
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu")

    def step(self):
        raise AcceleratorError("CUDA error: device-side assert triggered\nmore lines")

    monkeypatch.setattr(Batch, "step", step)

    async def serve():
        worker = Worker(llm, queue_limit=8, max_batch=2)
        jobs = [Job([([1, 2, 3], kiln.SamplingParams(max_new_tokens=4))]) for _ in range(5)]
        for job in jobs:            # two run when the step fails, three wait in the queue
            worker.submit(job)
        worker.start()
        events = [await asyncio.wait_for(job.events.get(), 60) for job in jobs]
        with pytest.raises(EngineDead):
            worker.submit(Job([([1], kiln.SamplingParams(max_new_tokens=1))]))
        worker.stop()
        return worker, events

    worker, events = asyncio.run(serve())
    assert [kind for kind, _ in events] == ["error"] * 5
    assert worker.dead == "AcceleratorError: CUDA error: device-side assert triggered"
    assert sum(isinstance(e, EngineDead) for _, e in events) == 3       # the waiting ones
    assert {_failure(e).status for _, e in events} == {503}


def test_only_cuda_errors_are_fatal():
    assert fatal(AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert fatal(RuntimeError("CUDA error: device-side assert triggered"))
    assert not fatal(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not fatal(ValueError("a bug"))
    assert _failure(ValueError("a bug")).status == 500
    body = _failure(EngineDead("AcceleratorError: CUDA error: x")).body()["error"]
    assert body["code"] == "engine_dead" and "must be restarted" in body["message"]
