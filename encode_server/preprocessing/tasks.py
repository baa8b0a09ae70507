"""The preprocessing pool's waiting items, and which one a free worker takes next.

A `Submission` is one `PreprocessPool.submit` call (its future, and a result slot per item); each of
its items is a `Task`. `TaskQueue` holds the tasks no worker has yet, in two lines: ordinary ones
(items of dispatched batches, and retries, which go first) and spare ones (work ahead of need, from
`submit(spare=True)`). A free worker takes the oldest ordinary task; only when there is none, the
oldest spare task of a claimed submission (its batch was dispatched meanwhile), else the oldest spare
task. Tasks whose submission was cancelled or already answered are skipped. The conductor thread
alone uses it; `Submission.spare` is the one field another thread writes (`claim`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass
class Submission:
    """One `submit` call: its future and a result slot per item."""

    future: Future
    modality: str
    results: list[Any]
    remaining: int
    spare: bool = False  # its tasks wait until no ordinary task does, until claimed


class SubmissionFuture(Future):
    """The future `submit` returns, knowing its submission (so that `claim` can find it)."""

    submission: Submission | None = None


@dataclass
class Task:
    """One item of a submission, on its way through a worker."""

    submission: Submission
    index: int
    raw: bytes | list[bytes]
    location: str
    attempts: int = 0
    task_id: int = 0

    @property
    def wanted(self) -> bool:
        future = self.submission.future
        return not future.cancelled() and not future.done()


class TaskQueue:
    """Tasks waiting for a worker: ordinary first, then spare (claimed first); see the module docstring."""

    def __init__(self) -> None:
        self._ordinary: deque[Task] = deque()
        self._spare: deque[Task] = deque()  # short: the scheduler bounds the work it sends ahead

    def __bool__(self) -> bool:
        return bool(self._ordinary or self._spare)

    def add(self, submission: Submission, tasks: list[Task]) -> None:
        (self._spare if submission.spare else self._ordinary).extend(tasks)

    def retry(self, task: Task) -> None:
        """Put back a task whose worker died or could not take it: it goes first."""
        self._ordinary.appendleft(task)

    def take(self) -> Task | None:
        """The task a free worker should run next, or None when none is wanted."""
        while self._ordinary:
            task = self._ordinary.popleft()
            if task.wanted:
                return task
        while self._spare and not self._spare[0].wanted:
            self._spare.popleft()
        if not self._spare:
            return None
        task = next((task for task in self._spare if not task.submission.spare), self._spare[0])
        self._spare.remove(task)
        return task

    def drain(self) -> list[Task]:
        """Remove and return every waiting task (to fail them)."""
        tasks = [*self._ordinary, *self._spare]
        self._ordinary.clear()
        self._spare.clear()
        return tasks
