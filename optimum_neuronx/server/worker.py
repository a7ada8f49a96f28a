"""The engine in a process of its own: the graph calls hold the GIL for a whole step, so the HTTP side lives in
another process and never waits on one.

The parent (`EngineProcess`) sends ("add", Request) / ("cancel", id) / ("stop",) over one queue; the child loads the
model, runs the scheduler and sends back ("ready", info), ("outputs", [Output], stats) after every step,
("rejected", id, kind, message, field) for a request it refuses, or ("failed", message). The child exits when its parent
goes away, even killed (it watches the parent's pid), so no engine outlives its server.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# How often an idle engine checks for work and for its parent (seconds).
IDLE_POLL_S = 0.05


def _engine_main(model: str, options: dict, max_waiting: Optional[int], prefill_budget: Optional[int], requests,
                 results, parent_pid: int) -> None:
    """The child: load (or export) the model, then serve requests until told to stop or orphaned."""
    try:
        from transformers import AutoTokenizer

        from ..runtime import NeuronModelForCausalLM
        from ..scheduler import QueueFull, Scheduler

        neuron_model = NeuronModelForCausalLM.from_pretrained(model, **options)
        directory = str(neuron_model.artifact_dir)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        nc = neuron_model.neuron_config
        max_waiting = 4 * nc.batch_size if max_waiting is None else max_waiting
        scheduler = Scheduler(neuron_model._engine, tokenizer, max_waiting=max_waiting, prefill_budget=prefill_budget)
        eos = neuron_model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
    except Exception as err:  # the parent reports it and exits
        results.put(("failed", f"{type(err).__name__}: {err}"))
        return
    results.put(("ready", {"slots": nc.batch_size, "max_waiting": max_waiting, "directory": directory,
                           "sequence_length": nc.sequence_length, "vocab_size": scheduler.engine.vocab_size,
                           "eos_token_ids": tuple(eos), "neuron_config": nc.to_dict()}))
    while os.getppid() == parent_pid:
        try:
            message = requests.get(timeout=IDLE_POLL_S) if not len(scheduler) else requests.get_nowait()
        except queue.Empty:
            message = None
        while message is not None:
            kind = message[0]
            if kind == "stop":
                return
            if kind == "cancel":
                scheduler.cancel(message[1])
            elif kind == "add":
                request = message[1]
                try:
                    scheduler.add(request)
                except QueueFull as err:
                    results.put(("rejected", request.request_id, "busy", str(err), None))
                except Exception as err:  # (InvalidRequest: what check_request refuses) never stops the engine
                    results.put(("rejected", request.request_id, "invalid", str(err), getattr(err, "field", None)))
            try:
                message = requests.get_nowait()
            except queue.Empty:
                message = None
        if len(scheduler):
            try:
                outputs = scheduler.step()
            except Exception as err:  # a failed graph call: every request in flight fails, the engine stops
                logger.exception("engine step failed")
                results.put(("failed", f"{type(err).__name__}: {err}"))
                return
            results.put(("outputs", outputs, (len(scheduler.running), len(scheduler.waiting))))


class EngineProcess:
    """The parent's handle on the engine process: start it, send it requests, and get each step's outputs through
    `on_message` (called from a reader thread)."""

    def __init__(self, model: str, options: dict, on_message: Callable[[tuple], None],
                 max_waiting: Optional[int] = None, prefill_budget: Optional[int] = None):
        context = multiprocessing.get_context("spawn")
        self._requests, self._results = context.Queue(), context.Queue()
        self._process = context.Process(target=_engine_main, name="optimum-neuronx-engine", daemon=True,
                                        args=(model, options, max_waiting, prefill_budget, self._requests,
                                              self._results, os.getpid()))
        self._on_message = on_message
        self._reader: Optional[threading.Thread] = None
        self.info: dict = {}

    def start(self, timeout: float = 1800.0) -> dict:
        """Start the engine and wait until its model is loaded: what it reports (slots, max_waiting, directory,
        sequence_length, vocab_size, eos_token_ids, neuron_config)."""
        self._process.start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._results.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the engine process exited with code {self._process.exitcode} while loading "
                                       f"the model") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the engine did not load the model within {timeout:.0f} s") from None
        if message[0] != "ready":
            self.stop()
            raise RuntimeError(f"the engine could not load the model: {message[1]}")
        self.info = message[1]
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()
        return self.info

    def _read(self) -> None:
        while True:
            try:
                message = self._results.get(timeout=0.5)
            except queue.Empty:
                if not self._process.is_alive():
                    self._on_message(("failed", f"the engine process exited (code {self._process.exitcode})"))
                    return
                continue
            except (EOFError, OSError):
                return
            self._on_message(message)
            if message[0] == "failed":
                return

    def add(self, request) -> None:
        self._requests.put(("add", request))

    def cancel(self, request_id: str) -> None:
        self._requests.put(("cancel", request_id))

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine (it finishes the step under way), killing it if it does not exit in `timeout`."""
        if self._process.is_alive():
            self._requests.put(("stop",))
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
