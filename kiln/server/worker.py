"""The engine worker: one thread owns the model and runs queued requests: one at a time, or with
`--max-batch N` up to N prompts decoded together, joining and leaving between steps (kiln.engine.Batch).

HTTP handlers run on the event loop; they hand a `Job` to the worker through a bounded queue and
read its events from an asyncio queue the worker fills with `call_soon_threadsafe`: for each of the
job's prompts (a chat has one, a /v1/completions batch several: in turn, or together when batched)
("text", (index, piece)) events (("token", (index, id)) for a model without a tokenizer) then
("done", (index, Outcome)) with its token counts; or ("error",
exception). A job whose client went away is skipped, or stopped at its next piece (its row freed).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from dataclasses import dataclass

from ..api import LLM, Generation
from ..engine import Batch, BatchRequest
from ..sampling import SamplingParams
from .metrics import ServeStats, count_graphs, count_pool, state_bytes


@dataclass
class Outcome:
    finish_reason: str          # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int      # every token the model generated, an end-of-turn token included
    cached_tokens: int          # prompt tokens served from the previous request's state


# kiln's finish reasons -> OpenAI's: a stop string and an end-of-sequence token are both "stop", the
# max context is one more "length" (OpenAI has no value for it).
OPENAI_FINISH = {"stop": "stop", "eos": "stop", "length": "length", "context": "length"}


class Job:
    """One request: its prompts' ids and sampling settings, answered one after another in one queue slot."""

    def __init__(self, prompts: list[tuple[list[int], SamplingParams]]):
        self.prompts = prompts
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening
            self.cancelled.set()


class QueueFull(Exception):
    pass


class EngineDead(Exception):
    """The GPU failed in a way that leaves it unusable to this process (a CUDA error such as a
    device-side assert poisons its context): every later request would fail the same way."""


def fatal(e: BaseException) -> bool:
    """Whether an exception is such a CUDA error (an out-of-memory error is not: the next request may fit)."""
    return type(e).__name__ == "AcceleratorError" or str(e).startswith("CUDA error")


@dataclass
class _Slot:
    """One prompt of a job running in the batch."""
    job: Job
    index: int
    request: BatchRequest
    gen: Generation


