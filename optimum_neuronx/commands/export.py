"""`optimum-cli export neuron` / `python -m optimum_neuronx.commands`: compile a model into a directory."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..version import __version__


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, help="Hub model id or local Transformers checkpoint directory")
    parser.add_argument("output", type=Path, help="directory to write the exported model to")
    add_neuron_config_arguments(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument("--revision", default=None, help="Hub revision of --model")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
                        help="run code from outside: the model repo's own modeling code (Transformers' meaning) and "
                             "the compiled graphs of the Hub compile cache (--cache_repo)")
    parser.add_argument("--cache_dir", type=Path, default=None,
                        help="compile cache (default: $OPTIMUM_NEURONX_CACHE or <HF_HOME>/optimum-neuronx/compile-cache)")
    parser.add_argument("--cache_repo", default=None,
                        help="Hub model repo used as a shared compile cache (default: $OPTIMUM_NEURONX_CACHE_REPO)")
    parser.add_argument("--no_cache", action="store_true", help="compile even if the compile cache has the export")


def add_neuron_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch_size", type=int, default=1, help="compiled batch size (default: 1)")
    parser.add_argument("--sequence_length", type=int, default=1024,
                        help="KV-cache length: prompt + generated tokens (default: 1024)")
    parser.add_argument("--num_cores", type=int, default=1, help="tensor-parallel degree (Neuron; default: 1)")
    parser.add_argument("--auto_cast_type", default="fp32", help="fp32, bf16 or fp16 (default: fp32)")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "neuron"),
                        help="inductor: AOTInductor graphs for this CPU; neuron: StableHLO graphs run through PJRT, on a "
                             "Neuron device where the plugin is installed, else on the XLA CPU device "
                             "(default: inductor)")
    parser.add_argument("--instance_type", default=None,
                        help="Neuron instance the neuron backend plans memory and compiles NEFFs for, e.g. inf2.48xlarge, "
                             "trn1, trn2 (default: inf2)")
    parser.add_argument("--context_buckets", type=_int_list, default=None, metavar="N[,N...]",
                        help="prompt lengths to compile prefill graphs for, e.g. 128,512 (default: powers of two "
                             "from 128 up to sequence_length)")
    parser.add_argument("--token_buckets", type=_int_list, default=None, metavar="N[,N...]",
                        help="cache windows to compile decode graphs for; the largest must be sequence_length "
                             "(default: powers of two from 128 up to sequence_length)")
    parser.add_argument("--compiler_args", action="append", default=[], metavar="ARG",
                        help="backend option, repeatable; inductor: NAME=VALUE, a torch._inductor.config option; "
                             "neuron: a neuronx-cc flag, e.g. --compiler_args=-O3")


def neuron_config_from_args(args: argparse.Namespace):
    from ..configuration import NeuronConfig

    return NeuronConfig(
        batch_size=args.batch_size, sequence_length=args.sequence_length, tp_degree=args.num_cores,
        auto_cast_type=args.auto_cast_type, backend=args.backend, context_buckets=args.context_buckets,
        token_buckets=args.token_buckets, compiler_args=tuple(args.compiler_args),
        instance_type=getattr(args, "instance_type", None))


def show_progress() -> None:
    """Print the package's INFO messages (memory estimate, buckets, compile times), whoever started the CLI."""
    logger = logging.getLogger("optimum_neuronx")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 128,512; got {text!r}") from None


def run_export(args: argparse.Namespace) -> int:
    from ..artifacts import ArtifactError
    from ..cache import CompileCache
    from ..exporters.export import export

    show_progress()
    try:
        if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:
            raise FileExistsError(f"output directory {args.output} exists and is not empty; pass --overwrite "
                                  f"to replace its content, or choose another directory")
        neuron_config = neuron_config_from_args(args)
        hf_kwargs = {"revision": args.revision} if args.revision else {}
        if args.trust_remote_code:
            hf_kwargs["trust_remote_code"] = True
        cache = None if args.no_cache else CompileCache(args.cache_dir, args.cache_repo)
        meta = export(args.model, args.output, neuron_config, hf_kwargs=hf_kwargs, cache=cache)
    except (ValueError, ArtifactError, FileExistsError, OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, seconds in meta["compile_time_s"].items():
        print(f"compiled {name} in {seconds:.1f} s")
    print(f"Exported {args.model} ({neuron_config.auto_cast_type}, batch_size={neuron_config.batch_size}, "
          f"sequence_length={neuron_config.sequence_length}) to {args.output}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="optimum-cli export neuron",
                                     description=f"Export a causal LM to compiled graphs (optimum-neuronx {__version__})")
    add_export_arguments(parser)
    return run_export(parser.parse_args(argv))
