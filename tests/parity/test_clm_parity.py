"""run_clm_flax.py's models against transformers' PyTorch models: weights both ways with the same logits, the scaled
initialisation of residual projections, the token-weighted loss, and document attention scoring each packed document
as if it were alone, family by family."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from conftest import stock_code
from test_clm import (
    abstract_params,
    flax_logits,
    run_clm_flax,
    tiny_config,
    tiny_gpt2_dir_of_512_tokens,
    tiny_llama_config,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    GPT2LMHeadModel,
    MistralConfig,
)

from flax_lm.models import stock_module
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.huggingface import save_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tokenizer of 512 tokens and a tiny GPT-2 config, as test_clm.py's."""
    return tiny_gpt2_dir_of_512_tokens(tmp_path_factory.mktemp("tiny-gpt2"))


CONFIG_VARIANTS = {
    "default": {},
    "untied-scaled-relu": dict(
        tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True, activation_function="relu", n_inner=48
    ),
}


@pytest.mark.parametrize("variant", CONFIG_VARIANTS)
def test_pytorch_weights_give_the_same_logits_in_flax(variant):
    config = tiny_config(**CONFIG_VARIANTS[variant])
    torch.manual_seed(0)
    torch_model = GPT2LMHeadModel(config).eval()
    input_ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(3, 20))
    with torch.no_grad():
        expected = torch_model(torch.tensor(input_ids)).logits.numpy()
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    params = gpt2.from_hf_state_dict(state_dict, abstract_params(config))
    np.testing.assert_allclose(flax_logits(config, params, input_ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", CONFIG_VARIANTS)
def test_flax_weights_load_in_pytorch_with_the_same_logits(variant, model_dir, tmp_path):
    config = tiny_config(**CONFIG_VARIANTS[variant])
    model = gpt2.FlaxGPT2LMHeadModel(config)
    params = jax.tree_util.tree_map(
        np.asarray, run_clm_flax.nn.meta.unbox(model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"])
    )
    save_model(str(tmp_path), params, config, AutoTokenizer.from_pretrained(model_dir), stock_code(config))

    torch_model, loading_info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(loading_info.values()), loading_info
    input_ids = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 24))
    with torch.no_grad():
        expected = torch_model.eval()(torch.tensor(input_ids)).logits.numpy()
    np.testing.assert_allclose(flax_logits(config, params, input_ids), expected, atol=1e-4, rtol=0)


def test_residual_projections_get_the_scaled_initialisation():
    config = tiny_config(n_embd=64, n_layer=8, n_head=2, initializer_range=0.02)
    model = gpt2.FlaxGPT2LMHeadModel(config)
    params = run_clm_flax.nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    block = params["transformer"]["h_0"]
    scaled = 0.02 / np.sqrt(2 * config.n_layer)
    assert np.std(block["attn"]["c_attn"]["kernel"]) == pytest.approx(0.02, rel=0.1)
    assert np.std(block["attn"]["c_proj"]["kernel"]) == pytest.approx(scaled, rel=0.1)
    assert np.std(block["mlp"]["c_proj"]["kernel"]) == pytest.approx(scaled, rel=0.1)
    assert not np.any(block["attn"]["c_attn"]["bias"])


def test_checkpoint_of_another_shape_is_refused_with_the_tensor_named():
    torch_model = GPT2LMHeadModel(tiny_config(n_embd=64))
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    with pytest.raises(
        run_clm_flax.UsageError, match=r"checkpoint tensor transformer\..* has shape .* but the config needs"
    ):
        gpt2.from_hf_state_dict(state_dict, abstract_params(tiny_config()))


def test_loss_is_token_weighted_cross_entropy_of_the_next_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 11)).astype(np.float32)
    input_ids = rng.integers(0, 11, size=(2, 6))
    weights = np.array([[1.0] * 6, [0.0] * 6], dtype=np.float32)  # the second row is padding
    sums = run_clm_flax.causal_lm_loss_sums(jnp.asarray(logits), jnp.asarray(input_ids), jnp.asarray(weights))
    expected = torch.nn.functional.cross_entropy(
        torch.tensor(logits[0, :-1]), torch.tensor(input_ids[0, 1:]), reduction="sum"
    ).item()
    assert sums.keys() == {"loss_sum", "token_count"}
    assert float(sums["token_count"]) == 5
    assert float(sums["loss_sum"]) == pytest.approx(expected, rel=1e-5)
    # The training objective, unedited: the same sums; with the z-loss also the coefficient times the squared
    # log-normalizer of each predicted token, the cross-entropy unchanged.
    objective = run_clm_flax.causal_lm_objective(jnp.asarray(logits), jnp.asarray(input_ids), jnp.asarray(weights))
    assert {name: float(value) for name, value in objective.items()} == {
        name: float(value) for name, value in sums.items()
    }
    with_z_loss = run_clm_flax.causal_lm_objective(
        jnp.asarray(logits), jnp.asarray(input_ids), jnp.asarray(weights), z_loss=0.01
    )
    log_normalizers = torch.logsumexp(torch.tensor(logits[0, :-1], dtype=torch.float64), dim=-1)
    assert float(with_z_loss["z_loss_sum"]) == pytest.approx(0.01 * float(torch.sum(log_normalizers**2)), rel=1e-5)
    assert float(with_z_loss["loss_sum"]) == float(sums["loss_sum"])


