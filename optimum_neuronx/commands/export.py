"""`optimum-cli export neuron` / `python -m optimum_neuronx.commands`: compile a model into a directory."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..version import __version__


def no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Options only by their full names: a prefix (--auto_cast) must never silently become another (--auto_cast_type)."""
    parser.allow_abbrev = False


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    no_abbreviations(parser)
    parser.add_argument("--model", "-m", required=True, help="Hub model id or local Transformers checkpoint directory")
    parser.add_argument("output", type=Path, help="directory to write the exported model to")
    parser.add_argument("--task", default="text-generation",
                        help="the task to export for: text-generation (causal LMs; 'auto' means it too)")
    add_neuron_config_arguments(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    add_checkpoint_arguments(parser)
    add_compile_cache_arguments(parser)
    parser.add_argument("--no_cache", "--disable_neuron_cache", dest="no_cache", action="store_true",
                        help="compile even if the compile cache has the graphs (and store nothing)")
    parser.add_argument("--disable-validation", "--disable_validation", dest="disable_validation", action="store_true",
                        help="accepted for optimum-neuron scripts: exports are never validated here; run "
                             "`optimum-cli neuron verify` for that")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """How the checkpoint is found: Transformers' own loading options."""
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")
    parser.add_argument("--subfolder", default="", help="folder of the Hub repo or directory holding the checkpoint")
    parser.add_argument("--cache_dir", type=Path, default=None,
                        help="download cache for Hub checkpoints, as in Transformers (default: HF_HOME's hub cache)")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
                        help="run code from outside: the model repo's own modeling code (Transformers' meaning) and "
                             "the compiled graphs of the Hub compile cache (--cache_repo)")


def add_compile_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile_cache_dir", type=Path, default=None,
                        help="compile cache (default: $OPTIMUM_NEURONX_CACHE or <HF_HOME>/optimum-neuronx/compile-cache)")
    parser.add_argument("--cache_repo", "--repo_id", dest="cache_repo", default=None,
                        help="Hub model repo used as a shared compile cache (default: $OPTIMUM_NEURONX_CACHE_REPO, "
                             "$CUSTOM_CACHE_REPO, or the repo `optimum-cli neuron cache set` chose)")


def add_neuron_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch_size", type=int, default=None, help="compiled batch size (default: 1)")
    parser.add_argument("--sequence_length", type=int, default=None,
                        help="KV-cache length: prompt + generated tokens (default: the model's max_position_embeddings, "
                             "at most 4096)")
    parser.add_argument("--num_cores", "--tensor_parallel_size", dest="num_cores", type=int, default=None,
                        help="tensor-parallel degree (neuron backend; default: 1)")
    parser.add_argument("--auto_cast_type", "--dtype", dest="auto_cast_type", default=None,
                        help="dtype of the weights and compute: fp32, bf16 or fp16 (default: the checkpoint's dtype)")
    parser.add_argument("--auto_cast", default=None, choices=("none", "matmul", "all"),
                        help="accepted for optimum-neuron scripts and ignored, as optimum-neuron does for decoders: "
                             "--auto_cast_type sets the dtype")
    parser.add_argument("--torch_dtype", default=None,
                        help="the same as --auto_cast_type, in torch's names: float32, bfloat16, float16")
    parser.add_argument("--backend", default=None, choices=("inductor", "neuron"),
                        help="inductor: AOTInductor graphs for this CPU; neuron: StableHLO graphs run through PJRT, on a "
                             "Neuron device where the plugin is installed, else on the XLA CPU device "
                             "(default: inductor; neuron when --num_cores > 1)")
    parser.add_argument("--instance_type", default=None,
                        help="Neuron instance the neuron backend plans memory and compiles NEFFs for, e.g. inf2.48xlarge, "
                             "trn1, trn2 (default: inf2)")
    parser.add_argument("--context_buckets", type=_int_list, default=None, metavar="N[,N...]",
                        help="prompt lengths to compile prefill graphs for, e.g. 128,512 (default: powers of two "
                             "from 128 up to sequence_length)")
    parser.add_argument("--token_buckets", type=_int_list, default=None, metavar="N[,N...]",
                        help="cache windows to compile decode graphs for; the largest must be sequence_length "
                             "(default: powers of two from 128 up to sequence_length)")
    parser.add_argument("--speculation_length", type=int, default=None, metavar="K",
                        help="compile verification graphs that score K drafted tokens in one pass, for generate's "
                             "prompt_lookup_num_tokens / assistant_model (batch size 1; default: 0, none)")
    parser.add_argument("--quantization", default=None, choices=("int8",),
                        help="weight-only quantization of the layers' projections: int8, one scale per output channel "
                             "(default: none)")
    parser.add_argument("--on_device_sampling", action="store_true", default=None,
                        help="the graphs also pick the next token (greedy, temperature, top-k, top-p), which generate "
                             "uses when a request asks for nothing more")
    parser.add_argument("--continuous_batching", action="store_true", default=None,
                        help="serve requests that join and leave the batch at any step (optimum-cli neuron serve): "
                             "one-row prefill graphs that also encode prompts longer than the largest bucket, and "
                             "fused graphs that run a decode step and a prompt chunk in one call")
    parser.add_argument("--compiler_args", action="append", default=[], metavar="ARG",
                        help="backend option, repeatable; inductor: NAME=VALUE, a torch._inductor.config option; "
                             "neuron: a neuronx-cc flag, e.g. --compiler_args=-O3")
    level = parser.add_mutually_exclusive_group()
    for n in (1, 2, 3):
        level.add_argument(f"-O{n}", dest="optlevel", action="store_const", const=n,
                           help=f"neuronx-cc optimization level {n} (neuron backend; default: 2; accepted and "
                                f"ignored on the inductor backend)")


