"""Garbage-collector settings of the broker process, which allocates on every group.

With CPython's default thresholds (a young collection every 700 container allocations,
full ones as the live set grows) the collector walks the buffered groups again and again,
and at intake rates that was a third of the broker's time. Groups are trees and their
records are untracked (gc=False in drmas.protocol.messages); what is left are lists,
collected young with a higher first threshold. Objects alive after start-up (modules,
config) are frozen out of collections for good.

benchmarks/perf/bench_broker_intake.py measures the effect (results/broker_intake.json).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 10)  # young, middle, old (CPython defaults: 700, 10, 10)


def tune_gc() -> None:
    """Apply the settings to this process (call once, after start-up)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
