"""The simulated scheduler and what goes with it: a KV event source without a GPU.

These are tools built on the library (the demo, `tskv simulate`, tskv.testing, the test
oracle), not part of it: the library never imports them.
"""

from tskv.sim.block_hash import block_hash, chain_hashes
from tskv.sim.cache_view import CacheView
from tskv.sim.hybrid_cache import MODELS, HybridCache, make_cache
from tskv.sim.prefix_cache import PrefixCache
from tskv.sim.sampling import (
    GenerateRequest,
    SamplingParams,
    SamplingSeedError,
    fan_out,
    resolve_sampling_seed,
)
from tskv.sim.schedulers import SchedulerLoop, SimOptions, check_options
from tskv.sim.simulator import Simulator, Workload, decode_rng, run_round

__all__ = [
    "MODELS",
    "CacheView",
    "GenerateRequest",
    "HybridCache",
    "PrefixCache",
    "SamplingParams",
    "SamplingSeedError",
    "SchedulerLoop",
    "SimOptions",
    "Simulator",
    "Workload",
    "block_hash",
    "chain_hashes",
    "check_options",
    "decode_rng",
    "fan_out",
    "make_cache",
    "resolve_sampling_seed",
    "run_round",
]
