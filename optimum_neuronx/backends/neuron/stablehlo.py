"""Lower one of the decoder's graphs to StableHLO with torch-mlir, weights kept as arguments.

`torch.export` gives the program; `run_decompositions()` brings it to core ATen; torch-mlir's FX importer turns it
into a StableHLO module whose arguments are, in `graph_signature.input_specs` order, the weights (parameters and
buffers) and then the decoder's inputs. The in-place KV-cache write becomes a leading output, and the cache argument
is marked `tf.aliasing_output` so that PJRT donates its buffer: the cache stays on the device between calls.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ...modeling.kernels import Kernels


class NeuronKernels(Kernels):
    """Plain PyTorch, the layers unrolled over their stacked weights (torch-mlir cannot lower `scan`), the fused
    projections split per shard (`shards` > 1: tensor parallel, modeling/sharding.py)."""

    scan_layers = False

    def __init__(self, shards: int = 1):
        self.shards = shards

    def describe(self) -> dict:
        return {"scan_layers": False, "shards": self.shards, "attention": "kv-heads-major"}

    def attention(self, q, keys, values, mask, scale, tokens):
        # KV heads ahead of the batch: the batched matmuls flatten those two leading axes into one, and XLA can keep
        # a split across devices only on the major one (with the batch first it would gather every head per device).
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask.transpose(0, 1), scale=scale)
        return out.transpose(0, 1)

    def window_attention(self, q, cache_kv, new_kv, cache_mask, new_mask, scale, tokens):
        keys = torch.cat((cache_kv[0], new_kv[0]), dim=2)
        values = torch.cat((cache_kv[1], new_kv[1]), dim=2)
        return self.attention(q, keys, values, torch.cat((cache_mask, new_mask), dim=-1), scale, tokens)


@dataclass(frozen=True)
class GraphArgument:
    name: str  # a weight's state_dict name, or the decoder input's name
    kind: str  # "weight" or "input"
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    sharded_axis: Optional[int] = None  # the axis split across the graph's shards; None: replicated


@dataclass(frozen=True)
class StableHLOGraph:
    name: str
    text: str  # the MLIR module, StableHLO dialect
    arguments: tuple[GraphArgument, ...]
    outputs: tuple[str, ...]  # "kv_cache" (the donated cache, written) and "logits"
    aliases: dict[int, int] = field(default_factory=dict)  # argument index -> output index it is donated to
    shards: int = 1  # devices the graph is partitioned across (XLA SPMD)

    def argument_index(self, name: str) -> int:
        return next(i for i, argument in enumerate(self.arguments) if argument.name == name)

    def output_axis(self, index: int) -> Optional[int]:
        """The axis output `index` is split along: a donated argument's, else None (replicated)."""
        donor = next((a for a, o in self.aliases.items() if o == index), None)
        return None if donor is None else self.arguments[donor].sharded_axis

    def to_dict(self) -> dict:
        """The graph's manifest entry: everything but the module text."""
        return {"name": self.name, "shards": self.shards, "outputs": list(self.outputs),
                "aliases": {str(a): o for a, o in self.aliases.items()},
                "arguments": [{"name": a.name, "kind": a.kind, "shape": list(a.shape), "dtype": a.dtype,
                               "sharded_axis": a.sharded_axis} for a in self.arguments]}

    @classmethod
    def from_dict(cls, entry: dict, text: str) -> "StableHLOGraph":
        """The graph a manifest entry and its module text describe; a module calling anything but what the
        lowering emits is refused (`check_custom_calls`)."""
        check_custom_calls(text, entry.get("name", "?"))
        arguments = tuple(GraphArgument(a["name"], a["kind"], tuple(a["shape"]), a["dtype"], a["sharded_axis"])
                          for a in entry["arguments"])
        return cls(entry["name"], text, arguments, tuple(entry["outputs"]),
                   {int(a): int(o) for a, o in entry["aliases"].items()}, int(entry["shards"]))


