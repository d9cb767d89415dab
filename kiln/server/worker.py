"""The engine worker: one thread owns the model and runs queued requests one at a time.

HTTP handlers run on the event loop; they hand a `Job` to the worker through a bounded queue and
read its events from an asyncio queue the worker fills with `call_soon_threadsafe`: for each of the
job's prompts in turn (a chat has one, a /v1/completions batch several) ("text", (index, piece))
events then ("done", (index, Outcome)) with its token counts; or ("error", exception). A job whose
client went away is skipped, or stopped at its next piece.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from dataclasses import dataclass

from ..api import LLM, Generation
from ..sampling import SamplingParams


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


class Worker:
    def __init__(self, llm: LLM, queue_limit: int):
        self.llm = llm
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_limit)  # waiting jobs, the running one excluded
        self.running = False
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
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            if not job.cancelled.is_set():
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
            for piece in run:
                if job.cancelled.is_set():
                    return False
                job.emit("text", (index, piece))
            finish = OPENAI_FINISH.get(run.finish_reason, "length")
            outcome = Outcome(finish, len(prompt_ids), len(run.token_ids), run.stream.times.cached_tokens)
            job.emit("done", (index, outcome))
            return True
        except Exception as e:  # a bug: the request fails, the worker lives on
            traceback.print_exc(file=sys.stderr)
            job.emit("error", e)
            return False
        finally:
            if run is not None:
                run.close()  # end the engine loop now, not whenever it is collected
