"""What a generate or forward call may ask of an export: its inputs checked against the compiled shapes and
vocabulary, the options that change nothing dropped with a warning, speculation within what the verification graphs
score, and the choice between on-device sampling and the logits path."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Optional

import torch
from transformers import GenerationConfig

from .buckets import context_bucket
from .configuration import NeuronConfig
from .modeling.sampling import MAX_TOP_K

logger = logging.getLogger(__name__)

NO_INPUTS_EMBEDS = ("inputs_embeds is not supported: the compiled graphs start from token ids (the embedding lookup "
                    "is compiled in). Pass input_ids.")

# GenerationConfig fields that add a logits processor or ask for the logits themselves: what the sampling graphs do not.
_HOST_ONLY_FIELDS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                     "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                     "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
                     "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "guidance_scale", "typical_p",
                     "min_p", "top_h", "epsilon_cutoff", "eta_cutoff", "renormalize_logits", "remove_invalid_values",
                     "watermarking_config", "output_scores", "output_logits", "prompt_lookup_num_tokens",
                     "penalty_alpha", "dola_layers")
_HOST_ONLY_KWARGS = ("assistant_model", "logits_processor", "prefix_allowed_tokens_fn", "negative_prompt_ids",
                     "custom_generate")


def check_input_ids(input_ids, vocab_size: int) -> None:
    """Ids the graphs can take: out-of-vocabulary ids would abort the process inside the embedding lookup."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        got = f"shape {tuple(input_ids.shape)}" if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, tokens] tensor, got {got}. One prompt of n tokens is "
                         f"ids[None], shape [1, n].")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids holds no prompts (shape {tuple(input_ids.shape)}): pass at least one row.")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids holds no tokens: a prompt needs at least one (e.g. the tokenizer's BOS token).")
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= vocab_size:
        raise ValueError(f"Token id {low if low < 0 else high} is outside this model's vocabulary (ids 0 to "
                         f"{vocab_size - 1}). Encode prompts with this model's tokenizer.")


def check_batch(batch_size: int, rows: int, what: str) -> None:
    if rows > batch_size:
        raise ValueError(f"The {what} needs {rows} rows but the model was compiled for batch_size={batch_size}. "
                         f"Split the batch, or re-export with batch_size >= {rows}.")


def check_generate_mask(mask, input_ids) -> None:
    """generate's attention_mask: Transformers drops an all-ones mask before forward, so a mask of the wrong width
    would go unnoticed there."""
    if torch.is_tensor(mask) and (mask.dim() != 2 or mask.shape[1] != input_ids.shape[1]
                                  or mask.shape[0] not in (1, input_ids.shape[0])):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(input_ids.shape)}: "
                         f"pass the mask the tokenizer returned with the ids.")


def check_forward_request(input_ids, labels, kwargs: dict) -> None:
    """What forward cannot return or take: a loss, hidden states, attention weights, embeddings, and optimum-neuron's
    vLLM runner's per-sequence inputs."""
    if kwargs.get("inputs_embeds") is not None or input_ids is None:
        raise ValueError(NO_INPUTS_EMBEDS)
    unsupported = [k for k in ("output_hidden_states", "output_attentions") if kwargs.get(k)]
    if labels is not None or unsupported:
        asked = ", ".join(["labels (a loss)"] * (labels is not None) + [f"{k}=True" for k in unsupported])
        raise ValueError(f"{asked}: the compiled graphs return logits only, at the positions generation needs. Run "
                         f"the original checkpoint with transformers.AutoModelForCausalLM for a loss, hidden states "
                         f"or attention weights.")
    served_elsewhere = [k for k in ("position_ids", "seq_ids", "sampling_params") if kwargs.get(k) is not None]
    if served_elsewhere:
        raise ValueError(f"forward({', '.join(f'{k}=...' for k in served_elsewhere)}): optimum-neuron's vLLM runner "
                         f"call is not served by forward: positions come from attention_mask (left or right padding) "
                         f"and sampling runs in generate. Pass input_ids and attention_mask, or call generate; "
                         f"requests in per-sequence slots are served by `optimum-cli neuron serve` (an export with "
                         f"continuous_batching=True; optimum_neuronx.scheduler in Python).")