# The custom_call targets our lowering emits (none: torch-mlir lowers every op of the decoder to StableHLO ops).
# Any other target - a Python callback, a LAPACK kernel jaxlib registers - runs native code with the module's
# layouts, which a StableHLO file from elsewhere can choose: refused before compiling.
ALLOWED_CUSTOM_CALLS: frozenset[str] = frozenset()
_CUSTOM_CALL = re.compile(r'custom_call\b\s*(?:@([\w.$-]+)|\(|")')
_CALL_TARGET = re.compile(r'call_target_name\s*=\s*"([^"]*)"')


def check_custom_calls(text: str, graph: str) -> None:
    """Refuse a StableHLO module that makes a custom call to a target outside ALLOWED_CUSTOM_CALLS, naming it."""
    if "custom_call" not in text:
        return
    targets = {m.group(1) for m in _CUSTOM_CALL.finditer(text) if m.group(1)}
    targets |= set(_CALL_TARGET.findall(text))
    refused = sorted(targets - ALLOWED_CUSTOM_CALLS) or ["(a custom_call whose target could not be read)"]
    raise ValueError(f"graph {graph}: its StableHLO makes custom calls to {', '.join(refused)}, which the lowering "
                     f"never emits (they run native code outside the graph): refusing to compile it. Re-export the "
                     f"model.")


def hlo_sharding(rank: int, axis: Optional[int], shards: int) -> str:
    """XLA's sharding of a rank-`rank` array split `shards` ways along `axis` (None: a full copy on every device)."""
    if axis is None or shards == 1:
        return "{replicated}"
    tiles = ",".join(str(shards if i == axis else 1) for i in range(rank))
    return f"{{devices=[{tiles}]{','.join(map(str, range(shards)))}}}"


def partitioned(graph: StableHLOGraph, axes: dict[str, int], shards: int) -> StableHLOGraph:
    """`graph` partitioned across `shards` devices by XLA SPMD: argument `name` split along `axes[name]` (others
    replicated), each donated output laid out as its argument, the other outputs replicated."""
    if shards == 1:
        return graph
    arguments = tuple(replace(a, sharded_axis=axes.get(a.name)) for a in graph.arguments)
    graph = replace(graph, arguments=arguments, shards=shards)
    argument_attributes = {i: {"mhlo.sharding": hlo_sharding(len(a.shape), a.sharded_axis, shards)}
                           for i, a in enumerate(arguments)}
    text = _with_function_attributes(graph.text, argument_attributes, lambda index, rank: {
        "mhlo.sharding": hlo_sharding(rank, graph.output_axis(index), shards)})
    return replace(graph, text=text)


def lower_graph(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], name: str) -> StableHLOGraph:
    """`module` (e.g. a StaticDecoder with NeuronKernels) at `example_inputs` as a StableHLO graph named `name`.

    Raises ValueError naming the graph and the operation when torch-mlir cannot express one.
    """
    from torch.export.graph_signature import InputKind, OutputKind

    program = torch.export.export(module, tuple(example_inputs), strict=False).run_decompositions()
    signature = program.graph_signature
    placeholders = [node for node in program.graph.nodes if node.op == "placeholder"]
    arguments = []
    for spec, node in zip(signature.input_specs, placeholders):
        value = node.meta["val"]
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            kind, argument_name = "weight", spec.target
        elif spec.kind == InputKind.USER_INPUT:
            kind, argument_name = "input", spec.arg.name
        else:
            raise ValueError(f"graph {name}: input {spec.arg.name} is a {spec.kind.name}; the StableHLO lowering takes "
                             f"only weights and tensor inputs")
        arguments.append(GraphArgument(argument_name, kind, tuple(int(size) for size in value.shape),
                                       str(value.dtype).removeprefix("torch.")))
    outputs, aliases = [], {}
    for index, spec in enumerate(signature.output_specs):
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            aliases[next(i for i, argument in enumerate(arguments) if argument.name == spec.target)] = index
            outputs.append(spec.target)
        elif spec.kind == OutputKind.USER_OUTPUT:
            outputs.append("logits" if "logits" not in outputs else f"output_{index}")
        else:
            raise ValueError(f"graph {name}: output {index} is a {spec.kind.name}; only user outputs and in-place "
                             f"writes of inputs are lowered")
    text = _import(program, name)
    check_custom_calls(text, name)
    return StableHLOGraph(name, _with_aliases(_portable(text), aliases), tuple(arguments), tuple(outputs), aliases)


