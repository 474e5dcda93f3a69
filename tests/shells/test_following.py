"""Turns for bootstrapping from a snapshot: bounded, handed on, and lapsing (no sockets, so
the clock may jump)."""

from __future__ import annotations

import trio
import trio.testing

from tskv.shells._following import Bootstraps


async def test_a_turn_waits_for_one_to_end_or_lapse(autojump_clock: trio.abc.Clock) -> None:
    turns = Bootstraps(2)
    first, second, third, fourth = object(), object(), object(), object()
    await turns.take(first, longest=10)
    await turns.take(second, longest=100)
    got: list[tuple[object, float]] = []

    async def wait_for(turn: object) -> None:
        await turns.take(turn, longest=100)
        got.append((turn, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for, third)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # two turns are taken
        turns.done(second)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [(third, 0)]  # handed on at once
        nursery.start_soon(wait_for, fourth)
    assert got[1] == (fourth, 10)  # first never said it was done: its turn lapsed
    turns.done(second)  # done twice, or after lapsing: nothing more
    turns.done(first)
