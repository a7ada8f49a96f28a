"""Graphs compiled side by side in forked workers: order, errors, a dead worker, OpenMP after fork, worker count."""

import os
import subprocess
import sys

import pytest
import torch

from optimum_neuronx.backends.workers import COMPILE_WORKERS_ENV, compile_workers, map_in_workers

needs_fork = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def _map(function, items, count=2, setup=lambda: None):
    return map_in_workers(function, items, count, setup, describe=lambda item: f"item {item}", desc="test", unit="item")


def _square_and_pid(n):
    return n * n, os.getpid()


@needs_fork
def test_results_come_back_in_order_from_other_processes():
    results = _map(_square_and_pid, [3, 1, 4, 1, 5])
    assert [square for square, _ in results] == [9, 1, 16, 1, 25]
    assert os.getpid() not in {pid for _, pid in results}


def test_one_worker_computes_here():
    assert _map(_square_and_pid, [2, 3], count=1) == [(4, os.getpid()), (9, os.getpid())]


def _fail_on_three(n):
    if n == 3:
        raise ValueError(f"bad item {n}")
    return n


class _Unpicklable(Exception):
    def __init__(self, message, handle):
        super().__init__(message)
        self.handle = handle  # a lambda: pickling fails


def _raise_unpicklable(n):
    raise _Unpicklable(f"broken on {n}", lambda: None)


@needs_fork
def test_a_worker_exception_is_raised_here_with_its_traceback():
    with pytest.raises(ValueError, match="bad item 3") as info:
        _map(_fail_on_three, [1, 2, 3, 4])
    notes = "".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "while compiling item 3 in a worker process" in notes and "_fail_on_three" in notes


@needs_fork
def test_an_exception_that_cannot_be_pickled_still_says_what_happened():
    with pytest.raises(RuntimeError, match="_Unpicklable: broken on 7"):
        _map(_raise_unpicklable, [7])


def _die(n):
    os._exit(1)  # what an out-of-memory kill looks like from the parent


@needs_fork
def test_a_dead_worker_is_an_error_naming_the_fix():
    with pytest.raises(RuntimeError, match=rf"item 5.*died.*{COMPILE_WORKERS_ENV}=1"):
        _map(_die, [5])


def test_worker_count(monkeypatch):
    from optimum_neuronx.backends import workers

    monkeypatch.delenv(COMPILE_WORKERS_ENV, raising=False)
    monkeypatch.setattr(workers, "pjrt_started", lambda: False)  # tests before may have started one in this process
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    expected = min(3, cores) if sys.platform == "linux" else 1
    assert compile_workers(3) == expected
    assert compile_workers(1) == 1
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "1")
    assert compile_workers(3) == 1
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "64")
    assert compile_workers(3) == (3 if sys.platform == "linux" else 1)  # never more workers than graphs
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # CUDA does not survive fork
    assert compile_workers(3) == 1
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr("optimum_neuronx.backends.workers.pjrt_started", lambda: True)  # nor do jaxlib's threads
    assert compile_workers(3) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(COMPILE_WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=rf"{COMPILE_WORKERS_ENV}='{bad}' must be a whole number >= 1.*set it to 1"):
            compile_workers(3)


OPENMP_AFTER_FORK = """
import torch
from optimum_neuronx.backends.inductor.backend import _forked_worker_setup
from optimum_neuronx.backends.workers import map_in_workers
torch.set_num_threads(2)
a = torch.randn(1500, 1500)
(a @ a).sum()  # the parent's OpenMP pool now has threads that a forked child lacks

def work(n):
    from torch._inductor.utils import parallel_num_threads
    b = torch.randn(800, 800)
    return float((b @ b).abs().sum() > 0) + n, parallel_num_threads(), torch.get_num_threads()

print(map_in_workers(work, [0, 1], 2, lambda: _forked_worker_setup(2), str, "test", "item"))
"""


@needs_fork
def test_workers_run_tensor_ops_after_the_parent_used_openmp_and_generate_code_for_its_threads():
    # Without the setup the first matmul in a worker waits forever for OpenMP threads fork did not copy.
    result = subprocess.run([sys.executable, "-c", OPENMP_AFTER_FORK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[(1.0, 2, 2), (2.0, 2, 2)]"

