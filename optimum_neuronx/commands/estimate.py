"""`optimum-cli neuron estimate`: the memory an export needs and the NeuronCores that takes, from the config alone."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    parser.add_argument("--model", "-m", required=True, help="Hub model id or local directory with a config.json")
    parser.add_argument("--batch_size", type=int, default=1, help="compiled batch size (default: 1)")
    parser.add_argument("--sequence_length", type=int, default=1024, help="KV-cache length (default: 1024)")
    parser.add_argument("--auto_cast_type", default="fp32", help="fp32, bf16 or fp16 (default: fp32)")
    parser.add_argument("--num_cores", "--tensor_parallel_size", dest="num_cores", type=int, default=1,
                        help="tensor-parallel degree to report on (default: 1)")
    parser.add_argument("--instance_type", default=None,
                        help="Neuron instance type, e.g. inf2.48xlarge or trn1 (default: inf2)")
    parser.add_argument("--revision", default=None, help="Hub revision of --model")


def run_estimate(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from ..configuration import NeuronConfig
    from ..instances import GIB
    from ..exporters import get_export_config, supported_model_types
    from ..memory import estimate_memory, estimate_memory_from_config

    try:
        neuron_config = NeuronConfig(batch_size=args.batch_size, sequence_length=args.sequence_length,
                                     auto_cast_type=args.auto_cast_type, tp_degree=args.num_cores,
                                     instance_type=args.instance_type, backend="neuron")
        config = AutoConfig.from_pretrained(args.model, **({"revision": args.revision} if args.revision else {}))
        if config.model_type in supported_model_types():  # the decoder this export builds (a window-only cache)
            estimate = estimate_memory(get_export_config(config.model_type).decoder_spec(config, neuron_config),
                                       neuron_config)
        else:
            estimate = estimate_memory_from_config(config, neuron_config)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    instance = estimate.instance
    print(f"model: {args.model} ({config.model_type}), {neuron_config.auto_cast_type}, batch_size={args.batch_size}, "
          f"sequence_length={args.sequence_length}")
    print(f"weights:   {estimate.weight_bytes / GIB:8.2f} GiB")
    print(f"KV cache:  {estimate.kv_cache_bytes / GIB:8.2f} GiB")
    print(f"total:     {estimate.total_bytes / GIB:8.2f} GiB")
    print(f"instance:  {instance.name} ({instance.target}): {instance.cores} NeuronCores of "
          f"{instance.core_memory_bytes / GIB:g} GiB, tp degrees {', '.join(map(str, instance.tp_degrees))}")
    for tp in instance.tp_degrees:
        note = "" if estimate.shardable(tp) else "  (heads do not divide)"
        fits = "fits" if estimate.shardable(tp) and estimate.per_core_bytes(tp) <= instance.core_memory_bytes else ""
        print(f"  tp_degree {tp:3d}: {estimate.per_core_bytes(tp) / GIB:8.2f} GiB per core {fits}{note}")
    if estimate.min_tp_degree is None:
        print(f"smallest fitting tp_degree: none on {instance.name}; lower batch_size or sequence_length, or pick a "
              f"larger instance_type")
        return 1
    print(f"smallest fitting tp_degree: {estimate.min_tp_degree} (--num_cores {estimate.min_tp_degree})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="optimum-cli neuron estimate", description=__doc__)
    add_estimate_arguments(parser)
    return run_estimate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
