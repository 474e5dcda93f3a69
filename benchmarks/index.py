"""The prefix index beside Dynamo's RadixTree as a Python caller sees them, and one router
keeping it current over a fleet of publishers (`fleet`)."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.fleet import PROMPT, STEADY, subscriber_cost, watch_scale
from benchmarks.helpers import in_fresh_process, median_of_runs, percentile, runs_said
from benchmarks.rounds import BLOCK, blocks_per_round, churn_maker
from tskv.core import compiled
from tskv.core.block_keys import root_key
from tskv.core.codec import decode_batch, encode_batch
from tskv.core.config import SubscriberConfig
from tskv.core.events import BlockStored, KVEvent, KVEventBatch
from tskv.core.journal_index import JournalIndex
from tskv.core.prefix_index import PrefixIndex, _walk
from tskv.core.reader_messages import FrameReader, News, Report, frame, news
from tskv.core.worker_view import WorkerFigures
from tskv.shells._reader_mirror import ReaderMirror
from tskv.shells._watched import Roster, Watched
from tskv.sim.dynamo_events import dynamo_event

WORKERS = 64


PREFIXES = 256  # shared prompt prefixes (system prompts): what makes routing worth it


def dynamo() -> Any | None:
    try:
        import dynamo.llm as llm  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return llm


def _prefixes() -> list[list[int]]:
    """The shared prompt prefixes' token ids: the same for the events and the queries."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 150_000) for _ in range(4 * BLOCK)] for _ in range(PREFIXES)]


def stored_events(blocks: int, seed: int = 0) -> Iterator[tuple[int, BlockStored]]:
    """(worker, event) pairs that cache `blocks` blocks across WORKERS workers: chains of 4
    blocks each, every chain under one of PREFIXES shared 4-block prefixes, with fresh token
    lists (ids above 256, as real ones are). The engine's hashes follow the content, as vLLM's
    and TokenSpeed's do: a shared prefix has the same hashes on every worker."""
    rng = random.Random(seed + 1)
    prefixes = _prefixes()
    made = 0
    hash_counter = 1
    stored_prefix: set[tuple[int, int]] = set()
    while made < blocks:
        worker = rng.randrange(WORKERS)
        prefix = rng.randrange(PREFIXES)
        if (worker, prefix) not in stored_prefix:
            stored_prefix.add((worker, prefix))
            hashes = [prefix * 4 + i for i in range(4)]
            yield worker, BlockStored(hashes, None, list(prefixes[prefix]), BLOCK)
            parent = hashes[-1]
        else:
            parent = prefix * 4 + 3
        tokens = [rng.randrange(1000, 150_000) for _ in range(4 * BLOCK)]
        hashes = [(1 << 62) + hash_counter + i for i in range(4)]
        hash_counter += 4
        yield worker, BlockStored(hashes, parent, tokens, BLOCK)
        made += 8


def queries(count: int, seed: int = 1) -> list[list[int]]:
    """Requests: a shared prefix (often cached) then new tokens, 8 to 32 blocks long."""
    prefixes = _prefixes()
    ask = random.Random(seed)
    return [
        prefixes[ask.randrange(PREFIXES)]
        + [ask.randrange(1000, 150_000) for _ in range(ask.randrange(4, 28) * BLOCK)]
        for _ in range(count)
    ]


class TskvSide:
    name = "tskv PrefixIndex"

    def __init__(self) -> None:
        self.index = PrefixIndex(BLOCK)

    def apply(self, worker: int, event: KVEvent) -> None:
        self.index.apply(worker, (event,))

    def match(self, tokens: list[int]) -> Any:
        return self.index.match(tokens)


class DynamoSide:
    name = "Dynamo RadixTree"

    def __init__(self, llm: Any) -> None:
        self.tree = llm.RadixTree()
        self.hash_tokens = llm.compute_block_hash_for_seq
        self.event_id = 0

    def apply(self, worker: int, event: KVEvent) -> None:
        self.event_id += 1
        local = self.hash_tokens(event.token_ids, BLOCK) if isinstance(event, BlockStored) else ()
        self.tree.apply_event(worker, dynamo_event(self.event_id, event, local))

    def match(self, tokens: list[int]) -> Any:
        return self.tree.find_matches(self.hash_tokens(tokens, BLOCK))