def forward_mask(attention_mask) -> Optional[torch.Tensor]:
    """forward's attention_mask as booleans, after checking it marks tokens 0 or 1 and every row has one."""
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask) or attention_mask.is_complex() or \
            not ((attention_mask == 0) | (attention_mask == 1)).all():
        found = (torch.unique(attention_mask)[:5].tolist() if torch.is_tensor(attention_mask)
                 else type(attention_mask).__name__)
        raise ValueError(f"attention_mask must hold 0 (padding) and 1 (a real token) only, got {found}: pass the "
                         f"mask the tokenizer returned with the ids.")
    attention_mask = attention_mask.to(torch.bool)
    empty = (~attention_mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask row(s) {empty} mark no token as real (all zeros): those rows have nothing "
                         f"to attend to. Drop them from the batch, or pass the mask the tokenizer returned with the "
                         f"ids.")
    return attention_mask


def fit_generation_length(nc: NeuronConfig, shape, config: GenerationConfig, truncate: bool,
                          continuing: bool = False) -> Optional[int]:
    """max_new_tokens lowered to fit sequence_length where `truncate`, else None (or an error if it does not fit).
    `continuing`: generate continues from the model's live cache (a draft model's later rounds), so only the tokens
    after it are encoded, as decode steps: no context bucket needs to hold the whole prompt."""
    batch, prompt = shape
    beams = config.num_beams or 1
    rows = batch * (beams if beams > 1 else (config.num_return_sequences or 1))
    check_batch(nc.batch_size, rows, f"batch of {batch} prompts x {max(beams, config.num_return_sequences or 1)} "
                                     f"beams/sequences")
    if not continuing and not nc.continuous_batching:  # (continuous batching encodes long prompts in chunks)
        context_bucket(prompt, nc.context_buckets)  # raises if the prompt does not fit any bucket
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt
    if prompt + new_tokens <= nc.sequence_length:
        return None
    room = nc.sequence_length - prompt
    if truncate and room > 0:
        logger.warning("max_new_tokens lowered from %d to %d: prompt (%d tokens) + new tokens must fit "
                       "sequence_length=%d.", new_tokens, room, prompt, nc.sequence_length)
        return room
    raise ValueError(
        f"The prompt ({prompt} tokens) + max_new_tokens ({new_tokens}) = {prompt + new_tokens} exceeds the "
        f"compiled sequence_length ({nc.sequence_length}). Use max_new_tokens <= {max(room, 0)}, pass "
        f"truncate_to_sequence_length=True to cap it, or re-export with sequence_length >= {prompt + new_tokens}."
    )


def drop_cache_options(config: GenerationConfig, generation_config, kwargs: dict):
    """The graphs always read and write their own static KV cache: `use_cache=False` or a `cache_implementation`
    would change nothing in the tokens (and Transformers' code for them does not fit a static graph). Returns the
    generation_config to pass on; kwargs are updated in place."""
    overrides = {}
    if config.use_cache is False:
        overrides["use_cache"] = True
    if config.cache_implementation is not None:
        overrides["cache_implementation"] = None
    if not overrides:
        return generation_config
    logger.warning("%s ignored: the compiled model always uses its own static KV cache (same tokens).",
                   ", ".join(f"{k}={getattr(config, k)!r}" for k in overrides))
    if generation_config is not None and not any(k in kwargs for k in overrides):
        generation_config = copy.deepcopy(generation_config)  # the caller's object stays as it was
        generation_config.update(**overrides)
    else:
        kwargs.update(overrides)
    return generation_config


