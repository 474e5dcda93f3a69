"""Measuring the sections that have a no-msgspec twin, and printing their tables."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.capacity import capacity
from benchmarks.codec_costs import build_encode_costs, decode_costs
from benchmarks.helpers import fmt
from benchmarks.rounds import ROUNDS
from benchmarks.router import subscriber_rates


def child_figures(sections: list[str], reps: int) -> dict[str, Any]:
    """The same sections measured without msgspec, in a process that never imports it."""
    env = {**os.environ, "TSKV_CODEC": "msgpack"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--json", f"--reps={reps}"]
        + [f"--only={s}" for s in sections],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def measure(sections: list[str], reps: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    if "build" in sections:
        figures["build"] = build_encode_costs()
    if "decode" in sections:
        figures["decode"] = decode_costs()
    if "subscriber" in sections:
        figures["subscriber"] = {
            shape: {
                name: [subscriber_rates(shape, count // 2)[name] for _ in range(reps)]
                for name in subscriber_rates(shape, 100)
            }
            for shape, count in ROUNDS.items()
        }
    if "capacity" in sections:
        figures["capacity"] = capacity(reps)
    return figures


def report(figures: dict[str, Any], plain: dict[str, Any], out: Callable[[str], None]) -> None:
    if "build" in figures:
        out("\n## Build + encode a round with new events (µs per round, median of 5 timings)\n")
        out("| shape | TokenSpeed Structs | tskv | × TokenSpeed | tskv strict | tskv, no msgspec |")
        out("|---|---|---|---|---|---|")
        for shape, row in figures["build"].items():
            base = row.get("TokenSpeed Structs", math.nan)
            nomsgspec = plain.get("build", {}).get(shape, {}).get("tskv", math.nan)
            out(
                f"| {shape} | {base:.1f} | {row['tskv']:.1f} | {row['tskv'] / base:.2f} | "
                f"{row['tskv, strict']:.1f} | {nomsgspec:.1f} |"
            )
        out("\nFrom the scheduler's own event objects (`scheduler_kv_event_to_wire_event`):\n")
        out("| shape | TokenSpeed from scheduler objects | tskv from scheduler objects | × |")
        out("|---|---|---|---|")
        for shape, row in figures["build"].items():
            base = row.get("TokenSpeed from scheduler objects", math.nan)
            ours = row["tskv from scheduler objects"]
            out(f"| {shape} | {base:.1f} | {ours:.1f} | {ours / base:.2f} |")
    if "decode" in figures:
        out("\n## Decode a batch (µs per batch, median of 5 timings)\n")
        out("| shape | msgspec typed (TokenSpeed Structs) | tskv | × msgspec | tskv, no msgspec |")
        out("|---|---|---|---|---|")
        for shape, row in figures["decode"].items():
            base = row.get("msgspec typed", math.nan)
            nomsgspec = plain.get("decode", {}).get(shape, {}).get("tskv", math.nan)
            out(
                f"| {shape} | {base:.1f} | {row['tskv']:.1f} | {row['tskv'] / base:.2f} | "
                f"{nomsgspec:.1f} |"
            )
    if "subscriber" in figures:
        out("\n## A router decoding every batch (batches/s, median (min..max))\n")
        out("| shape | bare pyzmq SUB + msgspec typed decode | open_subscriber | × bare |")
        out("|---|---|---|---|")
        for shape, row in figures["subscriber"].items():
            base = row.get("bare pyzmq + msgspec", [math.nan])
            ours = row["open_subscriber"]
            ratio = statistics.median(ours) / statistics.median(base)
            out(f"| {shape} | {fmt(base)} | {fmt(ours)} | {ratio:.2f} |")
    if "capacity" in figures:
        out("\n## Publisher capacity, new events every round (batches/s, median (min..max))\n")
        names = list(next(iter(figures["capacity"].values())))
        out("| shape | " + " | ".join(names) + " | Trio × baseline | tskv, no msgspec |")
        out("|---|" + "---|" * (len(names) + 2))
        for shape, row in figures["capacity"].items():
            ratio = statistics.median(row["tskv Trio"]) / statistics.median(row["baseline"])
            nomsgspec = plain.get("capacity", {}).get(shape, {}).get("tskv Trio", [math.nan])
            cells = " | ".join(fmt(row[name]) for name in names)
            out(f"| {shape} | {cells} | {ratio:.2f} | {fmt(nomsgspec)} |")
