"""`optimum-cli neuron cache list|lookup|clear|create|synchronize`: the compile cache, local and on the Hub."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    from .export import add_compile_cache_arguments

    add_compile_cache_arguments(parser)


def _cache(args):
    from ..cache import CompileCache

    return CompileCache(args.compile_cache_dir, args.cache_repo)


def _describe(meta: dict) -> str:
    nc = meta["fields"]["neuron_config"]
    return (f"{meta['fields']['model'].get('model_type', '?')}  batch_size={nc['batch_size']} "
            f"sequence_length={nc['sequence_length']} {nc['auto_cast_type']} {nc['backend']} tp={nc['tp_degree']}")


def run_list(args) -> int:
    cache = _cache(args)
    rows = list(cache.entries())
    print(f"{len(rows)} entries in {cache.root}")
    for entry, meta in rows:
        size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file()) / 2**20
        created = datetime.fromtimestamp(meta["created"]).isoformat(timespec="seconds")
        print(f"{meta['digest']}  {_describe(meta)}  {size:.1f} MiB  {created}")
    return 0


def run_lookup(args) -> int:
    """From the model's config alone (no weights): the cached graphs for its decoder, and whether the export the
    options describe (unset ones default as in `export neuron`) is among them."""
    from transformers import AutoConfig

    from ..cache import CompileCache
    from ..exporters.export import prepare
    from .export import hf_kwargs_from_args, neuron_config_from_args

    cache: CompileCache = _cache(args)
    try:
        hf_kwargs = hf_kwargs_from_args(args)
        neuron_config = neuron_config_from_args(args, AutoConfig.from_pretrained(args.model, **hf_kwargs))
        prepared = prepare(args.model, neuron_config, hf_kwargs, load_weights=False)
        key = prepared.cache_key()
        model = key.fields["model"]
        remote = cache.hub_entry_metas() if cache.hub_repo else []
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    local = [meta for _, meta in cache.matching_model(model)]
    shared = [meta for meta in remote if meta["fields"].get("model") == model]
    print(f"{len(local)} cached exports of this model in {cache.root}"
          + (f", {len(shared)} in the Hub repo {cache.hub_repo}" if cache.hub_repo else ""))
    for where, metas in (("local", local), ("hub", shared)):
        for meta in metas:
            same = meta["fields"]["versions"] == key.fields["versions"]
            usable = "" if same else "  (other versions: not usable here)"
            print(f"  {where}  {meta['digest']}  {_describe(meta)}{usable}")
    if cache.lookup(key) is not None or any(meta["digest"] == key.digest for meta in shared):
        print(f"cache hit {key.digest}: {_describe({'fields': key.fields})}")
        return 0
    print(f"cache miss {key.digest}: {cache.miss_reason(key)}")
    return 1


def run_clear(args) -> int:
    cache = _cache(args)
    print(f"removed {cache.clear()} entries from {cache.root}")
    return 0


def run_create(args) -> int:
    from ..cache import CACHE_REPO_ENV, create_cache_repo

    try:
        url = create_cache_repo(args.repo_id, private=not args.public)
    except Exception as err:  # noqa: BLE001 (huggingface_hub's HTTP errors say what went wrong)
        print(f"error: could not create {args.repo_id}: {err}", file=sys.stderr)
        return 1
    print(f"Created the {'public' if args.public else 'private'} compile cache repo {url}. Use it with "
          f"--cache_repo {args.repo_id} or {CACHE_REPO_ENV}={args.repo_id}.")
    return 0


def run_synchronize(args) -> int:
    cache = _cache(args)
    try:
        pushed = cache.synchronize()
    except Exception as err:  # noqa: BLE001
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {len(pushed)} entries from {cache.root} to {cache.hub_repo}")
    return 0


def add_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    from .export import add_checkpoint_arguments, add_neuron_config_arguments

    parser.add_argument("model", help="Hub model id or local checkpoint directory (only its config is read)")
    add_neuron_config_arguments(parser)
    add_checkpoint_arguments(parser)
    add_cache_arguments(parser)


def add_create_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="the Hub model repo to create, e.g. my-org/optimum-neuronx-cache")
    parser.add_argument("--public", action="store_true", help="make the repo public (default: private)")