def _import(program, name: str) -> str:
    from torch_mlir import fx

    with _stderr_captured() as diagnostics:  # MLIR prints its diagnostics there, not into the exception
        try:
            return str(fx.stateless_fx_import(program.graph_module, output_type="stablehlo"))
        except Exception as err:  # torch-mlir raises NotImplementedError or its own compiler error
            failure = err
    message = f"{diagnostics.text}\n{failure}"
    op = (re.search(r'name = "(torch\.aten\.[\w.]+)"', message) or re.search(r"(torch\.aten\.[\w.]+)", message)
          or re.search(r"Higher-order operation '(\w+)'", message))
    what = op.group(1) if op else str(failure).strip().splitlines()[0][:200]
    raise ValueError(f"graph {name}: the StableHLO lowering (torch-mlir) cannot express {what}. "
                     f"Rewrite that part of the model in ops torch-mlir lowers.") from failure


class _Captured:
    text = ""


@contextlib.contextmanager
def _stderr_captured():
    """File descriptor 2 into a temporary file for the block (C++ writes there); its text is written back after."""
    captured = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")
    if captured.text:
        sys.stderr.write(captured.text)


def _portable(text: str) -> str:
    # torch-mlir leaves a few arith.constant ops; StableHLO consumers (PJRT, neuronx-cc) want stablehlo.constant.
    return text.replace("arith.constant", "stablehlo.constant")


def _with_aliases(text: str, aliases: dict[int, int]) -> str:
    """Mark each aliased argument of the module's public function with `tf.aliasing_output = <output index>`."""
    return _with_function_attributes(text, {argument: {"tf.aliasing_output": output}
                                            for argument, output in aliases.items()})


def _with_function_attributes(text: str, arguments: dict[int, dict],
                              results: Optional[Callable[[int, int], dict]] = None) -> str:
    """The module `text` with attributes added to its public function's arguments (index -> {name: value}) and, with
    `results`, to each result (`results(index, rank)` -> {name: value}), through jaxlib's MLIR bindings: an int
    value becomes an i32 attribute, a string a string attribute."""
    from jaxlib.mlir import ir
    from jaxlib.mlir._mlir_libs import _jax_mlir_ext
    from jaxlib.mlir.dialects import stablehlo as stablehlo_dialect

    def attribute(value):
        if isinstance(value, int):
            return ir.IntegerAttr.get(ir.IntegerType.get_signless(32), value)
        return ir.StringAttr.get(value)

    def merged(function, field: str, what: str, count: int, added: dict[int, dict]):
        current = ([{a.name: a.attr for a in ir.DictAttr(d)} for d in function.attributes[field]]
                   if field in function.attributes else [{} for _ in range(count)])
        for index, attributes in added.items():
            if not 0 <= index < count:
                raise ValueError(f"{what} {index} is not in the lowered function's signature")
            current[index].update({name: attribute(value) for name, value in attributes.items()})
        return ir.ArrayAttr.get([ir.DictAttr.get(d) for d in current])

    registry = ir.DialectRegistry()
    _jax_mlir_ext.register_dialects(registry)  # func, arith and the other upstream dialects
    with ir.Context() as context, ir.Location.unknown():
        context.append_dialect_registry(registry)
        context.allow_unregistered_dialects = True
        context.load_all_available_dialects()
        stablehlo_dialect.register_dialect(context)
        module = ir.Module.parse(text)
        function = next((op for op in module.body.operations if op.operation.name == "func.func"
                         and "sym_visibility" not in op.attributes), None)
        if function is None:
            raise ValueError("the lowered module has no public function")
        kinds = ir.FunctionType(ir.TypeAttr(function.attributes["function_type"]).value)
        function.attributes["arg_attrs"] = merged(function, "arg_attrs", "argument", len(kinds.inputs), arguments)
        if results is not None:
            ranks = [ir.RankedTensorType(t).rank for t in kinds.results]
            function.attributes["res_attrs"] = merged(function, "res_attrs", "result", len(ranks),
                                                      {i: results(i, rank) for i, rank in enumerate(ranks)})
        return str(module)
