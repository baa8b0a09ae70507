"""`delivery.destinations.Registrations` in-process: what parking remembers, and for how long."""

from __future__ import annotations

import asyncio
import gc

import pytest

from encode_server.delivery.destinations import Registrations
from encode_server.delivery.sockets import EmbeddingSender

pytestmark = pytest.mark.quick


def run(scenario) -> None:
    async def main() -> None:
        sender = EmbeddingSender(send_timeout_s=1.0)
        try:
            await scenario(Registrations(sender, ttl_s=60.0, park_ttl_s=0.05))
        finally:
            sender.close()

    asyncio.run(main())


def test_an_embedding_nobody_registers_for_is_forgotten_at_the_park_ttl_not_the_registration_ttl():
    async def scenario(registrations: Registrations) -> None:
        for index in range(100):
            registrations.park(f"r{index}", 0, [b"header", b"x" * 1000])
        assert len(registrations) == 100 and registrations.parked() == (100 * 1006, 100)
        await asyncio.sleep(0.2)
        assert len(registrations) == 0 and registrations.parked() == (0, 0)

    run(scenario)


def test_what_else_an_entry_holds_keeps_it_after_its_parked_part_goes():
    async def scenario(registrations: Registrations) -> None:
        registrations.park("registered", 0, [b"h", b"x"])
        registrations.register("registered", "tcp://127.0.0.1:1", 2)  # one of two receivers
        registrations.park("failed", 0, [b"h", b"x"])
        registrations.park_failure("failed", [b"error", b""])
        registrations.park("waited", 0, [b"h", b"x"])
        waiter = asyncio.ensure_future(registrations.receivers("waited", timeout=5))
        await asyncio.sleep(0.2)  # every parked part is gone by now
        assert registrations.parked() == (0, 0) and len(registrations) == 3
        # The waiting delivery still hears of the receivers registering after the parked part went.
        registrations.register("waited", "tcp://127.0.0.1:2", 1)
        assert await asyncio.wait_for(waiter, 1) == ["tcp://127.0.0.1:2"]

    run(scenario)


def test_parked_parts_expire_in_order_and_a_taken_or_replaced_part_is_not_dropped_twice():
    async def scenario(registrations: Registrations) -> None:
        registrations.park("taken", 0, [b"h", b"x" * 10])
        registrations.park("replaced", 0, [b"h", b"old"])
        registrations.register("taken", "tcp://127.0.0.1:1", 1)  # complete: the part leaves for its receiver
        registrations.park("replaced", 0, [b"h", b"new!"])  # the same part again replaces the first copy
        assert registrations.parked() == (5, 1)
        await asyncio.sleep(0.03)
        registrations.park("later", 0, [b"h", b"y" * 100])
        await asyncio.sleep(0.04)  # the first parks' TTL has passed, not the later one's
        assert registrations.parked() == (101, 1)
        await asyncio.sleep(0.2)
        assert registrations.parked() == (0, 0) and len(registrations) == 1  # "taken" stays registered

    run(scenario)


def test_parking_beyond_the_byte_budget_keeps_nothing_and_a_park_costs_few_tracked_objects():
    async def scenario(registrations: Registrations) -> None:
        registrations._parked.max_bytes = 1000
        registrations.park("fits", 0, [b"h", b"x" * 900])
        registrations.park("over", 0, [b"h", b"x" * 200])
        assert registrations.parked() == (901, 1) and len(registrations) == 1
        registrations._parked.max_bytes = 1 << 30
        gc.collect()
        before = len(gc.get_objects())
        for index in range(1000):
            registrations.park(f"r{index}", 0, [b"header", memoryview(b"x" * 100)])
        # Each park is a few containers (a dict of its parts, the kept copy, its place in the expiry queue), not
        # an entry with an event, lists and timers of its own: thousands of those make every GC pass longer.
        assert len(gc.get_objects()) - before < 5 * 1000

    run(scenario)