def _timed_matches(side: Any, asks: Iterable[list[int]]) -> tuple[list[float], int]:
    """Each query's wall time (seconds), and how many answers named a worker. Each answer is
    let go of once counted, as a router lets go of it once it has chosen: 2,000 answers kept
    would grow the heap under the later queries and set off the garbage collector in them."""
    latencies, matched = [], 0
    for tokens in asks:
        began = time.perf_counter()
        answer = side.match(tokens)
        latencies.append(time.perf_counter() - began)
        matched += bool(len(answer.scores) if hasattr(answer, "scores") else len(answer))
    return latencies, matched


def _measure_side(make: Callable[[], Any], blocks: int, reps: int = 1) -> dict[str, float]:
    """Events applied once (applying them again would need the index built again), and the
    1,000 queries asked `reps` times, their times pooled for the percentiles."""
    side = make()
    events = list(stored_events(blocks))
    gc.collect()
    started = time.perf_counter()
    for worker, event in events:
        side.apply(worker, event)
    applied = time.perf_counter() - started
    latencies, matched = [], 0
    for _ in range(reps):
        timed, matched = _timed_matches(side, queries(1000))
        latencies.extend(timed)
    return {
        "events_per_s": len(events) / applied,
        "blocks_per_s": 4 * len(events) / applied,
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "matched": matched,
    }


def _index_memory(blocks: int, conn: Connection) -> None:
    events = list(stored_events(blocks))
    tracemalloc.start()
    index = PrefixIndex(BLOCK)
    before = tracemalloc.get_traced_memory()[0]
    for worker, event in events:
        index.apply(worker, (event,))
    gc.collect()
    conn.send((tracemalloc.get_traced_memory()[0] - before) / blocks)


def index_section(out: Callable[[str], None], reps: int) -> None:
    """Each size's events applied once, its queries asked `reps` times (`_measure_side`); the
    memory, long-prompt and filing figures the median of `reps` fresh processes."""
    llm = dynamo()
    out(
        "\n## The prefix index beside Dynamo's RadixTree "
        "(64 workers, as a Python caller sees them)\n"
    )
    if llm is None:
        out("Dynamo is not installed (pip install ai-dynamo-runtime): its columns are skipped.\n")
    out(
        "| cached blocks | tskv events/s | Dynamo events/s | × Dynamo | tskv query p50 / p99 | "
        "Dynamo query p50 / p99 | × Dynamo (p50) |"
    )
    out("|---|---|---|---|---|---|---|")
    for blocks in (1_000, 100_000, 1_000_000):
        ours = _measure_side(TskvSide, blocks, reps)
        theirs = _measure_side(lambda: DynamoSide(llm), blocks, reps) if llm else None
        gc.collect()
        if theirs is None:
            out(
                f"| {blocks:,} | {ours['events_per_s']:,.0f} | n/a | n/a | "
                f"{ours['p50_us']:.1f} / {ours['p99_us']:.1f} µs | n/a | n/a |"
            )
            continue
        out(
            f"| {blocks:,} | {ours['events_per_s']:,.0f} | {theirs['events_per_s']:,.0f} | "
            f"{ours['events_per_s'] / theirs['events_per_s']:.2f} | "
            f"{ours['p50_us']:.1f} / {ours['p99_us']:.1f} µs | "
            f"{theirs['p50_us']:.1f} / {theirs['p99_us']:.1f} µs | "
            f"{ours['p50_us'] / theirs['p50_us']:.2f} |"
        )
    per_block = median_of_runs(reps, in_fresh_process, _index_memory, 100_000)
    out(f"\nIndex memory (tracemalloc, 100,000 blocks, 64 workers): {per_block:,.0f} B per block")
    _long_prompt_section(out, llm, reps)
    _reader_filing_section(out, reps)


FLEET_BLOCKS = 50_000  # each worker's cache in the long-prompt comparison: 3.2M in all
CHAIN = 40  # blocks a cached request stored, one event each


def _first_token(worker: int, chain: int) -> int:
    """The first token id of `worker`'s `chain`-th cached request (ids above 256, no two
    requests alike)."""
    return (worker * FLEET_BLOCKS + chain * CHAIN) * BLOCK + 1_000


