"""In-process stand-ins for time and for the encoder, so scheduler and service rules run without sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from encode_server.models import ItemLayout
from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodedPart, EncodeError, EncodeJob, PartMeta, Timings
from encode_server.scheduling.policy import BatchPolicy
from encode_server.scheduling.scheduler import EncoderScheduler

#: The layout of every fake job: 4 rows.
LAYOUT = ItemLayout(tokens=4, grid_thw=(1, 4, 4))


def job(req_id: str, modality: str = "image", probe: bool = False) -> EncodeJob:
    """A one-item job of 4 rows (its item is never looked at by a fake engine)."""
    return EncodeJob(meta=PartMeta(req_id=req_id, part_idx=0, num_parts=1, modality=modality), items=(None,),
                     layouts=(LAYOUT,), probe=probe)


class FakeClock:
    """A clock that moves only when told to; `wait` returns on the event or when `advance` passes its timeout."""

    def __init__(self, start: float = 1000.0) -> None:
        self.time = start
        self._sleepers: list[tuple[float, asyncio.Future]] = []

    def now(self) -> float:
        return self.time

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        if event.is_set():
            return
        woken = asyncio.ensure_future(event.wait())
        waiters = {woken}
        if timeout is not None:
            timer = asyncio.get_running_loop().create_future()
            self._sleepers.append((self.time + timeout, timer))
            waiters.add(timer)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def advance(self, seconds: float) -> None:
        """Move time on, wake the sleepers whose timeout passed, and let the loop run what follows."""
        self.time += seconds
        due = [timer for deadline, timer in self._sleepers if deadline <= self.time]
        self._sleepers = [(deadline, timer) for deadline, timer in self._sleepers if deadline > self.time]
        for timer in due:
            if not timer.done():
                timer.set_result(None)
        await settle()


async def settle(rounds: int = 20) -> None:
    """Let every ready task run (the scheduler, batch tasks, futures' callbacks)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def until(condition, seconds: float = 10.0) -> None:
    """Wait (really) until `condition()` holds: for work that runs in real threads."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


class FakeEngine:
    """Records each batch it is given; answers each job with `tokens` rows of its index, or holds the
    batch until `release()` when `hold` is set."""

    def __init__(self, hold: bool = False, width: int = 4) -> None:
        self.batches: list[list[str]] = []
        self.hold = hold
        self.width = width
        self.running = 0
        self.most_running = 0
        self._gate = asyncio.Event()

    def release(self) -> None:
        self._gate.set()

    async def encode(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodedPart | EncodeError]:
        self.batches.append([job.req_id for job in jobs])
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.hold:
                await self._gate.wait()
            return [EncodedPart(embedding=torch.full((job.tokens, self.width), float(index)), layouts=job.layouts,
                                batch_size=len(jobs), timings=Timings(encode=1.0))
                    for index, job in enumerate(jobs)]
        finally:
            self.running -= 1


class SchedulerRig:
    """Builds started schedulers on fake clocks (`rig(policy) -> scheduler, engine, clock`) and stops them all."""

    def __init__(self, make_engine, max_in_flight: int) -> None:
        self._make_engine = make_engine
        self._max_in_flight = max_in_flight
        self._made: list[EncoderScheduler] = []

    def __call__(self, policy: BatchPolicy, engine: FakeEngine | None = None, max_in_flight: int | None = None):
        clock = FakeClock()
        engine = engine or self._make_engine()
        scheduler = EncoderScheduler(engine, policy, ServerMetrics(), clock=clock,
                                     max_in_flight=self._max_in_flight if max_in_flight is None else max_in_flight)
        scheduler.start()
        self._made.append(scheduler)
        return scheduler, engine, clock

    async def close(self) -> None:
        for scheduler in self._made:
            scheduler.engine.release()
            await scheduler.stop()
