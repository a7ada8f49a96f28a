"""How far apart the two CPUs a decode runs on are: the round trip of one cache line between two threads pinned to
them, in nanoseconds (the benchmark records it before and after every bandwidth sample and decode repeat).

On a virtual machine the host decides where the guest's CPUs run, and moves them, within seconds under load. On
the 2-CPU Zen 4 guest of docs/performance.md the round trip is bimodal, and it tells the memory phase: ~55-110 ns
while two threads' plain read of a 1 GiB buffer streams ~30-35 GB/s, ~315-330 ns while it streams ~53-58 GB/s
(as if the two CPUs shared one core complex's path to memory, or ran apart with one each). Those are the "slow"
and "fast memory phases" the benchmark's numbers drift between, so each number carries the round trip taken
around it. The threads spin in C (compiled here with the C compiler Inductor already needs): a Python loop would
add more than the difference it measures.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

_SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

struct partner { int cpu, trips; atomic_int* flag; };

static int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void* answer(void* arg) {  /* waits for each odd value, answers with the next even one */
  struct partner* p = arg;
  pin(p->cpu);
  for (int i = 0; i < p->trips; ++i) {
    while (atomic_load_explicit(p->flag, memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(p->flag, 2 * i + 2, memory_order_release);
  }
  return 0;
}

/* Nanoseconds per round trip between this thread on cpu_a and a new one on cpu_b, over `trips` after `warmup`;
   negative if a thread could not be pinned or started. The calling thread's CPU affinity is restored. */
double round_trip_ns(int cpu_a, int cpu_b, int warmup, int trips) {
  static _Alignas(64) atomic_int flag;
  cpu_set_t saved;
  if (pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) || pin(cpu_a)) return -1;
  atomic_store(&flag, 0);
  struct partner p = {cpu_b, warmup + trips, &flag};
  pthread_t thread;
  if (pthread_create(&thread, 0, answer, &p)) {
    pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
    return -1;
  }
  struct timespec start, end;
  for (int i = 0; i < warmup + trips; ++i) {
    if (i == warmup) clock_gettime(CLOCK_MONOTONIC, &start);
    atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {}
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  pthread_join(thread, 0);
  pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  return ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / trips;
}
"""


def c_compiler() -> str | None:
    """The C compiler the benchmarks build their small helpers with: $CC, else cc, else gcc; None without one."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


class CoreRoundTrip:
    """`measure()`: ns per round trip between the first two CPUs this process may run on, or None where there is
    no second CPU or no C compiler (the benchmark then records none)."""

    def __init__(self):
        self._cpus = sorted(os.sched_getaffinity(0))[:2]
        self._library = self._compile() if len(self._cpus) == 2 else None

    @staticmethod
    def _compile():
        compiler = c_compiler()
        if compiler is None:
            logging.warning("no C compiler: the cores' round trip is not measured")
            return None
        with tempfile.TemporaryDirectory(prefix="bench-round-trip-") as directory:
            source, library = Path(directory) / "round_trip.c", Path(directory) / "round_trip.so"
            source.write_text(_SOURCE)
            subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o", str(library)],
                           check=True, capture_output=True)
            loaded = ctypes.CDLL(str(library))  # mapped: the file may go with the directory
        loaded.round_trip_ns.restype = ctypes.c_double
        loaded.round_trip_ns.argtypes = [ctypes.c_int] * 4
        return loaded

    def measure(self, trips: int = 20000, batches: int = 5) -> float | None:
        """The median of `batches` means over trips / batches each: one batch slowed by the host (a CPU taken away
        for a moment) leaves it where the placement puts it. ~6 ms at 300 ns a trip: cheap enough to take around
        every timed repeat."""
        if self._library is None:
            return None
        each = max(1, trips // batches)
        means = [self._library.round_trip_ns(self._cpus[0], self._cpus[1], each // 10, each) for _ in range(batches)]
        return statistics.median(means) if min(means) > 0 else None


# Two placements differ this much in their round trips at least: ~2.7x (110 -> 300 ns), while
# neighbouring round trips of one placement, sorted, sit within a few %.
PLACEMENT_GAP = 2.0
# Labels of a repeat's placement, in table order: all its round trips below the run's split, all above, some of
# each, or a run without two placements (or without round trips: one CPU).
PLACEMENTS = ("near", "apart", "mixed", "one placement")


def placement_split(round_trips) -> float | None:
    """The round trip (ns) between the two placements a run saw: the geometric middle of the first gap of
    PLACEMENT_GAP or more, from the shortest; None when there is none (one placement, or no round trips)."""
    values = sorted(ns for ns in round_trips if ns is not None)
    for shorter, longer in zip(values, values[1:]):
        if longer >= PLACEMENT_GAP * shorter:
            return (shorter * longer) ** 0.5
    return None


def placement(round_trips: list, split: float | None) -> str:
    if split is None or None in round_trips:
        return "one placement"
    sides = {ns >= split for ns in round_trips}
    return "mixed" if len(sides) > 1 else ("apart" if sides.pop() else "near")
