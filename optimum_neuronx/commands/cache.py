"""`optimum-cli neuron cache list|lookup|clear`: inspect and empty the compile cache."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path


def add_cache_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache_dir", type=Path, default=None,
                        help="compile cache (default: $OPTIMUM_NEURONX_CACHE or <HF_HOME>/optimum-neuronx/compile-cache)")


def run_list(args) -> int:
    from ..cache import CompileCache

    cache = CompileCache(args.cache_dir)
    rows = list(cache.entries())
    print(f"{len(rows)} entries in {cache.root}")
    for entry, meta in rows:
        nc = meta["fields"]["neuron_config"]
        size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file()) / 2**20
        created = datetime.fromtimestamp(meta["created"]).isoformat(timespec="seconds")
        print(f"{meta['digest']}  {meta['fields']['model'].get('model_type', '?')}  batch_size={nc['batch_size']} "
              f"sequence_length={nc['sequence_length']} {nc['auto_cast_type']} {nc['backend']}  {size:.1f} MiB  "
              f"{created}")
    return 0


def run_lookup(args) -> int:
    """Compute the key of an export (loads and converts the weights, compiles nothing) and look it up."""
    from ..cache import CompileCache
    from ..exporters.export import prepare
    from .export import neuron_config_from_args

    try:
        key = prepare(args.model, neuron_config_from_args(args)).cache_key()
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    cache = CompileCache(args.cache_dir)
    entry = cache.lookup(key)
    if entry is not None:
        print(f"cache hit {key.digest}: {entry}")
        return 0
    print(f"cache miss {key.digest}: {cache.miss_reason(key)}")
    return 1


def run_clear(args) -> int:
    from ..cache import CompileCache

    cache = CompileCache(args.cache_dir)
    print(f"removed {cache.clear()} entries from {cache.root}")
    return 0


def add_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    from .export import add_neuron_config_arguments

    parser.add_argument("--model", "-m", required=True, help="Hub model id or local checkpoint directory")
    add_neuron_config_arguments(parser)
    add_cache_dir_argument(parser)
