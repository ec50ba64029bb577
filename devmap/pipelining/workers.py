"""The stage threads of a pipeline: one per stage, each launching its stage's work in order, so that no stage
waits for another stage's kernel launches; the first error of any of them is raised in the caller."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class StageWorkers:
    """One thread per stage; tasks in, completions out; the first error is raised in the caller."""

    def __init__(self, count: int) -> None:
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in range(count)]
        self.done: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._loop, args=(box,), daemon=True) for box in self.inboxes]

    def _loop(self, inbox: queue.Queue) -> None:
        while True:
            task = inbox.get()
            if task is None:
                return
            try:
                task()
                self.done.put(None)
            except BaseException as exc:  # handed to the caller
                self.done.put(exc)

    def __enter__(self) -> "StageWorkers":
        for t in self.threads:
            t.start()
        return self

    def run(self, tasks: list[tuple[int, Callable[[], None]]]) -> None:
        for stage, task in tasks:
            self.inboxes[stage].put(task)
        errors = [e for e in (self.done.get() for _ in tasks) if e is not None]
        if errors:
            raise errors[0]

    def __exit__(self, *exc: Any) -> None:
        for box in self.inboxes:
            box.put(None)
        for t in self.threads:
            t.join()
