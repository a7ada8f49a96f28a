"""pipeline("text-generation") over a compiled model: ours and Transformers' own, same output as eager."""

import logging

import pytest
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from optimum_neuronx import NeuronModelForCausalLM, pipeline

pytestmark = pytest.mark.slow
GREEDY = dict(max_new_tokens=16, do_sample=False)


@pytest.fixture(scope="module")
def saved_smollm2(smollm2_compiled, tmp_path_factory):
    directory = tmp_path_factory.mktemp("pipeline") / "smollm2"
    smollm2_compiled.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def eager_pipeline(smollm2_checkpoint):
    return transformers.pipeline("text-generation", model=str(smollm2_checkpoint))


def test_strings_batches_and_chat_match_eager(saved_smollm2, eager_pipeline):
    pipe = pipeline("text-generation", model=str(saved_smollm2))
    assert isinstance(pipe, transformers.TextGenerationPipeline)
    assert isinstance(pipe.model, NeuronModelForCausalLM)
    prompts = ["The capital of France is", "Once upon a time, in a small village,"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert pipe(prompts[0], **GREEDY) == eager_pipeline(prompts[0], **GREEDY)
    assert pipe(prompts, **GREEDY) == eager_pipeline(prompts, **GREEDY)
    answer = pipe(chat, **GREEDY)
    assert answer == eager_pipeline(chat, **GREEDY)
    assert answer[0]["generated_text"][-1]["content"] == "The capital of France is Paris."


def test_transformers_pipeline_accepts_our_model_without_error(smollm2_compiled, smollm2_tokenizer, caplog):
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.ERROR):
            pipe = transformers.pipeline("text-generation", model=smollm2_compiled, tokenizer=smollm2_tokenizer)
    finally:
        transformers.logging.disable_propagation()
    assert "is not supported" not in caplog.text
    assert pipe("The capital of France is", **GREEDY)[0]["generated_text"].startswith("The capital of France is Paris")


def test_registration_does_not_hijack_llama():
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2)
    assert type(AutoModelForCausalLM.from_config(config)) is LlamaForCausalLM


def test_pipeline_refuses_a_model_that_is_not_a_supported_causal_lm(tmp_path):
    from transformers import BertConfig

    BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=37).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported.*gemma3_text, gpt2, granite, llama"):
        pipeline("text-generation", model=str(tmp_path), export=True, sequence_length=32)
    with pytest.raises(ValueError, match=r"Task 'summarization' is not supported; supported tasks: text-generation"):
        pipeline("summarization", model=str(tmp_path))


def test_optimum_neuron_pipeline_dicts_are_export_options(smollm2_checkpoint, smollm2_compiled, saved_smollm2):
    """optimum-neuron's pipeline(..., export=True, input_shapes={...}, compiler_args={...}): the same export as the
    keywords give (a compile-cache hit of the session's SmolLM2 export), the same answers."""
    pipe = pipeline("text-generation", model=str(smollm2_checkpoint), export=True,
                    input_shapes={"batch_size": 2, "sequence_length": 128},
                    compiler_args={"auto_cast_type": "fp32", "num_cores": 1}, context_buckets=[64], token_buckets=[128])
    assert pipe.model.neuron_config == smollm2_compiled.neuron_config
    reference = pipeline("text-generation", model=str(saved_smollm2))
    assert pipe("The capital of France is", **GREEDY) == reference("The capital of France is", **GREEDY)
    with pytest.raises(ValueError, match=r"\['optlevel'\] are not export options"):
        pipeline("text-generation", model=str(smollm2_checkpoint), export=True, compiler_args={"optlevel": 2})