def _fleet_events() -> Iterator[tuple[int, BlockStored]]:
    """Every worker's 50,000 blocks as 40-block requests of their own content (token ids made
    by counting: 51M random ones would take longer than the measurement)."""
    for worker in range(WORKERS):
        for chain in range(FLEET_BLOCKS // CHAIN):
            first = _first_token(worker, chain)
            hashes = list(range(first, first + CHAIN))
            yield (
                worker,
                BlockStored(hashes, None, list(range(first, first + CHAIN * BLOCK)), BLOCK),
            )


def _long_prompts(held: int, count: int) -> Iterator[list[int]]:
    """2,000-token prompts whose first `held` blocks some worker holds, the rest new; each made
    as it is asked for, as a router's tokenizer makes a request's just before it is matched
    (4M token ids made ahead would be read from memory, not from the CPU's cache)."""
    ask = random.Random(held)
    for _ in range(count):
        first = _first_token(ask.randrange(WORKERS), ask.randrange(FLEET_BLOCKS // CHAIN))
        fresh = ask.randrange(1 << 28, 1 << 31)  # above every cached token id, and a u32
        yield list(range(first, first + held * BLOCK)) + list(
            range(fresh, fresh + PROMPT - held * BLOCK)
        )


def _long_prompt_side(dynamo_side: bool, conn: Connection) -> None:
    """One side's query latency for 2,000-token prompts at 3.2M cached blocks (fresh process:
    the other side's memory is not in the way); for tskv with the compiled core, also the walk
    alone in each of its forms."""
    side: Any = DynamoSide(dynamo()) if dynamo_side else TskvSide()
    for worker, event in _fleet_events():
        side.apply(worker, event)
    gc.collect()
    answers = []
    for held in (CHAIN, 4):
        latencies, _ = _timed_matches(side, _long_prompts(held, 2_000))
        answers += [percentile(latencies, 0.5) * 1e6, percentile(latencies, 0.99) * 1e6]
    walks = None if dynamo_side or compiled.core is None else _walk_forms(side.index)
    conn.send((answers, walks))


def _walk_forms(index: PrefixIndex) -> list[tuple[str, float, float]]:
    """The plain walk alone (40 blocks held), p50 and p99 µs: in Python over a dict of the
    holders, in C over that dict, in C over the KeyTable the index keeps (keying ahead); and
    the bytes a key of each map."""
    assert compiled.core is not None
    table = index._holdings.holders
    tracemalloc.start()
    as_dict = dict(table.items())
    dict_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    root = root_key(None, None)
    core = compiled.core
    forms: list[tuple[str, Callable[[list[int]], Any]]] = [
        (
            "in Python, over a dict",
            lambda p: _walk((as_dict, None), root, (p, None, None), BLOCK, 0, None),
        ),
        ("in C, over the same dict", lambda p: core.walk(as_dict, None, root, p, BLOCK, None)),
        (
            "in C, over KeyTable, keying 8 blocks ahead",
            lambda p: core.walk(table, None, root, p, BLOCK, None),
        ),
    ]
    found = []
    for name, walk in forms:
        latencies = []
        for prompt in _long_prompts(CHAIN, 2_000):
            began = time.perf_counter()
            walk(prompt)
            latencies.append(time.perf_counter() - began)
        found.append((name, percentile(latencies, 0.5) * 1e6, percentile(latencies, 0.99) * 1e6))
    keys = len(table)
    found.append(("bytes a key: KeyTable, dict", table.__sizeof__() / keys, dict_bytes / keys))
    return found


def _long_prompt_section(out: Callable[[str], None], llm: Any | None, reps: int) -> None:
    out(
        "\nA 2,000-token prompt at 64 × 50,000 cached blocks (3.2M, 40-block requests, each "
        "worker its own content), the index alone (the fleet section has ours under a stream):\n"
    )
    out("| index | 40 blocks held: p50 / p99 | 4 blocks held: p50 / p99 |")
    out("|---|---|---|")
    walks = None
    for dynamo_side in (False, True) if llm is not None else (False,):
        answers, found = median_of_runs(reps, in_fresh_process, _long_prompt_side, dynamo_side)
        p50, p99, short_p50, short_p99 = answers
        walks = walks or found
        name = DynamoSide.name if dynamo_side else TskvSide.name
        out(f"| {name} | {p50:.1f} / {p99:.1f} µs | {short_p50:.1f} / {short_p99:.1f} µs |")
    if walks is None:
        out("\n(the pure-Python modules ran: the compiled core's walks are not measured)")
        return
    *forms, (_, table_bytes, dict_bytes) = walks
    out("\nThe plain walk alone, 40 blocks held, the same index (compiled core):\n")
    out("| walk | p50 / p99 |")
    out("|---|---|")
    for name, p50, p99 in forms:
        out(f"| {name} | {p50:.1f} / {p99:.1f} µs |")
    out(f"\nThe holders map: KeyTable {table_bytes:.1f} B a key, a dict of ints {dict_bytes:.1f} B")


def fleet_section(out: Callable[[str], None], reps: int) -> None:
    """One router over a fleet, in the process that owns the index and in reader processes:
    each row's figures the median of `reps` runs (a run takes up to a minute; `--reps 1` for
    one), its counts of losses and wrong views the worst run's."""
    worst = "; losses, behind: the worst run's" if reps > 1 else ""
    out(f"\n(each fleet row: {runs_said(reps)}{worst})")
    _keeping_current(out, reps)
    _fleet_caches(out, reps)
    _many_routers(out, reps)


def _keeping_current(out: Callable[[str], None], reps: int) -> None:
    out("\n## One router keeping the index current (small rounds: 10 events of 4 blocks)\n")
    out(
        "| workers | followed in | rounds/s each | index process CPU per batch | "
        "with its readers | of the readers': in ZeroMQ's I/O threads, in the kernel (any "
        "thread) | "
        "workers one index core keeps at 200 rounds/s | behind | losses | "
        "publisher rounds late |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    for workers, processes in ((16, 0), (64, 0), (64, 1), (64, 2)):
        run = median_of_runs(reps, watch_scale, workers, processes=processes, rate=50)
        where = "the index's process" if not processes else _readers(processes)
        inside = (
            f"{run['readers_io_us']:.0f} µs, {run['readers_kernel_us']:.0f} µs"
            if processes
            else "n/a"
        )
        out(
            f"| {workers} | {where} | 50 | {run['cpu_us']:.0f} µs | {run['total_cpu_us']:.0f} µs | "
            f"{inside} | {1e6 / run['cpu_us'] / 200:.0f} | {run['behind']} | {run['losses']} | "
            f"{run['late_rounds']} of {run['rounds']} |"
        )


def _fleet_caches(out: Callable[[str], None], reps: int) -> None:
    out("\n## A fleet's caches: bootstrap, queries while applying, memory\n")
    out(
        "64 workers × 50,000 cached blocks (3.2M, each worker its own content), publishing "
        "small rounds throughout (from before the routers subscribe until each has measured its "
        f"CPU per batch for {STEADY:.0f} s once every worker is current), in 1 or 2 reader "
        "processes; a "
        "request every millisecond from a client process on a Unix socket, each answered by "
        "matching a 2,000-token prompt (wall / CPU time of the matching thread: its CPU is the "
        "lesser of its CPU clock and the wall clock read inside that clock's window, each at "
        "least what the match took, and the CPU clock's own p99 is given apart; the index "
        "process's CPU per batch leaves out what making and matching the prompts took, not "
        "the loop's work of waking for and reading the requests: the same figure over the "
        f"{STEADY / 2:.0f} s before the requests began is given apart, and the difference a "
        "request). The publishers' one process stands in for 64 engines: its CPU from the "
        "routers subscribing to every worker current is all 64 snapshots served "
        "and the rounds published meanwhile, on the router's machine here. The last row runs "
        f"the router's processes at niceness {PRIORITY}, above the publishers' stand-in, as a "
        "router on a machine of its own is not switched out for an engine's work (raising a "
        "priority takes root or CAP_SYS_NICE):\n"
    )
    out(
        "| rounds/s each | followed in | open_watcher to every worker current | "
        "its CPU: all processes, "
        "index process | the publishers' process meanwhile | "
        "stale then / indexed | "
        "match, 40 blocks held: p50 / p99 wall, CPU; the CPU clock's own p99 (and the share "
        "of matches the OS switched out) | match, 4 blocks held | "
        "a request's wait for the loop: p50 / p99 | "
        "index process memory a block | readers' | CPU per batch once current, no requests: "
        "index process, and with readers; with requests, the same | the loop's CPU a request | "
        "wrong views / losses at the end |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # one reader and two, on the same fleet: on a machine of few cores the second can cost more
    # (a process more to switch to, fewer messages a pass) than it takes off the first
    for rate, processes, nice in ((50, 1, 0), (50, 2, 0), (5, 1, 0), (50, 1, PRIORITY)):
        followed = _readers(processes) + (f", at niceness {nice}" if nice else "")
        if nice < 0 and not _may_run_at(nice):
            out(f"| {rate} | {followed} | n/a: this user may not raise a priority |" + " |" * 11)
            continue
        run = median_of_runs(
            reps,
            watch_scale,
            64,
            processes=processes,
            rate=rate,
            seconds=5,
            cached=50_000,
            nice=nice,
        )
        matches = []
        for blocks in (40, 4):
            switched, clock = run[f"match_{blocks}_clock"]
            matches.append(
                "{:.0f} / {:.0f} µs, {:.0f} / {:.0f} µs".format(*run[f"match_{blocks}"])
                + f"; the CPU clock alone {clock:.0f} µs ({switched:.1%} switched out)"
            )
        waited = "{:.0f} / {:.0f} µs".format(*run["query_wait"])
        out(
            f"| {rate} | {followed} | {run['bootstrap_s']:.1f} s | "
            f"{run['bootstrap_cpu_s']:.1f} s, "
            f"{run['bootstrap_index_cpu_s']:.1f} s | {run['publisher_bootstrap_cpu_s']:.1f} s | "
            f"{run['stale_after_bootstrap']} / "
            f"{run['indexed_after_bootstrap']:.0%} | {matches[0]} | {matches[1]} | {waited} | "
            f"{run['index_bytes']:.0f} B | {run['reader_bytes']:.0f} B | "
            f"{run['alone_cpu_us']:.0f} µs, {run['alone_total_cpu_us']:.0f} µs; "
            f"{run['cpu_us']:.0f} µs, "
            f"{run['total_cpu_us']:.0f} µs | {run['request_us']:.0f} µs | "
            f"{run['wrong_views']} / {run['losses']} |"
        )


PRIORITY = -10  # the router's processes' niceness in the last row of the fleet's caches


def _may_run_at(nice: int) -> bool:
    """Whether a child of this process may take niceness `nice` (below 0 takes privilege)."""
    probe = f"import os; os.nice({nice})"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def _readers(processes: int) -> str:
    return f"{processes} reader process" + ("es" if processes > 1 else "")


def _many_routers(out: Callable[[str], None], reps: int) -> None:
    out("\n## Many routers on one fleet (64 workers, 10 rounds/s each, 1 reader process each)\n")
    out(
        "The routers run at niceness 10, so that on a machine with fewer cores than processes "
        "they do not take the publishers' process off its core (a fleet's routers run on other "
        "machines); ZeroMQ's I/O thread is where a PUB writes to each subscriber.\n"
    )
    out(
        "Bare subscribers only receive (a SUB socket per worker, nothing decoded): what each "
        "subscriber costs the publishers themselves, without the busier machine a router makes.\n"
    )
    out(
        "| transport | subscribers | publisher CPU per batch | of it ZeroMQ's I/O thread | "
        "× one | behind | losses |"
    )
    out("|---|---|---|---|---|---|---|")
    for ipc in (False, True):
        transport = "ipc" if ipc else "tcp loopback"
        one = None
        for routers in (1, 3):
            run = median_of_runs(
                reps, watch_scale, 64, routers=routers, processes=1, rate=10, ipc=ipc, nice=10
            )
            one = one or run["publisher_cpu_us"]
            out(
                f"| {transport} | {routers} router{'s' * (routers > 1)} | "
                f"{run['publisher_cpu_us']:.0f} µs | {run['publisher_io_us']:.0f} µs | "
                f"{run['publisher_cpu_us'] / one:.2f} | {run['behind']} | {run['losses']} |"
            )
        one = None
        for subscribers in (1, 3):
            bare = median_of_runs(reps, subscriber_cost, subscribers, ipc)
            one = one or bare["publisher_cpu_us"]
            out(
                f"| {transport} | {subscribers} bare | {bare['publisher_cpu_us']:.0f} µs | "
                f"{bare['publisher_io_us']:.0f} µs | {bare['publisher_cpu_us'] / one:.2f} | "
                f"n/a | {bare['missed']} |"
            )


def _cool(buffer: bytearray) -> None:
    """Write a buffer eight times a core's L2 cache here: what a busy machine's other processes do
    to a router's caches between two of its batches (a fleet's router wakes for each)."""
    buffer[::64] = bytes(len(buffer[::64]))


def _timed_rounds(rounds: list[Callable[[], object]]) -> tuple[float, float]:
    """CPU µs a call, in order, each timed alone: the even calls right after the one before,
    the odd ones with the caches cooled first."""
    buffer, spent = bytearray(8 << 20), [0.0, 0.0]
    for number, call in enumerate(rounds):
        if number % 2:
            _cool(buffer)
        began = time.process_time()
        call()
        spent[number % 2] += time.process_time() - began
    return spent[0] / (len(rounds) / 2) * 1e6, spent[1] / (len(rounds) / 2) * 1e6


def _reader_filing(pure: bool, conn: Connection) -> None:
    """A reader's index filing small rounds for its share of the fleet (32 workers, each with
    50,000 blocks cached and its own content) as its outbox takes them (`apply`, then
    `take_changes`), the workers by turns: CPU µs a round, with the CPU's caches warm and
    cold. Each round is new events, decoded from its payload beforehand: decoding is the
    codec's figure, not filing's."""
    if pure:
        compiled.core = None  # this child runs the reference, as TSKV_PURE_PYTHON=1 would
    index = JournalIndex(BLOCK)
    workers = WORKERS // 2  # a reader's, of the fleet's two
    makers = [churn_maker("small", FLEET_BLOCKS, worker) for worker in range(workers)]
    for _ in range(-(-FLEET_BLOCKS // blocks_per_round("small"))):  # every cache full
        for worker, make in enumerate(makers):
            index.apply(worker, make())
            index.take_changes(worker)

    def filing(worker: int) -> Callable[[], object]:
        batch = decode_batch(encode_batch(KVEventBatch(0.0, makers[worker]())))
        return lambda: (index.apply(worker, batch), index.take_changes(worker))

    conn.send(_timed_rounds([filing(number % workers) for number in range(6_000)]))


def _index_mirroring(pure: bool, conn: Connection) -> None:
    """The index's process taking reports off its reader's pipe (40 holds taken, 40 let go of,
    as a small round's filing makes them), parsed and mirrored as the watcher does (the holds,
    the worker's trust and figures), with 64 workers × 50,000 blocks held: CPU µs a report,
    warm and cold. The reader framed each beforehand."""
    if pure:
        compiled.core = None
    index, rng = PrefixIndex(BLOCK), random.Random(7)
    per_round = blocks_per_round("small")
    held = [[rng.getrandbits(62) for _ in range(FLEET_BLOCKS)] for _ in range(WORKERS)]
    for worker, keys in enumerate(held):
        index.apply_changes(worker, [keys])
    endpoint = "tcp://127.0.0.1:1"  # never connected: the mirror only keeps its figures
    roster: Roster = {w: Watched(endpoint, None, SubscriberConfig(), w) for w in range(WORKERS)}
    mirror = ReaderMirror(index, roster, None)

    def report(worker: int) -> Callable[[], object]:
        taken = [rng.getrandbits(62) for _ in range(per_round)]
        let_go = held[worker][:per_round]
        held[worker] = held[worker][per_round:] + taken
        figures = WorkerFigures(batches=1, last_seq=0, stale=False)  # a current worker's
        sent = frame(News(0.0, [Report(worker, figures, [taken, let_go])]))

        def take() -> None:
            for message in news(FrameReader().feed(sent)):
                for item in message.items:
                    assert isinstance(item, Report)
                    mirror.report(item.slot, item)

        return take

    reports = [report(n % WORKERS) for n in range(6_000)]
    conn.send(_timed_rounds(reports))


def _reader_filing_section(out: Callable[[str], None], reps: int) -> None:
    for name, measure in (
        (
            "A reader's index filing a small round (10 events of 4 blocks, as many removed; 32 "
            "workers with 50,000 cached each; decoding apart)",
            _reader_filing,
        ),
        (
            "The index's process taking a reader's report of a small round off the pipe, parsed "
            "and mirrored as the watcher does (40 holds taken, 40 let go of, the worker's trust "
            "and figures; 3.2M blocks held)",
            _index_mirroring,
        ),
    ):
        compiled_us = (
            None
            if compiled.core is None
            else median_of_runs(reps, in_fresh_process, measure, False)
        )
        pure_us = median_of_runs(reps, in_fresh_process, measure, True)
        both = "" if compiled_us is None else "{:.0f} / {:.0f} µs compiled, ".format(*compiled_us)
        pure = "{:.0f} / {:.0f} µs pure".format(*pure_us)
        out(f"\n{name}: {both}{pure}, CPU, caches warm / cold")