def check_speculation(speculation_length: int, batch: int, config: GenerationConfig, kwargs: dict) -> None:
    """Assisted generation (prompt lookup or a draft model) within what the verification graphs take: one sequence,
    at most speculation_length drafted tokens a pass (a draft model's, left unset, drafts that many: `drafting`).
    Exports without verification graphs score drafts one decode step each."""
    lookup, assistant = config.prompt_lookup_num_tokens, kwargs.get("assistant_model")
    if not lookup and assistant is None:
        return
    k = speculation_length
    if batch * (config.num_return_sequences or 1) > 1:
        raise ValueError(f"Speculative decoding (prompt_lookup_num_tokens / assistant_model) scores one sequence at a "
                         f"time, but this request has {batch} prompts x {config.num_return_sequences or 1} sequences. "
                         f"Generate them one by one, or without speculation.")
    if not k:
        logger.warning("This export has no verification graphs (speculation_length=0): each drafted token costs a "
                       "full decode step, so speculation is no faster. Re-export with speculation_length=k to score k "
                       "drafted tokens in one pass.")
        return
    if lookup and lookup > k:
        raise ValueError(f"prompt_lookup_num_tokens={lookup} exceeds the {k} drafted tokens this export's "
                         f"verification graphs score in one pass (speculation_length={k}). Use "
                         f"prompt_lookup_num_tokens <= {k}, or re-export with speculation_length={lookup}.")
    drafted = getattr(getattr(assistant, "generation_config", None), "num_assistant_tokens", None)
    if drafted is not None and drafted > k:
        raise ValueError(f"The assistant model's generation_config.num_assistant_tokens={drafted} exceeds the {k} "
                         f"drafted tokens this export's verification graphs score in one pass (speculation_length="
                         f"{k}). Set it <= {k} (left unset, {k} is used), or re-export with speculation_length="
                         f"{drafted}.")


@contextlib.contextmanager
def drafting(assistant, speculation_length: int):
    """A draft model whose generation_config leaves num_assistant_tokens unset (Transformers' default: 20) drafts
    speculation_length tokens during this generate, what one verification pass scores."""
    config = getattr(assistant, "generation_config", None)
    if not speculation_length or config is None or config.num_assistant_tokens is not None:
        yield
        return
    config.num_assistant_tokens = speculation_length
    try:
        yield
    finally:
        config.num_assistant_tokens = None


def on_device_sampler(nc: NeuronConfig, vocab_size: int, config: GenerationConfig, kwargs: dict,
                      asked: Optional[bool]) -> Optional[tuple[float, float, float]]:
    """(top_k, top_p, temperature) for the sampling graphs when this request asks only for what they do (greedy
    search, or sampling with temperature, top_k <= MAX_TOP_K and top_p) and on-device sampling is not turned off
    (`asked` False); else None, the logits path (a debug log says why). `asked` True makes that an error."""
    if asked is False:
        return None
    if not nc.on_device_sampling:
        if asked:
            raise ValueError("on_device_sampling=True, but this export's graphs return logits only. Re-export with "
                             "on_device_sampling=True, or leave on_device_sampling unset.")
        return None
    unable = on_device_blockers(config, kwargs, vocab_size)
    if unable:
        if asked:
            raise ValueError(f"on_device_sampling=True, but the graphs cannot do {', '.join(unable)}: they pick "
                             f"tokens by greedy search, or by sampling with temperature, top_k (1 to {MAX_TOP_K}, or "
                             f"0 with top_p=1) and top_p. Drop those options, or leave on_device_sampling unset to "
                             f"run them on the logits.")
        logger.debug("On-device sampling not used for this request (%s): it runs on the logits.", ", ".join(unable))
        return None
    if not config.do_sample:
        return (0.0, 1.0, 0.0)
    top_k = config.top_k if config.top_k is not None else 50
    top_k = 0 if top_k >= vocab_size else top_k
    return (float(top_k), float(1.0 if config.top_p is None else config.top_p),
            float(1.0 if config.temperature is None else config.temperature))


def on_device_blockers(config: GenerationConfig, kwargs: dict, vocab_size: int) -> list[str]:
    """What a generate request asks for that the sampling graphs cannot do, as `name=value` strings."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()
    unable = [f"{name}={getattr(config, name)!r}" for name in _HOST_ONLY_FIELDS
              if getattr(config, name, None) not in (None, defaults.get(name))
              and not (name == "guidance_scale" and getattr(config, name) == 1)]
    unable += [name for name in _HOST_ONLY_KWARGS if kwargs.get(name)]
    if (config.num_beams or 1) > 1:
        unable.append(f"num_beams={config.num_beams}")
    if config.do_sample:
        top_k = config.top_k if config.top_k is not None else 50
        top_p = 1.0 if config.top_p is None else config.top_p
        if MAX_TOP_K < top_k < vocab_size:
            unable.append(f"top_k={top_k} (more than {MAX_TOP_K})")
        if (top_k == 0 or top_k >= vocab_size) and top_p < 1.0:
            unable.append(f"top_p={top_p} without top_k")
    return unable
