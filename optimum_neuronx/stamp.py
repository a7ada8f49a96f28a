"""What an export's neuron_config.json records, typed: `ExportStamp` (the options, graphs, decoder spec, backend
stamp, versions, files and source an export was made with), written once by the export and read back by
`artifacts.read_artifact` instead of being derived again from config.json. Parsing checks every field's type: a
hostile or damaged file raises ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from .configuration import GraphSpec, NeuronConfig
from .modeling.spec import DecoderSpec

# Artifact formats this package reads: 8 records the decoder spec; 7 does not (it is derived from config.json).
READABLE_ARTIFACT_FORMATS = (7, 8)


def _frozen(mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class BackendStamp:
    """How the graphs were compiled: the backend, its compiler's version, the machine features the code needs
    (`target`), the backend's kernel choices (`lowering`: its Kernels.describe()), code-generation options, and the
    weights the backend reorders at load (`packable_weights`, into `packed_rows` rows)."""

    name: str
    version: str
    target: str
    lowering: Mapping[str, object] = field(default_factory=dict)
    codegen: Mapping[str, object] = field(default_factory=dict)
    packable_weights: tuple[str, ...] = ()

    @property
    def packed_rows(self) -> int:
        rows = self.lowering.get("packed_rows", 0)
        return rows if isinstance(rows, int) and not isinstance(rows, bool) else 0

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "target": self.target, "lowering": dict(self.lowering),
                "codegen": dict(self.codegen), "packable_weights": list(self.packable_weights)}

    @classmethod
    def from_dict(cls, data) -> "BackendStamp":
        _require(isinstance(data, dict), "versions.compiler is not an object")
        for name in ("name", "version", "target"):
            _require(isinstance(data.get(name), str), f"versions.compiler.{name} is not a string")
        for name in ("lowering", "codegen"):
            _require(isinstance(data.get(name, {}), dict), f"versions.compiler.{name} is not an object")
        packable = data.get("packable_weights", [])
        _require(isinstance(packable, list) and all(isinstance(n, str) for n in packable),
                 "versions.compiler.packable_weights is not a list of names")
        return cls(data["name"], data["version"], data["target"], _frozen(data.get("lowering", {})),
                   _frozen(data.get("codegen", {})), tuple(packable))


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


@dataclass(frozen=True)
class ExportStamp:
    """neuron_config.json, parsed. `spec` and `model_type` are None in format 7 exports, which did not record them.
    `identity`: the sha256 of the very bytes parsed (trust.py records it)."""

    artifact_format: int
    neuron_config: NeuronConfig
    graphs: tuple[GraphSpec, ...]
    backend: BackendStamp
    model_type: Optional[str]
    spec: Optional[DecoderSpec]
    versions: Mapping[str, str]  # optimum_neuronx, torch, transformers
    files: Mapping[str, FileRecord]
    compile_time_s: Mapping[str, float]
    source: Optional[Mapping[str, object]]  # the Hub checkpoint the weights come from: repo_id, revision, subfolder
    config_hash: str
    identity: str = ""

    @property
    def source_repo(self) -> Optional[str]:
        return source_repo(self.source)

    def to_json(self) -> dict:
        """neuron_config.json's content; `model` (model_type and the decoder spec) only where a spec is recorded."""
        meta = {
            "artifact_format": self.artifact_format,
            "neuron_config": self.neuron_config.to_dict(),
            "graphs": [{"kind": g.kind, "tokens": g.tokens, "window": g.window} for g in self.graphs],
            "versions": {**self.versions, "compiler": self.backend.to_dict()},
            "config_hash": self.config_hash,
            "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in self.files.items()},
            "compile_time_s": dict(self.compile_time_s),
            "source": dict(self.source) if self.source is not None else None,
        }
        if self.spec is not None:
            meta["model"] = {"model_type": self.model_type, "decoder_spec": self.spec.to_dict()}
        return meta

    @classmethod
    def from_json(cls, meta, identity: str = "") -> "ExportStamp":
        """Parse neuron_config.json's content: ValueError naming the first field that is missing or of a wrong type
        (KeyError for a missing one, TypeError for the wrong kind of value)."""
        _require(isinstance(meta, dict), "the file does not hold an object")
        fmt = meta["artifact_format"]
        neuron_config = NeuronConfig.from_dict(meta["neuron_config"])
        versions = meta["versions"]
        _require(isinstance(versions, dict), "versions is not an object")
        backend = BackendStamp.from_dict(versions["compiler"])
        files, graphs = meta.get("files"), meta.get("graphs")
        _require(isinstance(files, dict) and all(
            isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)
            for info in files.values()), "files is not a list of sizes and sha256 digests")
        _require(isinstance(graphs, list) and all(
            isinstance(g, dict) and set(g) == {"kind", "tokens", "window"} and isinstance(g["kind"], str)
            and all(isinstance(g[n], int) and not isinstance(g[n], bool) for n in ("tokens", "window"))
            for g in graphs),
            "graphs is not a list of graphs")
        model_type, spec = None, None
        if "model" in meta:
            model = meta["model"]
            _require(isinstance(model, dict) and isinstance(model.get("model_type"), str),
                     "model is not an object naming a model_type")
            spec = DecoderSpec.from_dict(model.get("decoder_spec"))
            model_type = model["model_type"]
        times = meta.get("compile_time_s") or {}
        source = meta.get("source")
        return cls(
            artifact_format=fmt, neuron_config=neuron_config, graphs=tuple(GraphSpec(**g) for g in graphs),
            backend=backend, model_type=model_type, spec=spec,
            versions=_frozen({k: v for k, v in versions.items() if k != "compiler"}),
            files=_frozen({name: FileRecord(info["size"], info["sha256"]) for name, info in files.items()}),
            compile_time_s=_frozen(times if isinstance(times, dict) else {}),
            source=_frozen(source) if isinstance(source, dict) else None,
            config_hash=str(meta.get("config_hash")), identity=identity)



def source_repo(source) -> Optional[str]:
    """The Hub repo id a stamp's `source` names (None where it names none, or is not a mapping)."""
    repo_id = source.get("repo_id") if isinstance(source, Mapping) else None
    return repo_id if isinstance(repo_id, str) else None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
