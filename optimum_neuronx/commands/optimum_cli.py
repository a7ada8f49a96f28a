"""optimum-cli integration: `optimum-cli export neuron`, `optimum-cli neuron verify|cache|estimate|serve`.

optimum discovers commands in modules of the `optimum.commands.register` namespace; ours
(optimum/commands/register/register_optimum_neuronx.py) imports REGISTER_COMMANDS from here.
"""

from __future__ import annotations

import importlib.util
import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand

from .cache import (add_cache_arguments, add_create_arguments, add_lookup_arguments, add_set_arguments, run_clear,
                    run_create, run_list, run_lookup, run_set, run_synchronize)
from .estimate import add_estimate_arguments, run_estimate
from .export import add_export_arguments, run_export, show_progress
from .verify import add_verify_arguments, run_verify


def add_serve_arguments(parser):
    from ..server.options import add_serve_arguments as add

    add(parser)


def run_serve_command(args) -> int:
    try:
        from ..server.launch import run_serve
    except ImportError as err:
        print(f"error: serving needs the [serve] extra (pip install 'optimum-neuronx[serve]'): {err}", file=sys.stderr)
        return 2
    try:
        return run_serve(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

# optimum-neuron registers `optimum-cli export neuron` too: then ours is `export neuronx`, and says so.
OPTIMUM_NEURON_INSTALLED = importlib.util.find_spec("optimum.neuron") is not None
EXPORT_NAME = "neuronx" if OPTIMUM_NEURON_INSTALLED else "neuron"


class NeuronxExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name=EXPORT_NAME,
        help="Export a causal LM to static-shape compiled graphs (optimum-neuronx)"
        + (" [`export neuron` is optimum-neuron's command]" if OPTIMUM_NEURON_INSTALLED else ""),
    )

    @staticmethod
    def parse_args(parser):
        add_export_arguments(parser)

    def run(self):
        if OPTIMUM_NEURON_INSTALLED:
            print("optimum-neuron is installed and owns `optimum-cli export neuron`; this is optimum-neuronx's "
                  "`optimum-cli export neuronx`.", file=sys.stderr)
        sys.exit(run_export(self.args))


class NeuronxVerifyCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="verify", help="Compare an exported model with the Transformers reference")

    @staticmethod
    def parse_args(parser):
        add_verify_arguments(parser)

    def run(self):
        sys.exit(run_verify(self.args))


def _leaf(name: str, help_text: str, add_arguments, run):
    class Leaf(BaseOptimumCLICommand):
        COMMAND = CommandInfo(name=name, help=help_text)

        @staticmethod
        def parse_args(parser):
            add_arguments(parser)

        def run(self):
            show_progress()
            sys.exit(run(self.args))

    return CommandInfo(name=name, help=help_text, subcommand_class=Leaf)


class NeuronxCacheCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="cache", help="The compile cache: list, look up, clear, share on the Hub")
    SUBCOMMANDS = (
        _leaf("list", "List the compiled graphs in the local cache", add_cache_arguments, run_list),
        _leaf("lookup", "Cached exports of a model, from its config alone", add_lookup_arguments, run_lookup),
        _leaf("clear", "Remove every local entry", add_cache_arguments, run_clear),
        _leaf("create", "Create a private Hub repo to share the cache (and use it by default)", add_create_arguments,
              run_create),
        _leaf("set", "Use this Hub repo as the shared compile cache by default", add_set_arguments, run_set),
        _leaf("synchronize", "Push the local entries the Hub cache repo lacks", add_cache_arguments,
              run_synchronize),
    )


class NeuronxCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name=EXPORT_NAME, help="optimum-neuronx tools")
    SUBCOMMANDS = (
        CommandInfo(name="verify", help=NeuronxVerifyCommand.COMMAND.help, subcommand_class=NeuronxVerifyCommand),
        CommandInfo(name="cache", help=NeuronxCacheCommand.COMMAND.help, subcommand_class=NeuronxCacheCommand),
        _leaf("estimate", "Memory an export needs and the NeuronCores that takes (from the config alone)",
              add_estimate_arguments, run_estimate),
        _leaf("serve", "An OpenAI-compatible server with continuous batching (the [serve] extra)",
              add_serve_arguments, run_serve_command),
    )


REGISTER_COMMANDS = [(NeuronxExportCommand, ExportCommand), NeuronxCommand]