class Worker:
    def __init__(self, llm: LLM, queue_limit: int, max_batch: int = 1):
        self.llm, self.max_batch = llm, max_batch
        self.stats = ServeStats()      # GET /metrics
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_limit)  # waiting jobs, the running one excluded
        self.running = False
        self.dead: str | None = None    # why the GPU is unusable (fatal): requests are refused from then on
        self._thread = threading.Thread(target=self._serve, name="kiln-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        while True:  # make room for the sentinel: waiting jobs are dropped at shutdown
            try:
                self.jobs.put_nowait(None)
                break
            except queue.Full:
                job = self.jobs.get_nowait()
                if job is not None:
                    job.cancelled.set()
        self._thread.join(timeout=5)

    def submit(self, job: Job) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def _die(self, e: BaseException) -> None:
        """After a fatal error: refuse new requests, fail the waiting ones, say so once on stderr."""
        if self.dead is None:
            self.dead = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[kiln] fatal: the GPU failed ({self.dead}); every request fails from now on: restart kiln serve",
                  file=sys.stderr, flush=True)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:             # the shutdown sentinel: back for the loop to see
                self.jobs.put_nowait(None)
                return
            self._refuse(job)

    def _refuse(self, job: Job) -> None:
        """A job failed with EngineDead (the GPU failed earlier): an OpenAI-shaped 503 for its client."""
        job.emit("error", EngineDead(self.dead))
        self.stats.done("error")

    def _serve(self) -> None:
        if self.max_batch > 1:
            return self._serve_batched()
        while (job := self.jobs.get()) is not None:
            if self.dead is not None:
                self._refuse(job)
            elif not job.cancelled.is_set():
                self.running = True
                try:
                    self._run(job)
                finally:
                    self.running = False

    def _run(self, job: Job) -> None:
        for index, (prompt_ids, params) in enumerate(job.prompts):
            if job.cancelled.is_set() or not self._run_one(job, index, prompt_ids, params):
                return

    def _run_one(self, job: Job, index: int, prompt_ids: list[int], params: SamplingParams) -> bool:
        """One prompt of the job; False when the job ends here (its client left, or a bug)."""
        run = None
        try:
            run = Generation(self.llm, prompt_ids, params)
            self.stats.running = 1
            for token in run.stream.ids:
                if job.cancelled.is_set():
                    self.stats.done("cancelled", len(prompt_ids))
                    return False
                self.stats.tokens(1)
                text, stopped = run.feed(token)
                self._piece(job, index, text, token)
                if stopped:
                    break
            else:
                self._piece(job, index, run.finish(), None)
            finish = OPENAI_FINISH.get(run.finish_reason, "length")
            outcome = Outcome(finish, len(prompt_ids), len(run.token_ids), run.stream.times.cached_tokens)
            self.stats.state_bytes = state_bytes(self.llm.engine.live_state)
            count_graphs(self.stats, self.llm.engine)
            self.stats.done(finish, len(prompt_ids), outcome.cached_tokens)
            self.stats.running = 0          # before the client hears it is done
            job.emit("done", (index, outcome))
            return True
        except Exception as e:  # a bug: the request fails, the worker lives on
            traceback.print_exc(file=sys.stderr)
            self.stats.done("error")
            job.emit("error", e)
            if fatal(e):
                self._die(e)
            return False
        finally:
            self.stats.running = 0
            if run is not None:
                run.close()  # end the engine loop now, not whenever it is collected

    # -- continuous batching (--max-batch > 1) ----------------------------------------------------
    def _serve_batched(self) -> None:
        """Jobs join the running batch between steps (up to max_batch prompts running; more wait in the
        queue) and leave it when they finish or their client goes: each step prefills one newcomer or
        decodes every running prompt at once (kiln.engine.Batch)."""
        batch = Batch(self.llm.engine, set(self.llm.eos_ids), slots=self.max_batch, prefix_cache=True)
        slots: list[_Slot] = []

        def drain() -> None:        # the slots' new tokens out; the finished ones leave the list
            kept, failed = [], set()
            for slot in slots:
                if id(slot.job) in failed:
                    continue
                try:
                    if self._drain(batch, slot):
                        kept.append(slot)
                except Exception as e:  # noqa: BLE001 - a bug in one job's text: it fails, the rest run on
                    traceback.print_exc(file=sys.stderr)
                    failed.add(id(slot.job))
                    slot.job.emit("error", e)
            for slot in slots:      # a failed job's unfinished prompts end with it
                if id(slot.job) in failed and not slot.request.done:
                    batch.cancel(slot.request)
                    self.stats.done("error")
            slots[:] = [slot for slot in kept if id(slot.job) not in failed]
            self.running = bool(slots)
            self.stats.running = len(slots)
        batch.on_tokens = drain     # also between the layers of a prefill, where decode steps run too
        while self._admit(batch, slots):
            self.running = bool(slots)
            self.stats.running = len(slots)
            if not slots:
                continue
            try:
                batch.step()
            except Exception as e:  # a bug: the running jobs fail, the worker lives on
                traceback.print_exc(file=sys.stderr)
                for slot in slots:
                    batch.cancel(slot.request)
                for job in {id(s.job): s.job for s in slots}.values():
                    job.emit("error", e)
                for _ in slots:
                    self.stats.done("error")
                slots.clear()
                if fatal(e):
                    self._die(e)
                continue
            self.stats.state_bytes = sum(state_bytes(slot.request.state) for slot in slots)
            count_graphs(self.stats, self.llm.engine)
            count_pool(self.stats, batch)
            drain()
        for slot in slots:          # shutting down
            slot.job.cancelled.set()

    def _admit(self, batch: Batch, slots: list[_Slot]) -> bool:
        """Waiting jobs into the batch while it has room (blocking only when nothing runs); False at
        the shutdown sentinel."""
        while len(slots) < self.max_batch:
            try:
                job = self.jobs.get(block=not slots)
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.cancelled.is_set():
                continue
            if self.dead is not None:
                self._refuse(job)
                continue
            try:
                for index, (ids, params) in enumerate(job.prompts):
                    self.llm.engine.check_prompt(ids)
                    r = batch.add(ids, params)
                    slots.append(_Slot(job, index, r, Generation(self.llm, ids, params, stream=r.stream)))
            except Exception as e:  # a prompt the engine refuses: the job fails, the others run on
                for slot in [s for s in slots if s.job is job]:
                    batch.cancel(slot.request)
                    slots.remove(slot)
                job.emit("error", e)
        return True

    def _drain(self, batch: Batch, slot: _Slot) -> bool:
        """The slot's new tokens as text events; False (and its row freed) once it is finished."""
        job, r, gen = slot.job, slot.request, slot.gen
        if job.cancelled.is_set():
            batch.cancel(r)
            self.stats.done("cancelled", len(gen.prompt_ids))
            return False
        while r.out:
            token = r.out.popleft()
            self.stats.tokens(1)
            text, stopped = gen.feed(token)
            self._piece(job, slot.index, text, token)
            if stopped:
                batch.cancel(r)
                return self._done(slot)
        if not r.done:
            return True
        self._piece(job, slot.index, gen.finish(), None)
        return self._done(slot)

    def _piece(self, job: Job, index: int, text: str, token: int | None) -> None:
        """A text piece as a "text" event; for a model without a tokenizer (no text at all) each token
        as a "token" event instead, so a stream still shows when each token came."""
        if text:
            job.emit("text", (index, text))
        elif token is not None and self.llm.tokenizer is None:
            job.emit("token", (index, token))

    def _done(self, slot: _Slot) -> bool:
        gen = slot.gen
        finish = OPENAI_FINISH.get(gen.finish_reason, "length")
        cached = slot.request.stream.times.cached_tokens
        self.stats.done(finish, len(gen.prompt_ids), cached)
        self.stats.running -= 1             # before the client hears it is done
        slot.job.emit("done", (slot.index, Outcome(finish, len(gen.prompt_ids), len(gen.token_ids), cached)))
        return False
