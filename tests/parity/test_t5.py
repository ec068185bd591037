"""T5 (flax_lm/models/t5) against transformers' T5ForConditionalGeneration: the logits of the original T5 (ReLU,
output layer tied and scaled), of v1.1 (gated GELU, a head of its own) and of a byte vocabulary (ByT5), without a
cache and one decoder token at a time with it; an export loaded by transformers; a sharded bfloat16 checkpoint saved
by transformers loaded into ours; greedy decoding and beam search equal to generate; the presets' parameter counts."""

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import transformers
from test_create_config import create_config

from flax_lm.generation.sampling import Sampling
from flax_lm.generation.seq2seq import decode_sources, generate_seq2seq_ids, make_seq2seq_generate
from flax_lm.models.huggingface import read_exported_params, save_model
from flax_lm.models.model_code import load_model_code
from flax_lm.models.t5 import model as t5
from flax_lm.training.train_state import abstract_model_params

VARIANTS = {
    "v1.1 gated-gelu untied": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "original relu tied": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    # ByT5's 256 bytes, 3 special tokens and 125 sentinels; a deeper encoder than decoder, as ByT5's.
    "byte vocabulary": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, vocab_size=384, num_layers=3),
}


def t5_config(**overrides):
    """A tiny T5 whose buckets (8, up to 20 positions) are all reached by the tests' 30 tokens."""
    values = dict(
        vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
    )  # fmt: skip
    return transformers.T5Config(**{**values, **overrides})


def torch_model_of(config, params):
    """T5ForConditionalGeneration with `params`: transformers 5 ties lm_head to the embedding on construction, which a
    checkpoint with a head of its own unties, as here."""
    model = transformers.T5ForConditionalGeneration(config).eval()
    if not t5.scales_output(config):
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    state_dict = {name: torch.from_numpy(np.array(value)) for name, value in t5.to_hf_state_dict(params).items()}
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    tied |= {"lm_head.weight"} if t5.scales_output(config) else set()
    assert not unexpected and set(missing) == tied
    return model


def inputs(config, rng):
    """A batch of two sources (the second padded) and targets, the first target token the decoder start."""
    input_ids = rng.integers(3, config.vocab_size, (2, 30)).astype(np.int32)
    attention_mask = np.ones((2, 30), np.int32)
    attention_mask[1, 21:] = 0
    decoder_input_ids = rng.integers(3, config.vocab_size, (2, 25)).astype(np.int32)
    decoder_input_ids[:, 0] = 0
    return input_ids, attention_mask, decoder_input_ids


def torch_logits(model, input_ids, attention_mask, decoder_input_ids):
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(input_ids).long(),
            attention_mask=torch.from_numpy(attention_mask).long(),
            decoder_input_ids=torch.from_numpy(decoder_input_ids).long(),
        ).logits.numpy()


