"""Compile graphs side by side, one forked worker process per graph, up to one per core.

Compiling one graph runs on one core: tracing and lowering are single-threaded Python, then a C++ compiler builds
the graph, whatever the model's size. Workers are forked, so they share the decoder and its weights with this
process: nothing is copied or pickled but each graph's list of output files.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Sequence, TypeVar

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

COMPILE_WORKERS_ENV = "OPTIMUM_NEURONX_COMPILE_WORKERS"

Item = TypeVar("Item")
Result = TypeVar("Result")

# In a worker: the function and items it was forked with (the parent passes them as the initializer's arguments,
# which fork hands over without pickling), so that only an index crosses the process boundary per call.
_JOB: tuple[Callable, Sequence] | None = None


def compile_workers(jobs: int) -> int:
    """How many processes compile `jobs` graphs: one per core this process may use (or $OPTIMUM_NEURONX_COMPILE_WORKERS),
    no more than there are graphs, and 1 where forking is unsafe."""
    raw = os.environ.get(COMPILE_WORKERS_ENV, "").strip()
    if raw:
        try:
            wanted = int(raw)
        except ValueError:
            wanted = 0
        if wanted < 1:
            raise ValueError(f"{COMPILE_WORKERS_ENV}={raw!r} must be a whole number >= 1 (the processes that compile "
                             f"graphs side by side); set it to 1 to compile them one after the other, or unset it "
                             f"for one per core.")
    else:
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # fork is the only start method that shares the decoder without pickling it, and it is only safe on Linux,
    # before CUDA or a PJRT client (jaxlib's threads) is started, and outside daemonic processes (no children).
    if (sys.platform != "linux" or torch.cuda.is_initialized() or pjrt_started()
            or multiprocessing.current_process().daemon):
        return 1
    return max(1, min(jobs, wanted))


def pjrt_started() -> bool:
    """Whether this process has started a PJRT client (jaxlib), whose threads do not survive fork."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def map_in_workers(function: Callable[[Item], Result], items: Sequence[Item], workers: int,
                   setup: Callable[[], None], describe: Callable[[Item], str], desc: str, unit: str) -> list[Result]:
    """[function(item) for item in items], computed by `workers` forked processes (here when `workers` is 1), with
    a progress bar. Each worker first runs `setup`. A worker's exception is raised here, with its traceback."""
    if workers <= 1:
        return [function(item) for item in tqdm(items, desc=desc, unit=unit)]
    results: dict[int, Result] = {}
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(setup, function, items, os.getpid())) as pool, \
            tqdm(total=len(items), desc=desc, unit=unit) as progress:
        futures = {pool.submit(_run_job, index): index for index in range(len(items))}
        try:
            for future in as_completed(futures):
                results[futures[future]] = _result(future.result(), describe(items[futures[future]]))
                progress.update()
        except BrokenProcessPool:
            pending = [describe(items[i]) for i in range(len(items)) if i not in results]
            raise RuntimeError(
                f"A worker process compiling {', '.join(pending)} died without an error (killed, e.g. out of "
                f"memory?). Compile with fewer processes: {COMPILE_WORKERS_ENV}=1 compiles one graph at a time."
            ) from None
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return [results[index] for index in range(len(items))]


def _start_worker(setup: Callable[[], None], function: Callable, items: Sequence, parent: int) -> None:
    global _JOB
    _die_with_parent(parent)
    _JOB = (function, items)
    setup()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when the exporting process dies (SIGKILL included), so that no worker is
    left compiling, holding its copy of the model, for nobody."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: fork is not used there (compile_workers)
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _run_job(index: int):
    function, items = _JOB
    try:
        return True, function(items[index])
    except BaseException as err:
        try:  # an exception that cannot be pickled could not reach the parent: send its type and message instead
            pickle.loads(pickle.dumps(err))
        except Exception:
            err = RuntimeError(f"{type(err).__name__}: {err}")
        return False, (err, traceback.format_exc())


def _result(outcome: tuple, what: str):
    ok, value = outcome
    if ok:
        return value
    err, child_traceback = value
    note = f"Raised while compiling {what} in a worker process:\n{child_traceback}"
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:
        logger.error(note)
    raise err
