"""What `tskv demo --route N --trace FILE` prints: every policy's hit rate, prefill and load on
the trace, beside the ceiling, as a table, as JSON, and as a plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tskv.sim.plotting import pyplot
from tskv.sim.trace import TraceRequest, max_hit_rate
from tskv.sim.trace_routing import (
    HYBRID_POLICIES,
    POLICIES,
    ProgressBar,
    TraceOptions,
    TraceResult,
    run_policy,
)


async def compare_trace(
    requests: list[TraceRequest],
    options: TraceOptions,
    out: Callable[[str], None],
    *,
    as_json: bool = False,
    plot: str | None = None,
) -> list[TraceResult]:
    """Run every policy on the trace and report them; the caller decides the exit status."""
    bar = ProgressBar(len(requests))
    policies = POLICIES if options.model == "full" else HYBRID_POLICIES
    results = [await run_policy(policy, requests, options, bar) for policy in policies]
    ceiling = max_hit_rate(requests, options.block_size)
    if as_json:
        out(json.dumps(summary(requests, ceiling, results)))
    else:
        for line in table(requests, options, ceiling, results):
            out(line)
    if plot is not None:
        saved = save_trace_plot(results, options, plot)
        if not as_json:
            out(f"plot written to {plot}" if saved else "plot: matplotlib is not installed")
    return results


def summary(
    requests: list[TraceRequest], ceiling: float, results: list[TraceResult]
) -> dict[str, Any]:
    return {
        "requests": len(requests),
        "max_hit_rate": round(ceiling, 4),
        "policies": {result.policy: result.summary() for result in results},
        "index_exact": all(result.index_exact for result in results),
        "answers_exact": all(result.exact_answers == result.answers for result in results),
        "model": results[0].model if results else "full",
    }


def table(
    requests: list[TraceRequest],
    options: TraceOptions,
    ceiling: float,
    results: list[TraceResult],
) -> list[str]:
    even = 1 / options.workers
    lines = [
        f"tskv demo --route {options.workers} --trace: {len(requests):,} requests, "
        f"{options.workers} workers of {options.cache_tokens:,} cached tokens, "
        f"{options.prefill_rate:,.0f} prompt tokens/s each, block size {options.block_size}, "
        f"model {options.model}",
        f"an infinite shared cache would hit {ceiling:.1%} of prompt tokens (the ceiling)",
        "",
        f"{'policy':>22}   hit rate   of ceiling   tokens to prefill   busiest worker",
    ]
    for r in results:
        of_ceiling = f"{r.hit_rate / ceiling:10.0%}" if ceiling else f"{'n/a':>10}"
        lines.append(
            f"{r.policy:>22}   {r.hit_rate:8.1%}   {of_ceiling}   "
            f"{r.prompt_tokens - r.cached_tokens:17,}   {r.max_load_share:6.1%} (even: {even:.1%})"
        )
    exact = all(r.index_exact for r in results)
    answers = sum(r.answers for r in results)
    right = sum(r.exact_answers for r in results)
    seconds = sum(r.seconds for r in results)
    lines += [
        "",
        "the index equals every worker's cache at the end of every run: "
        + ("yes" if exact else "NO"),
        "its answer equals every engine's own hit (the last requests, every worker): "
        + ("yes" if right == answers else "NO")
        + f" ({right:,} of {answers:,})",
        *blind_line(results),
        f"({seconds:.1f} s for the {len(results)} runs)",
    ]
    return lines


def blind_line(results: list[TraceResult]) -> list[str]:
    """How far an index of full attention alone is off a hybrid model's engines."""
    over = sum(r.blind_over for r in results)
    if results and results[0].model == "full":
        return []
    extra = sum(r.blind_extra for r in results)
    answers = sum(r.answers for r in results)
    return [
        f"an index of full attention alone (Dynamo's) promised more than the engine would "
        f"reuse in {over:,} of {answers:,} answers, {extra / max(over, 1):.1f} blocks too many "
        "on average"
    ]


def save_trace_plot(results: list[TraceResult], options: TraceOptions, path: str) -> bool:
    """Hit rate over the trace per policy, and each worker's load: a PNG when matplotlib is
    installed; False (nothing written) otherwise."""
    plt = pyplot()
    if plt is None:
        return False
    figure, (over_time, load) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        points = result.hit_rate_over_time
        over_time.plot([100 * (i + 1) / len(points) for i in range(len(points))],
                       [100 * rate for rate in points], label=result.policy)  # fmt: skip
    over_time.set_xlabel("% of the trace routed")
    over_time.set_ylabel("prefix cache hit rate so far (%)")
    over_time.legend()
    width = 0.8 / len(results)
    for offset, result in enumerate(results):
        total = sum(result.load) or 1
        positions = [w + offset * width for w in range(options.workers)]
        load.bar(positions, [100 * tokens / total for tokens in result.load], width,
                 label=result.policy)  # fmt: skip
    load.axhline(100 / options.workers, color="grey", linestyle=":", label="even")
    load.set_xlabel("worker")
    load.set_ylabel("share of prompt tokens (%)")
    load.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True