def random_params(model, config, seed=0):
    ids = np.zeros((1, 4), np.int32)
    return jax.tree.map(np.asarray, nn.meta.unbox(model.init(jax.random.key(seed), ids)["params"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers_without_and_with_the_decoder_cache(variant):
    config = t5_config(**VARIANTS[variant])
    model = t5.MODEL_CLASS(config)
    params = random_params(model, config)
    assert t5.hf_shapes(params) == t5.hf_architecture_shapes(config)
    input_ids, attention_mask, decoder_input_ids = inputs(config, np.random.default_rng(0))
    expected = torch_logits(torch_model_of(config, params), input_ids, attention_mask, decoder_input_ids)
    logits = model.apply({"params": params}, input_ids, attention_mask, decoder_input_ids)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)

    encoder_output = model.apply({"params": params}, input_ids, attention_mask, method="encode")
    cache = model.apply({"params": params}, encoder_output, attention_mask, 25, method="start_decoding")
    decode = jax.jit(lambda column, cache: model.apply({"params": params}, column, cache, method="decode"))
    columns = []
    for position in range(decoder_input_ids.shape[1]):
        column_logits, cache = decode(decoder_input_ids[:, position : position + 1], cache)
        columns.append(np.asarray(column_logits[:, 0]))
    np.testing.assert_allclose(np.stack(columns, axis=1), expected, atol=1e-4, rtol=0)


def t5_code(config):
    return load_model_code(config, None, False, "the tests", encoder_decoder=True)


@pytest.mark.parametrize("variant", ["v1.1 gated-gelu untied", "original relu tied"])
def test_an_export_loads_in_transformers_with_the_same_logits(variant, tmp_path):
    config = t5_config(**VARIANTS[variant])
    model = t5.MODEL_CLASS(config)
    params = random_params(model, config, seed=1)
    save_model(str(tmp_path), params, config, transformers.T5Tokenizer(), t5_code(config))
    torch_model, loading_info = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert type(torch_model).__name__ == "T5ForConditionalGeneration"
    assert not any(loading_info.values()), loading_info
    assert torch_model.config.scale_decoder_outputs == t5.scales_output(config)
    # A head of its own is loaded as one, not tied to the embedding.
    assert (torch_model.lm_head.weight is torch_model.shared.weight) == t5.scales_output(config)
    assert torch_model.generation_config.decoder_start_token_id == 0  # which generate needs, and T5's config lacks
    input_ids, attention_mask, decoder_input_ids = inputs(config, np.random.default_rng(1))
    expected = torch_logits(torch_model.eval(), input_ids, attention_mask, decoder_input_ids)
    logits = model.apply({"params": params}, input_ids, attention_mask, decoder_input_ids)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)


def test_a_sharded_bfloat16_checkpoint_of_transformers_loads_into_ours(tmp_path):
    config = t5_config(**VARIANTS["v1.1 gated-gelu untied"])
    torch.manual_seed(0)
    torch_model = transformers.T5ForConditionalGeneration(config)
    torch_model.lm_head.weight = torch.nn.Parameter(torch.randn(config.vocab_size, config.d_model))
    torch_model.to(torch.bfloat16).save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    model = t5.MODEL_CLASS(transformers.T5Config.from_pretrained(str(tmp_path)))
    abstract = abstract_model_params(model, np.zeros((1, 4), np.int32))
    params = read_exported_params(str(tmp_path), None, t5_code(model.config), abstract)
    input_ids, attention_mask, decoder_input_ids = inputs(config, np.random.default_rng(2))
    expected = torch_logits(loaded, input_ids, attention_mask, decoder_input_ids)
    logits = model.apply({"params": params}, input_ids, attention_mask, decoder_input_ids)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", ["t5-tiny", "t5-small", "t5-base", "t5-v1_1-small", "t5-v1_1-base"])
def test_the_presets_count_the_parameters_of_the_transformers_model(preset):
    """Counted on the meta device (no memory), v1.1's head of its own as its published checkpoints hold it."""
    model_type, values = create_config.PRESETS[preset]
    config = transformers.T5Config(**values)
    create_config.check_config(config, preset)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
        if not t5.scales_output(config):
            model.lm_head.weight = torch.nn.Parameter(torch.empty(config.vocab_size, config.d_model))
    assert create_config.count_parameters(config) == sum(parameter.numel() for parameter in model.parameters())
    if preset == "t5-v1_1-small":  # google/t5-v1_1-small's weights
        assert create_config.count_parameters(config) == 76_961_152


def test_greedy_decoding_equals_generate_for_a_batch_of_sources_of_different_lengths():
    """Weights drawn wide, so that the tokens vary; the end-of-text id one that two rows write."""
    config = t5_config(**VARIANTS["v1.1 gated-gelu untied"], eos_token_id=7, initializer_factor=3.0)
    model = t5.MODEL_CLASS(config)
    params = random_params(model, config, seed=2)
    rng = np.random.default_rng(3)
    sources = [rng.integers(6, config.vocab_size, length).tolist() + [5] for length in (11, 4, 7)]
    generate = make_seq2seq_generate(model, config.eos_token_id)
    ours = generate_seq2seq_ids(generate, params, sources, config.vocab_size, max_new_tokens=12)

    torch_model = torch_model_of(config, params)
    input_ids = np.zeros((len(sources), max(map(len, sources))), np.int64)  # right-padded, as a tokenizer pads
    for row, source in enumerate(sources):
        input_ids[row, : len(source)] = source
    with torch.no_grad():
        output = torch_model.generate(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy((input_ids > 0).astype(np.int64)),
            do_sample=False,
            max_new_tokens=12,
            decoder_start_token_id=0,
            pad_token_id=0,
        ).numpy()
    for row, tokens in enumerate(ours):
        expected = output[row, 1:].tolist()  # after the decoder start token
        if 7 in expected:
            expected = expected[: expected.index(7) + 1]
        assert tokens == expected
    assert [len(tokens) for tokens in ours] == [5, 5, 12] and len(set(ours[0])) > 2


def test_beam_search_equals_generate_with_its_length_penalty_and_early_stopping():
    """Three beams, a length penalty below 1 (shorter hypotheses favoured) and transformers' default early stopping
    (false: the search ends once no running beam is likely to beat the finished ones), on sources of different
    lengths; the beams write other tokens than greedy decoding does for some source."""
    config = t5_config(**VARIANTS["original relu tied"], eos_token_id=7, initializer_factor=3.0)
    model = t5.MODEL_CLASS(config)
    params = random_params(model, config, seed=4)
    rng = np.random.default_rng(5)
    sources = [rng.integers(8, config.vocab_size, length).tolist() + [1] for length in (9, 3, 6)]
    decoding = make_seq2seq_generate(model, config.eos_token_id)
    beams = [Sampling(12, prompt_index=row, num_beams=3, length_penalty=0.7) for row in range(len(sources))]
    ours = decode_sources(decoding, params, sources, beams, config.vocab_size)
    greedy = generate_seq2seq_ids(decoding, params, sources, config.vocab_size, max_new_tokens=12)

    input_ids = np.zeros((len(sources), max(map(len, sources))), np.int64)
    for row, source in enumerate(sources):
        input_ids[row, : len(source)] = source
    with torch.no_grad():
        output = (
            torch_model_of(config, params)
            .generate(
                input_ids=torch.from_numpy(input_ids),
                attention_mask=torch.from_numpy((input_ids > 0).astype(np.int64)),
                do_sample=False,
                num_beams=3,
                length_penalty=0.7,
                early_stopping=False,
                max_new_tokens=12,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
            .numpy()
        )
    for row, tokens in enumerate(ours):
        expected = output[row, 1:].tolist()  # after the decoder start token
        expected = expected[: expected.index(7) + 1] if 7 in expected else expected
        assert tokens == expected
    assert ours != greedy
