"""The serve command's options: its flags, and what the engine loads for them (an export whose shapes the flags
must match, or a checkpoint to export with continuous batching)."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8080  # optimum-neuron's
DEFAULT_BATCH_SIZE = 4


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True,
                        help="an export (directory or Hub repo) made with --continuous_batching, or a Transformers "
                             "checkpoint to export first (through the compile cache)")
    parser.add_argument("--served_model_name", default=None,
                        help="the model name clients pass (default: --model)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help=f"requests decoded together: the export's slots (default: the export's, or "
                             f"{DEFAULT_BATCH_SIZE} for a checkpoint)")
    parser.add_argument("--sequence_length", type=int, default=None,
                        help="prompt + generated tokens per request (default: the export's, or the model's)")
    parser.add_argument("--tensor_parallel_size", type=int, default=None,
                        help="devices each replica's graphs are cut across (default: the export's, or 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument("--max_waiting", type=int, default=None,
                        help="requests that may wait for a free slot; past slots + this a request gets 429 "
                             "(default: 4 x batch_size)")
    parser.add_argument("--prefill_budget", type=int, default=None,
                        help="while requests decode, the most prompt tokens encoded between two of their steps, "
                             "each chunk counted as the size of the graph that takes it (default: the smallest "
                             "context bucket; with none decoding, prompts go in the largest chunks)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="serve N replicas behind one endpoint on Ray Serve (the [ray] extra); 0: one engine, "
                             "no Ray")
    parser.add_argument("--graceful_shutdown_s", type=float, default=300.0,
                        help="on SIGTERM, how long requests in flight may take to finish (default: 300)")


def check_export_flags(neuron_config, batch_size: Optional[int], sequence_length: Optional[int],
                       tensor_parallel_size: Optional[int]) -> None:
    """Refuse flags an export was not compiled for, naming the flags that match it."""
    nc = neuron_config
    given = {"--batch_size": (batch_size, nc.batch_size), "--sequence_length": (sequence_length, nc.sequence_length),
             "--tensor_parallel_size": (tensor_parallel_size, nc.tp_degree)}
    wrong = [f"{flag} {value} (compiled: {compiled})" for flag, (value, compiled) in given.items()
             if value is not None and value != compiled]
    if wrong:
        matching = " ".join(f"{flag} {compiled}" for flag, (_, compiled) in given.items())
        raise ValueError(f"the export was not compiled for {', '.join(wrong)}: pass {matching} (or leave them out), "
                         f"or serve the original checkpoint to export it with other shapes.")
    if not nc.continuous_batching:
        raise ValueError("the export has no one-row prefill graphs, which serving needs: re-export it with "
                         "--continuous_batching (optimum-cli export neuron ... --continuous_batching), or serve the "
                         "original checkpoint.")


def engine_options(args) -> tuple[str, dict]:
    """(what the engine loads, its from_pretrained keywords): an export as it is (flags checked), or a checkpoint
    exported with continuous batching at the flags' shapes."""
    from ..configuration import NeuronConfig

    try:
        neuron_config = NeuronConfig.from_pretrained(args.model)
    except ValueError:
        neuron_config = None
    except Exception as err:  # a Hub id that cannot be reached: a checkpoint, or nothing; from_pretrained says
        logger.debug("no neuron_config.json for %s (%s): exporting it", args.model, err)
        neuron_config = None
    if neuron_config is not None:
        check_export_flags(neuron_config, args.batch_size, args.sequence_length, args.tensor_parallel_size)
        return args.model, {}
    options = {"export": True, "continuous_batching": True, "batch_size": args.batch_size or DEFAULT_BATCH_SIZE}
    if args.sequence_length is not None:
        options["sequence_length"] = args.sequence_length
    if args.tensor_parallel_size is not None:
        options["num_cores"] = args.tensor_parallel_size
    return args.model, options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optimum_neuronx.serve",
                                     description="An OpenAI-compatible server with continuous batching.")
    add_serve_arguments(parser)
    return parser


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)
