"""On-device sampling: the next token picked inside the graph from its logits, as Transformers' greedy search or its
sampling (temperature, then top-k, then top-p, then a draw) would pick it.

Each row's request is four numbers, `sampling[b] = (top_k, top_p, temperature, uniform)`: temperature 0 is greedy
(argmax); top_k 0 is no top-k (then top_p must be 1: the draw is over the whole vocabulary); `uniform` in [0, 1) is
the row's random number, drawn on the host (seeded by torch's generator), turned into a token by inverse transform
sampling over the kept tokens' probabilities.
"""

from __future__ import annotations

import torch

# The most tokens top-k / top-p keep candidates among (the graph sorts only these); larger top_k runs on the host.
MAX_TOP_K = 256
SAMPLING_FIELDS = ("top_k", "top_p", "temperature", "uniform")


def _inverse_transform(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cumsum(weights)[i - 1] <= uniform * total < cumsum(weights)[i]."""
    cumulative = weights.cumsum(-1)
    threshold = uniform[:, None] * cumulative[:, -1:]
    return (cumulative <= threshold).sum(-1).clamp(max=weights.shape[-1] - 1)


def sample_tokens(logits: torch.Tensor, sampling: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (float32), sampling [B, 4] (SAMPLING_FIELDS) -> token ids [B]."""
    # Indexed, not unbound: unbind traces to squeeze ops torch-mlir lacks.
    sampling = sampling.float()
    top_k, top_p, temperature, uniform = (sampling[:, i] for i in range(len(SAMPLING_FIELDS)))
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    lowest = torch.finfo(scaled.dtype).min
    # top-k, then top-p among the k kept: candidates sorted by logit, a token kept while the mass before it < top_p;
    # the most likely one always (top_p 0 or tiny is greedy, as Transformers' min_tokens_to_keep=1 makes it)
    values, indices = scaled.topk(min(MAX_TOP_K, logits.shape[-1]), dim=-1)
    ranks = torch.arange(values.shape[-1], device=logits.device)
    kept = ranks[None, :] < top_k[:, None]
    probs = torch.softmax(values.masked_fill(~kept, lowest), dim=-1) * kept
    kept = kept & (((probs.cumsum(-1) - probs) < top_p[:, None]) | (ranks[None, :] == 0))
    candidate = indices.gather(1, _inverse_transform(probs * kept, uniform)[:, None])[:, 0]
    # no top-k (and no top-p): the whole vocabulary, in vocabulary order
    anywhere = _inverse_transform(torch.softmax(scaled, dim=-1), uniform)
    drawn = torch.where(top_k > 0, candidate, anywhere)
    return torch.where(greedy, logits.argmax(-1), drawn)