def hf_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Transformers' loading keywords the checkpoint options ask for."""
    kwargs = {"revision": args.revision, "subfolder": args.subfolder or None,
              "cache_dir": str(args.cache_dir) if args.cache_dir else None,
              "trust_remote_code": args.trust_remote_code or None}
    return {k: v for k, v in kwargs.items() if v is not None}


def neuron_config_from_args(args: argparse.Namespace, config=None):
    """The NeuronConfig the options ask for; unset ones default from the model `config` (optimum-neuron's
    defaults), else the NeuronConfig defaults."""
    from ..configuration import NeuronConfig, canonical_dtype

    compiler_args = list(args.compiler_args)
    if getattr(args, "auto_cast", None):
        logging.getLogger("optimum_neuronx").info("--auto_cast %s ignored: decoders compute in --auto_cast_type "
                                                  "(as optimum-neuron does for them).", args.auto_cast)
    if getattr(args, "optlevel", None):
        if (args.backend or ("neuron" if (args.num_cores or 1) > 1 else "inductor")) != "neuron":
            logging.getLogger("optimum_neuronx").info(
                "-O%d ignored: it is a neuronx-cc optimization level, for --backend neuron (the inductor backend "
                "takes its options as --compiler_args NAME=VALUE).", args.optlevel)
        elif any(arg.startswith("-O") for arg in compiler_args):
            raise ValueError(f"-O{args.optlevel} and --compiler_args {compiler_args} both set the optimization level: "
                             f"keep one.")
        else:
            compiler_args.append(f"-O{args.optlevel}")
    dtype = args.auto_cast_type
    if getattr(args, "torch_dtype", None):
        if dtype and canonical_dtype(dtype) != canonical_dtype(args.torch_dtype):
            raise ValueError(f"--auto_cast_type {dtype} and --torch_dtype {args.torch_dtype} disagree: pass one.")
        dtype = args.torch_dtype
    options = dict(batch_size=args.batch_size, sequence_length=args.sequence_length, tp_degree=args.num_cores,
                   auto_cast_type=dtype, backend=args.backend, context_buckets=args.context_buckets,
                   token_buckets=args.token_buckets, compiler_args=tuple(compiler_args),
                   instance_type=getattr(args, "instance_type", None),
                   speculation_length=getattr(args, "speculation_length", None),
                   quantization=getattr(args, "quantization", None),
                   on_device_sampling=getattr(args, "on_device_sampling", None),
                   continuous_batching=getattr(args, "continuous_batching", None))
    if config is not None:
        return NeuronConfig.for_model(config, **options)
    return NeuronConfig(**{k: v for k, v in options.items() if v is not None})


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
    from ..exporters.registry import load_model_config

    show_progress()
    try:
        if args.task not in ("text-generation", "auto"):
            raise ValueError(f"--task {args.task}: optimum-neuronx exports causal language models only, task "
                             f"text-generation. Use optimum-neuron for other tasks.")
        model_dir = Path(args.model)
        if model_dir.is_dir() and (args.output.resolve() == model_dir.resolve()
                                   or model_dir.resolve().is_relative_to(args.output.resolve())):
            raise ValueError(f"output directory {args.output} holds the model being exported ({args.model}): writing "
                             f"the export there would replace the checkpoint. Choose another output directory.")
        if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:
            raise FileExistsError(f"output directory {args.output} exists and is not empty; pass --overwrite "
                                  f"to replace its content, or choose another directory")
        hf_kwargs = hf_kwargs_from_args(args)
        config = load_model_config(args.model, **hf_kwargs)
        neuron_config = neuron_config_from_args(args, config)
        cache = None if args.no_cache else CompileCache(args.compile_cache_dir, args.cache_repo)
        stamp = export(args.model, args.output, neuron_config, hf_kwargs=hf_kwargs, cache=cache, config=config)
    except (ValueError, ArtifactError, FileExistsError, OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, seconds in stamp.compile_time_s.items():
        print(f"compiled {name} in {seconds:.1f} s")
    print(f"Exported {args.model} ({neuron_config.auto_cast_type}, batch_size={neuron_config.batch_size}, "
          f"sequence_length={neuron_config.sequence_length}) to {args.output}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="optimum-cli export neuron",
                                     description=f"Export a causal LM to compiled graphs (optimum-neuronx {__version__})")
    add_export_arguments(parser)
    return run_export(parser.parse_args(argv))
