"""Hub I/O for exported models, all through huggingface_hub (endpoint, token and cache handling are its own)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from .artifacts import WEIGHTS_NAME, ArtifactError, read_artifact

logger = logging.getLogger(__name__)

_LOAD = """```python
from transformers import AutoTokenizer
from optimum_neuronx import NeuronModelForCausalLM

model = NeuronModelForCausalLM.from_pretrained("{repo_id}")  # loads the compiled graphs: no compilation
tokenizer = AutoTokenizer.from_pretrained("{repo_id}", padding_side="left")
inputs = tokenizer(["Hello"], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**inputs, max_new_tokens=32)))
```"""


def model_card(artifact_dir: Path, repo_id: str, include_weights: bool = True):
    """The export's model card (huggingface_hub ModelCard): base_model, pipeline_tag, library_name, tags, the export
    parameters and how to load it."""
    import json

    from huggingface_hub import ModelCard, ModelCardData

    stamp = read_artifact(artifact_dir, optional=(WEIGHTS_NAME,))
    neuron_config, versions, source = stamp.neuron_config, stamp.versions, stamp.source or {}
    model_type = stamp.model_type or json.loads((Path(artifact_dir) / "config.json").read_text()).get("model_type", "?")
    base_model = source.get("repo_id")
    data = ModelCardData(
        base_model=base_model, pipeline_tag="text-generation", library_name="optimum-neuronx",
        tags=["optimum-neuronx", neuron_config.backend, model_type, "static-shapes"],
        optimum_neuronx={"batch_size": neuron_config.batch_size, "sequence_length": neuron_config.sequence_length,
                         "auto_cast_type": neuron_config.auto_cast_type, "tp_degree": neuron_config.tp_degree,
                         "backend": neuron_config.backend, "instance_type": neuron_config.instance_type,
                         "package": versions["optimum_neuronx"], "torch": versions["torch"]},
    )
    rows = [("model_type", f"`{model_type}`"), ("base model", f"[{base_model}](https://huggingface.co/{base_model})"
                                                if base_model else "a local checkpoint"),
            ("batch_size", neuron_config.batch_size), ("sequence_length", neuron_config.sequence_length),
            ("context buckets", list(neuron_config.context_buckets)),
            ("token-generation buckets", list(neuron_config.token_buckets)),
            ("dtype (auto_cast_type)", neuron_config.auto_cast_type), ("tp_degree", neuron_config.tp_degree),
            ("torch", versions["torch"]),
            ("compiler", f"{stamp.backend.name} {stamp.backend.version}"),
            ("compiled for", stamp.backend.target or "any machine the backend runs on")]
    weights = ("" if include_weights else
               f"\n\nThe weights are not in this repo: loading it fetches them from `{base_model}` (commit "
               f"`{source.get('revision')}`), converts them and checks them against the sha256 the export recorded.")
    content = "\n".join([
        f"---\n{data.to_yaml()}\n---", "", f"# {repo_id}", "",
        f"`{base_model or model_type}` compiled with [optimum-neuronx](https://github.com/huggingface/optimum-neuronx) "
        f"{versions['optimum_neuronx']} for the `{neuron_config.backend}` backend: static shapes, so the values "
        f"below are fixed; re-export to change them. On another machine, torch version or CPU the graphs are rebuilt "
        f"from the config and weights on first load (the compile cache keeps them).{weights}", "",
        "| setting | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), "", _LOAD.format(
            repo_id=repo_id), ""])
    return ModelCard(content)


def push_artifact(artifact_dir: Path, repo_id: str, *, token: Optional[str] = None, private: Optional[bool] = None,
                  revision: Optional[str] = None, commit_message: Optional[str] = None, create_pr: bool = False,
                  include_weights: bool = True, endpoint: Optional[str] = None):
    """Upload an exported directory and a generated model card to `repo_id`, in one commit (without the weights
    file when `include_weights=False`: the export names its Hub source checkpoint instead)."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"Invalid Hub repo id {repo_id!r}: {err}") from None
    if not include_weights and not read_artifact(artifact_dir).source_repo:
        raise ValueError(f"include_weights=False: {artifact_dir} was exported from a local directory, so it names no "
                         f"Hub checkpoint to take the weights from. Export it from the Hub repo id (e.g. "
                         f"from_pretrained('org/model', export=True)), or push with include_weights=True.")
    api = HfApi(token=token, endpoint=endpoint)
    card = str(model_card(artifact_dir, repo_id, include_weights)).encode()
    skipped = {"README.md"} | (set() if include_weights else {WEIGHTS_NAME})
    operations = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p))
                  for p in sorted(Path(artifact_dir).iterdir()) if p.is_file() and p.name not in skipped]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card))
    with _naming_endpoint(api.endpoint):
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.create_commit(repo_id, operations, commit_message=commit_message or "Upload optimum-neuronx export",
                                 revision=revision, create_pr=create_pr)
    logger.info("Pushed %s to %s (%s)", artifact_dir, repo_id, info.commit_url)
    return info


# from_pretrained's keywords that reach snapshot_download when it loads an export from the Hub.
DOWNLOAD_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")


def download_artifact(repo_id: str, *, revision: Optional[str] = None, token: Optional[str] = None,
                      cache_dir: Optional[str] = None, local_files_only: bool = False,
                      force_download: bool = False) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HFValidationError

    try:
        with _naming_endpoint(constants.ENDPOINT):
            return Path(snapshot_download(repo_id, revision=revision, token=token, cache_dir=cache_dir,
                                          local_files_only=local_files_only, force_download=force_download))
    except HFValidationError as err:
        raise ArtifactError(f"{repo_id!r} is neither a local directory nor a valid Hub repo id: {err}") from None


class _naming_endpoint:
    """Re-raise network failures with the endpoint they were talking to, the first thing to check."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        from huggingface_hub.errors import LocalEntryNotFoundError

        network = ("ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "TimeoutException")
        if exc is not None and (isinstance(exc, (LocalEntryNotFoundError, ConnectionError))
                                or type(exc).__name__ in network):
            raise ConnectionError(f"Cannot reach the Hub at {self.endpoint} ({type(exc).__name__}: {exc}). Check "
                                  f"HF_ENDPOINT and your network, or use a local directory.") from exc
        return False
