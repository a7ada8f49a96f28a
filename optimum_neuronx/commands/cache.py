"""`optimum-cli neuron cache list|lookup|clear|create|synchronize`: the compile cache, local and on the Hub."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    from .export import add_compile_cache_arguments, no_abbreviations

    no_abbreviations(parser)
    add_compile_cache_arguments(parser)


def _cache(args):
    from ..cache import CompileCache

    return CompileCache(args.compile_cache_dir, args.cache_repo)


def _describe(meta: dict) -> str:
    nc = meta["fields"]["neuron_config"]
    return (f"{meta['fields']['model'].get('model_type', '?')}  batch_size={nc.get('batch_size')} "
            f"sequence_length={nc.get('sequence_length')} {nc.get('auto_cast_type')} {nc.get('backend')} "
            f"tp={nc.get('tp_degree')}")


# The versions that decide whether an entry's graphs can be used by this installation (the rest of the stamp follows
# from the export's options: another batch size lowers differently but is not "another version").
_VERSION_FIELDS = ("optimum_neuronx", "artifact_format", "torch")


def _same_versions(cached: dict, wanted: dict) -> bool:
    return all(cached.get(k) == wanted.get(k) for k in _VERSION_FIELDS) and \
        (cached.get("compiler") or {}).get("version") == (wanted.get("compiler") or {}).get("version")


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
    from ..cache import CompileCache
    from ..exporters.plan import plan_export
    from ..exporters.registry import load_model_config
    from .export import hf_kwargs_from_args, neuron_config_from_args

    cache: CompileCache = _cache(args)
    try:
        hf_kwargs = hf_kwargs_from_args(args)
        config = load_model_config(args.model, **hf_kwargs)
        neuron_config = neuron_config_from_args(args, config)
        key = plan_export(args.model, neuron_config, hf_kwargs, config=config, check_host_memory=False).cache_key()
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
            usable = "" if _same_versions(meta["fields"]["versions"], key.fields["versions"]) \
                else "  (other versions: not usable here)"
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


DEFAULT_CACHE_REPO_NAME = "optimum-neuronx-cache"


def _full_repo_id(name: str, token=None) -> str:
    """`name`, in the logged-in user's namespace when it names none (as optimum-neuron's `cache create -n`)."""
    if "/" in name:
        return name
    from huggingface_hub import HfApi

    return f"{HfApi(token=token).whoami()['name']}/{name}"


def run_create(args) -> int:
    from ..cache import create_cache_repo, set_default_cache_repo

    name = args.repo_id or args.name or DEFAULT_CACHE_REPO_NAME
    if args.repo_id and args.name and args.repo_id != args.name:
        print(f"error: two repo names given ({args.repo_id} and -n {args.name}): pass one.", file=sys.stderr)
        return 1
    try:
        repo_id = _full_repo_id(name)
        url = create_cache_repo(repo_id, private=not args.public)
    except Exception as err:  # noqa: BLE001 (huggingface_hub's HTTP errors say what went wrong)
        print(f"error: could not create {name}: {err}", file=sys.stderr)
        return 1
    set_default_cache_repo(repo_id)
    print(f"Created the {'public' if args.public else 'private'} compile cache repo {url}, now the default cache "
          f"repo of this machine (`optimum-cli neuron cache set` changes it; --cache_repo overrides it).")
    return 0


def run_set(args) -> int:
    from ..cache import set_default_cache_repo

    try:
        repo_id = _full_repo_id(args.repo_id)
    except Exception as err:  # noqa: BLE001
        print(f"error: {args.repo_id} names no namespace and the logged-in user is unknown ({err}): pass "
              f"NAMESPACE/NAME.", file=sys.stderr)
        return 1
    path = set_default_cache_repo(repo_id)
    print(f"{repo_id} is now the default compile cache repo (written to {path}).")
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
    from .export import add_checkpoint_arguments, add_neuron_config_arguments, no_abbreviations

    no_abbreviations(parser)
    parser.add_argument("model", help="Hub model id or local checkpoint directory (only its config is read)")
    add_neuron_config_arguments(parser)
    add_checkpoint_arguments(parser)
    add_cache_arguments(parser)


def add_create_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    parser.add_argument("repo_id", nargs="?", default=None,
                        help="the Hub model repo to create, e.g. my-org/optimum-neuronx-cache (default: "
                             f"<your user name>/{DEFAULT_CACHE_REPO_NAME})")
    parser.add_argument("-n", "--name", default=None, help="the same, as optimum-neuron names it")
    parser.add_argument("--public", action="store_true", help="make the repo public (default: private)")


def add_set_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    parser.add_argument("repo_id", help="the Hub cache repo to use by default (NAMESPACE/NAME, or NAME in yours)")
