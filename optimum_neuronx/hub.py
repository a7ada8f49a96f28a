"""Hub I/O for exported models, all through huggingface_hub (endpoint, token and cache handling are its own)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from .artifacts import ArtifactError, read_artifact

logger = logging.getLogger(__name__)

_CARD = """---
library_name: optimum-neuronx
tags:
- optimum-neuronx
- {backend}
---

# {repo_id}

Compiled with [optimum-neuronx](https://github.com/huggingface/optimum-neuronx) {package} for the
`{backend}` backend: static shapes, so the values below are fixed; re-export to change them.

| setting | value |
|---|---|
| model_type | `{model_type}` |
| batch_size | {batch_size} |
| sequence_length | {sequence_length} |
| context buckets | {context_buckets} |
| token-generation buckets | {token_buckets} |
| dtype (auto_cast_type) | {auto_cast_type} |
| tp_degree | {tp_degree} |
| torch | {torch} |
| compiler | {compiler} |
| compiled for | {target} |

```python
from optimum_neuronx import NeuronModelForCausalLM

model = NeuronModelForCausalLM.from_pretrained("{repo_id}")  # loads the compiled graphs, no compilation
```
"""


def model_card(artifact_dir: Path, repo_id: str) -> str:
    import json

    neuron_config, meta = read_artifact(artifact_dir)
    model_type = json.loads((Path(artifact_dir) / "config.json").read_text()).get("model_type", "?")
    versions = meta["versions"]
    return _CARD.format(
        repo_id=repo_id, package=versions["optimum_neuronx"], backend=neuron_config.backend, model_type=model_type,
        batch_size=neuron_config.batch_size, sequence_length=neuron_config.sequence_length,
        context_buckets=list(neuron_config.context_buckets), token_buckets=list(neuron_config.token_buckets),
        auto_cast_type=neuron_config.auto_cast_type, tp_degree=neuron_config.tp_degree, torch=versions["torch"],
        compiler=f"{versions['compiler']['name']} {versions['compiler']['version']}",
        target=versions["compiler"].get("target") or "any machine the backend runs on",
    )


def push_artifact(artifact_dir: Path, repo_id: str, *, token: Optional[str] = None, private: Optional[bool] = None,
                  revision: Optional[str] = None, commit_message: Optional[str] = None, create_pr: bool = False):
    """Upload an exported directory and a generated model card to `repo_id`, in one commit."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"Invalid Hub repo id {repo_id!r}: {err}") from None
    api = HfApi(token=token)
    card = model_card(artifact_dir, repo_id).encode()
    operations = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p))
                  for p in sorted(Path(artifact_dir).iterdir()) if p.is_file() and p.name != "README.md"]
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