def per_token_losses(model, params, input_ids, deterministic=True, rngs=None):
    """The loss of each next-token prediction of each row, (rows, length - 1)."""
    logits = model.apply({"params": params}, jnp.asarray(input_ids), deterministic=deterministic, rngs=rngs)
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], jnp.asarray(input_ids)[:, 1:]))


# Each model type's documents as run_clm_flax.py frames them (ids_around_documents), and the token that starts a
# document for --document_attention: GPT-2's text EOS, the EOS starting the next; Llama's BOS text EOS, at its BOS.
TINY_DECODER_SHAPES = dict(
    vocab_size=512, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, intermediate_size=64, bos_token_id=0, eos_token_id=1,
)  # fmt: skip


# Mistral and Gemma 2 with sliding windows shorter than a document: the window slides within each document.
def bos_framing(config):
    return [config.bos_token_id], [config.eos_token_id], config.bos_token_id


DOCUMENT_FRAMING = {
    "gpt2": (tiny_config, lambda config: ([], [config.eos_token_id], config.eos_token_id)),
    "llama": (tiny_llama_config, bos_framing),
    "mistral": (lambda: MistralConfig(**TINY_DECODER_SHAPES, sliding_window=6), bos_framing),
    "gemma2": (lambda: Gemma2Config(**TINY_DECODER_SHAPES, head_dim=16, sliding_window=6), bos_framing),
    # GPT-2's block options, a window on its first layer.
    "gpt2 with block options": (
        lambda: tiny_config(
            qk_norm=True,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
        ),  # fmt: skip
        lambda config: ([], [config.eos_token_id], config.eos_token_id),
    ),
}


@pytest.mark.parametrize("model_type", DOCUMENT_FRAMING)
def test_document_attention_scores_each_packed_document_as_if_alone(model_type):
    make_config, framing = DOCUMENT_FRAMING[model_type]
    config = make_config()
    before, after, separator = framing(config)
    model_class = stock_module(config.model_type).MODEL_CLASS
    plain, documents = model_class(config), model_class(config, document_separator_id=separator)
    rng = np.random.default_rng(0)
    params = plain.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    first, second, third = (list(rng.integers(2, 512, size)) for size in (11, 17, 9))
    block = first + after + before + second + after + before + third  # the first document began in an earlier block
    packed = per_token_losses(documents, params, [block])[0]
    # Each document alone, from the separator that starts it, with the prediction of the next one's separator: its
    # predictions are those of the block.
    starts = [0] + [index for index, token in enumerate(block) if token == separator and index > 0] + [len(block)]
    pieces = [block[start : end + 1] for start, end in zip(starts, starts[1:])]
    alone = np.concatenate([per_token_losses(plain, params, [piece])[0] for piece in pieces])
    np.testing.assert_allclose(packed, alone, atol=1e-5)
    assert abs(packed.mean() - alone.mean()) < 1e-5
    assert np.abs(per_token_losses(plain, params, [block])[0] - alone).max() > 1e-3  # without: not the same
    # A block of one document: the same as without the flag.
    one_document = [first + second]
    np.testing.assert_allclose(
        per_token_losses(documents, params, one_document), per_token_losses(plain, params, one_document), atol=1e-6
    )


def test_document_attention_of_one_document_draws_the_attention_dropout_of_none():
    config, eos = tiny_config(attn_pdrop=0.5), 0
    plain = gpt2.FlaxGPT2LMHeadModel(config)
    params = plain.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    one_document = [list(np.random.default_rng(0).integers(1, 512, 28))]
    rngs = {"dropout": jax.random.key(1)}
    with_dropout = [
        per_token_losses(model, params, one_document, deterministic=False, rngs=rngs)
        for model in (gpt2.FlaxGPT2LMHeadModel(config, document_separator_id=eos), plain)
    ]
    np.testing.assert_allclose(with_dropout[0], with_dropout[1], atol=1e-6)
