"""optimum-cli integration: `optimum-cli export neuron` and `optimum-cli neuron verify`.

optimum discovers commands in modules of the `optimum.commands.register` namespace; ours
(optimum/commands/register/register_optimum_neuronx.py) imports REGISTER_COMMANDS from here.
"""

from __future__ import annotations

import importlib.util
import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand

from .export import add_export_arguments, run_export
from .verify import add_verify_arguments, run_verify

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


class NeuronxCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name=EXPORT_NAME, help="optimum-neuronx tools")
    SUBCOMMANDS = (CommandInfo(name="verify", help=NeuronxVerifyCommand.COMMAND.help,
                               subcommand_class=NeuronxVerifyCommand),)


REGISTER_COMMANDS = [(NeuronxExportCommand, ExportCommand), NeuronxCommand]
