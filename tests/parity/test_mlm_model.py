"""The Flax RoBERTa (flax_lm.models.roberta) against PyTorch RobertaForMaskedLM of transformers; masking and loss."""

import sys
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from conftest import REPO_DIR
from safetensors.numpy import save_file

from flax_lm.models.roberta import model as roberta
from flax_lm.models.shared.common import segments_and_positions
from flax_lm.training.train_state import abstract_model_params, abstract_train_state, create_train_state

sys.path.insert(0, str(REPO_DIR))
import run_mlm_flax  # noqa: E402

VOCAB_SIZE = 101
PAD, BOS, EOS, MASK = 1, 0, 2, 100


def tiny_config(**overrides):
    settings = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=40,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        type_vocab_size=2,
    )
    settings.update(overrides)
    return transformers.RobertaConfig(**settings)


def example_batch(padded):
    """(input_ids, attention_mask), int32 (3, 12); with padded=True two rows are right-padded."""
    rng = np.random.default_rng(0)
    input_ids = rng.integers(3, VOCAB_SIZE, (3, 12)).astype(np.int32)
    input_ids[:, 0] = BOS
    lengths = [12, 7, 4] if padded else [12, 12, 12]
    attention_mask = np.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, length - 1] = EOS
        input_ids[row, length:] = PAD
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def torch_logits(torch_model, input_ids, attention_mask):
    with torch.no_grad():
        output = torch_model(
            input_ids=torch.from_numpy(input_ids).long(), attention_mask=torch.from_numpy(attention_mask).long()
        )
    return output.logits.numpy()


def abstract_params(config):
    """The shapes of the tiny RoBERTa's parameters, as from_hf_state_dict takes them."""
    return abstract_model_params(roberta.FlaxRobertaForMaskedLM(config), jnp.zeros((1, 1), jnp.int32))


@pytest.fixture(scope="module")
def tiny_flax():
    """(model, unboxed params, jitted model.apply); jitted because eager Flax is slow on a small CPU."""
    model = roberta.FlaxRobertaForMaskedLM(tiny_config())
    variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))
    return model, nn.meta.unbox(variables)["params"], jax.jit(model.apply, static_argnames="deterministic")


def perturbed(params, scale=0.1):
    """params plus noise, so that zero biases and unit LayerNorm scales also test the mapping."""
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map(lambda leaf: leaf + scale * rng.standard_normal(leaf.shape, np.float32), params)


@pytest.fixture(scope="module")
def torch_roberta():
    """(a PyTorch RobertaForMaskedLM of the tiny config, its parameters read by from_hf_state_dict)."""
    config = tiny_config()
    torch.manual_seed(0)
    torch_model = transformers.RobertaForMaskedLM(config).eval()
    with torch.no_grad():  # biases and LayerNorms start at 0/1; make them random so a wrong mapping shows
        for name, tensor in torch_model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    return torch_model, roberta.from_hf_state_dict(state_dict, abstract_params(config))


@pytest.mark.parametrize("padded", [False, True])
def test_logits_match_pytorch_after_loading_a_pytorch_state_dict(tiny_flax, torch_roberta, padded):
    _, _, apply = tiny_flax
    torch_model, params = torch_roberta
    input_ids, attention_mask = example_batch(padded)
    flax_logits = apply({"params": params}, input_ids, attention_mask)
    assert flax_logits.shape == (3, 12, VOCAB_SIZE)
    np.testing.assert_allclose(flax_logits, torch_logits(torch_model, input_ids, attention_mask), atol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_exported_checkpoint_loads_in_transformers_with_the_same_logits(tiny_flax, tmp_path, padded):
    _, params, apply = tiny_flax
    params = perturbed(params)
    config = tiny_config()
    save_file(roberta.to_hf_state_dict(params), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    torch_model, loading_info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(torch_model) is transformers.RobertaForMaskedLM
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"]
    assert not loading_info["mismatched_keys"]

    input_ids, attention_mask = example_batch(padded)
    flax_logits = apply({"params": params}, input_ids, attention_mask)
    np.testing.assert_allclose(flax_logits, torch_logits(torch_model.eval(), input_ids, attention_mask), atol=1e-4)


def test_logits_at_masked_positions_equal_those_of_the_whole_sequence(tiny_flax):
    _, params, apply = tiny_flax
    params = perturbed(params)
    input_ids, attention_mask = example_batch(padded=True)
    masked_positions = np.array([[1, 5, 11], [2, 3, 0], [1, 1, 2]], np.int32)  # (batch, predictions)
    at_positions = apply({"params": params}, input_ids, attention_mask, masked_positions=masked_positions)
    everywhere = apply({"params": params}, input_ids, attention_mask)
    assert at_positions.shape == (3, 3, VOCAB_SIZE)
    np.testing.assert_allclose(
        at_positions, np.take_along_axis(everywhere, masked_positions[:, :, None], axis=1), atol=1e-5
    )


def random_documents():
    rng = np.random.default_rng(2)
    return [list(rng.integers(3, MASK, size)) for size in (7, 11, 5)]


def packed(documents):
    """The documents as run_mlm_flax.py packs texts into a block: joined with </s>, framed as <s> ... </s>."""
    return [BOS, *documents[0], *(token for document in documents[1:] for token in (EOS, *document)), EOS]


def test_document_attention_scores_each_packed_document_as_if_alone(tiny_flax):
    _, params, apply = tiny_flax
    params = perturbed(params)
    first, second, third = random_documents()
    second[3] = PAD  # a random replacement can be the padding token, which RoBERTa gives no position
    block = packed([first, second, third])
    input_ids = np.array([block + [PAD] * 3], np.int32)  # and padding after the block, which is not attended to
    attention_mask = np.array([[1] * len(block) + [0] * 3], np.int32)
    documents = roberta.FlaxRobertaForMaskedLM(tiny_config(), document_separator_id=EOS)
    together = jax.jit(documents.apply)({"params": params}, input_ids, attention_mask)[0, : len(block)]
    # Each document alone, led by the separator before it (the first by <s>), and the closing </s> alone.
    pieces = [[BOS, *first], [EOS, *second], [EOS, *third], [EOS]]
    alone = np.concatenate([apply({"params": params}, np.array([piece], np.int32))[0] for piece in pieces])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    without = apply({"params": params}, input_ids, attention_mask)[0, : len(block)]
    assert np.abs(without - alone).max() > 1e-2  # without document attention the documents see each other


def test_document_attention_keeps_documents_apart_in_training_with_dropout(tiny_flax):
    _, params, _ = tiny_flax
    first, second, third = random_documents()
    block = packed([first, second, third])
    other = packed([[50] * len(first), second, third])  # another first document of the same length
    later = slice(1 + len(first), None)  # the documents after it, from its separator on
    config = tiny_config(attention_probs_dropout_prob=0.5)

    def logits(separator_id, input_ids):
        model = roberta.FlaxRobertaForMaskedLM(config, document_separator_id=separator_id)
        rngs = {"dropout": jax.random.key(3)}  # the same dropout masks for the same shapes
        return model.apply({"params": params}, np.array([input_ids]), deterministic=False, rngs=rngs)[0, later]

    np.testing.assert_array_equal(logits(EOS, block), logits(EOS, other))
    assert not np.allclose(logits(None, block), logits(None, other), atol=1e-3)


def test_without_document_attention_a_packed_block_is_one_sequence_as_in_pytorch(tiny_flax, torch_roberta):
    _, _, apply = tiny_flax
    torch_model, params = torch_roberta
    input_ids = np.array([packed(random_documents())], np.int32)
    attention_mask = np.ones_like(input_ids)
    flax_logits = apply({"params": params}, input_ids, attention_mask)
    np.testing.assert_allclose(flax_logits, torch_logits(torch_model, input_ids, attention_mask), atol=1e-4)


def test_positions_restart_at_each_separator_and_count_no_padding():
    input_ids = jnp.array([[BOS, 5, 6, EOS, 7, PAD, 8, EOS, PAD, PAD]])
    segment_ids, tokens_before = segments_and_positions(input_ids, EOS, counted=input_ids != PAD)
    assert segment_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    assert tokens_before.tolist() == [[0, 1, 2, 0, 1, 2, 2, 0, 1, 1]]


def test_gradient_checkpointing_recomputes_layers_with_the_same_parameters_and_logits(tiny_flax):
    _, params, apply = tiny_flax
    input_ids, attention_mask = example_batch(padded=True)
    remat_model = roberta.FlaxRobertaForMaskedLM(tiny_config(), remat_policy="nothing_saveable")
    remat_shapes = abstract_model_params(remat_model, jnp.ones((1, 4), jnp.int32))
    assert jax.tree_util.tree_structure(remat_shapes) == jax.tree_util.tree_structure(params)

    def loss(model, params):
        return jnp.mean(model.apply({"params": params}, input_ids, attention_mask))

    plain_model = roberta.FlaxRobertaForMaskedLM(tiny_config())
    assert "remat" in str(jax.make_jaxpr(jax.grad(partial(loss, remat_model)))(params))
    assert "remat" not in str(jax.make_jaxpr(jax.grad(partial(loss, plain_model)))(params))
    remat_logits = jax.jit(remat_model.apply)({"params": params}, input_ids, attention_mask)
    np.testing.assert_allclose(remat_logits, apply({"params": params}, input_ids, attention_mask), atol=1e-6)


def test_export_has_exactly_the_tensors_save_pretrained_writes(tiny_flax):
    _, params, _ = tiny_flax
    config = tiny_config()
    state_dict = roberta.to_hf_state_dict(params)
    torch_state_dict = transformers.RobertaForMaskedLM(config).state_dict()
    tied = {"lm_head.decoder.weight", "lm_head.decoder.bias"}
    assert set(state_dict) == set(torch_state_dict) - tied
    for name, array in state_dict.items():
        assert array.dtype == np.float32 and array.flags["C_CONTIGUOUS"]
        assert array.shape == tuple(torch_state_dict[name].shape), name


def test_conversion_round_trip_is_exact(tiny_flax):
    _, params, _ = tiny_flax
    config = tiny_config()
    loaded = roberta.from_hf_state_dict(roberta.to_hf_state_dict(params), abstract_params(config))
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)
    for original, reloaded in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded)):
        np.testing.assert_array_equal(original, reloaded)


def test_init_follows_huggingface(tiny_flax):
    _, params, _ = tiny_flax
    embeddings = params["roberta"]["embeddings"]
    np.testing.assert_array_equal(embeddings["word_embeddings"]["embedding"][PAD], 0)
    np.testing.assert_array_equal(embeddings["position_embeddings"]["embedding"][PAD], 0)
    query_kernel = params["roberta"]["encoder"]["layer_0"]["attention"]["self"]["query"]["kernel"]
    assert abs(float(jnp.std(query_kernel)) - tiny_config().initializer_range) < 0.003
    np.testing.assert_array_equal(params["roberta"]["encoder"]["layer_0"]["intermediate"]["dense"]["bias"], 0)
    np.testing.assert_array_equal(params["lm_head"]["bias"], 0)
    np.testing.assert_array_equal(params["lm_head"]["layer_norm"]["scale"], 1)


def test_params_carry_logical_axis_names():
    model = roberta.FlaxRobertaForMaskedLM(tiny_config())
    boxed_params = abstract_model_params(model, jnp.ones((1, 4), jnp.int32), unbox=False)
    names = jax.tree_util.tree_map(tuple, nn.get_partition_spec(boxed_params))
    assert names["roberta"]["embeddings"]["word_embeddings"]["embedding"] == ("vocab", "embed")
    layer = names["roberta"]["encoder"]["layer_1"]
    assert layer["attention"]["self"]["key"]["kernel"] == ("embed", "heads")
    assert layer["output"]["dense"]["kernel"] == ("mlp", "embed")
    assert names["lm_head"]["bias"] == ("vocab",)


def test_dropout_is_active_only_when_not_deterministic(tiny_flax):
    _, params, apply = tiny_flax
    input_ids, attention_mask = example_batch(padded=True)

    def run(deterministic, seed):
        return apply(
            {"params": params},
            input_ids,
            attention_mask,
            deterministic=deterministic,
            rngs={"dropout": jax.random.key(seed)},
        )

    np.testing.assert_array_equal(run(True, 1), run(True, 2))
    np.testing.assert_array_equal(run(True, 1), apply({"params": params}, input_ids, attention_mask))
    assert not np.allclose(run(False, 1), run(False, 2))
    np.testing.assert_array_equal(run(False, 1), run(False, 1))


def test_attention_dropout_alone_changes_the_output(tiny_flax):
    _, params, _ = tiny_flax
    model = roberta.FlaxRobertaForMaskedLM(tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.1))
    apply = jax.jit(model.apply, static_argnames="deterministic")
    input_ids, attention_mask = example_batch(padded=True)

    def run(seed):
        return apply(
            {"params": params}, input_ids, attention_mask, deterministic=False, rngs={"dropout": jax.random.key(seed)}
        )

    assert not np.allclose(run(1), run(2))


def test_explicit_attention_equals_library_attention_without_dropout():
    q, k, v = np.random.default_rng(0).standard_normal((3, 2, 7, 4, 8), np.float32)  # (batch, seq, heads, dim)
    mask = np.array([[1] * 7, [1] * 5 + [0] * 2], bool)[:, None, None, :]
    explicit = jax.jit(roberta.attention, static_argnums=4)(q, k, v, mask, lambda probs: probs)
    library = jax.jit(jax.nn.dot_product_attention)(q, k, v, mask=mask)
    np.testing.assert_allclose(explicit, library, atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits(tiny_flax):
    _, params, apply_fp32 = tiny_flax
    params = perturbed(params)  # logits of a few units rather than hundredths, so the tolerance means something
    model_bf16 = roberta.FlaxRobertaForMaskedLM(tiny_config(), dtype=jnp.bfloat16)
    shapes = abstract_model_params(model_bf16, jnp.ones((1, 4), jnp.int32))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(shapes))

    input_ids, attention_mask = example_batch(padded=True)
    logits_bf16 = jax.jit(model_bf16.apply)({"params": params}, input_ids, attention_mask)
    logits_fp32 = apply_fp32({"params": params}, input_ids, attention_mask)
    assert logits_bf16.dtype == jnp.float32
    error = float(jnp.abs(logits_bf16 - logits_fp32).max())
    assert 0 < error < 0.03 * float(jnp.abs(logits_fp32).max())  # bfloat16 was used, and stayed accurate


def test_wrong_shaped_checkpoint_is_a_usage_error_naming_the_tensor(tiny_flax):
    _, params, _ = tiny_flax
    config = tiny_config()
    state_dict = roberta.to_hf_state_dict(params)
    state_dict["roberta.embeddings.word_embeddings.weight"] = np.zeros((120, 64), np.float32)
    with pytest.raises(
        run_mlm_flax.UsageError,
        match=r"roberta\.embeddings\.word_embeddings\.weight has shape "
        r"\(120, 64\) but the config needs \(101, 64\)",
    ):
        roberta.from_hf_state_dict(state_dict, abstract_params(config))


def test_checkpoint_with_missing_or_extra_tensors_is_a_usage_error(tiny_flax):
    _, params, _ = tiny_flax
    config = tiny_config()
    state_dict = roberta.to_hf_state_dict(params)
    state_dict["roberta.pooler.dense.weight"] = np.zeros((64, 64), np.float32)  # ignored, as in HF
    state_dict["lm_head.decoder.weight"] = state_dict["roberta.embeddings.word_embeddings.weight"]  # tied
    roberta.from_hf_state_dict(state_dict, abstract_params(config))

    extra_layer = dict(state_dict, **{"roberta.encoder.layer.2.output.dense.bias": np.zeros(64, np.float32)})
    with pytest.raises(run_mlm_flax.UsageError, match=r"layer\.2\.output\.dense\.bias is not part of"):
        roberta.from_hf_state_dict(extra_layer, abstract_params(config))
    del state_dict["lm_head.dense.weight"]
    with pytest.raises(run_mlm_flax.UsageError, match=r"no tensor lm_head\.dense\.weight"):
        roberta.from_hf_state_dict(state_dict, abstract_params(config))


def test_unsupported_config_is_a_usage_error():
    dummy_ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(run_mlm_flax.UsageError, match="is_decoder"):
        roberta.FlaxRobertaForMaskedLM(tiny_config(is_decoder=True)).init(jax.random.key(0), dummy_ids)
    with pytest.raises(run_mlm_flax.UsageError, match="position_embedding_type"):
        roberta.check_model_config(tiny_config(position_embedding_type="relative_key"))


def make_masking_inputs():
    rng = np.random.default_rng(123)
    input_ids = rng.integers(3, MASK, (400, 500)).astype(np.int32)  # 200k positions, no special ids
    special_tokens_mask = np.zeros(input_ids.shape, bool)
    special_tokens_mask[:, 0] = special_tokens_mask[:, -1] = True  # <s> and </s>
    special_tokens_mask[::2, 400:] = True  # padding on every other row
    return input_ids, special_tokens_mask


def test_mask_tokens_chooses_mlm_probability_and_splits_80_10_10():
    input_ids, special_tokens_mask = make_masking_inputs()
    masked, labels, weights = run_mlm_flax.mask_tokens(
        input_ids, special_tokens_mask, MASK, VOCAB_SIZE, 0.15, seed=0, row_numbers=np.arange(len(input_ids))
    )
    chosen = weights == 1.0
    np.testing.assert_array_equal(labels, input_ids)
    assert weights.dtype == np.float32 and set(np.unique(weights)) <= {0.0, 1.0}
    assert not chosen[special_tokens_mask].any()
    assert abs(chosen.sum() / (~special_tokens_mask).sum() - 0.15) < 0.01
    np.testing.assert_array_equal(masked[~chosen], input_ids[~chosen])

    to_mask = masked[chosen] == MASK
    unchanged = masked[chosen] == input_ids[chosen]
    randomized = ~to_mask & ~unchanged
    assert abs(to_mask.mean() - 0.8) < 0.02
    # A random replacement can draw the original id (1 time in VOCAB_SIZE); that counts as unchanged.
    assert abs(unchanged.mean() - (0.1 + 0.1 / VOCAB_SIZE)) < 0.02
    assert abs(randomized.mean() - 0.1 * (1 - 1 / VOCAB_SIZE)) < 0.02
    assert masked.dtype == input_ids.dtype and masked.min() >= 0 and masked.max() < VOCAB_SIZE


def test_mask_tokens_is_reproducible_from_the_seed():
    input_ids, special_tokens_mask = make_masking_inputs()

    def mask(seed):
        return run_mlm_flax.mask_tokens(
            input_ids, special_tokens_mask, MASK, VOCAB_SIZE, 0.15, seed=seed, row_numbers=np.arange(len(input_ids))
        )

    for first, second in zip(mask(7), mask(7)):
        np.testing.assert_array_equal(first, second)
    assert not np.array_equal(mask(7)[0], mask(8)[0])


def test_a_row_is_masked_by_its_number_whatever_rows_are_masked_with_it():
    input_ids, special_tokens_mask = make_masking_inputs()
    rows = np.arange(400)
    whole = run_mlm_flax.mask_tokens(input_ids, special_tokens_mask, MASK, VOCAB_SIZE, 0.15, (7, 1), rows)
    part = run_mlm_flax.mask_tokens(
        input_ids[100:200], special_tokens_mask[100:200], MASK, VOCAB_SIZE, 0.15, (7, 1), rows[100:200]
    )
    for whole_result, part_result in zip(whole, part):
        np.testing.assert_array_equal(whole_result[100:200], part_result)
    # Rows of equal tokens but other numbers are masked differently.
    shifted = run_mlm_flax.mask_tokens(
        input_ids[100:200], special_tokens_mask[100:200], MASK, VOCAB_SIZE, 0.15, (7, 1), rows[:100]
    )
    assert not np.array_equal(shifted[2], part[2])


def test_a_row_with_more_chosen_positions_than_allowed_keeps_a_random_subset_of_them():
    input_ids, special_tokens_mask = make_masking_inputs()

    def chosen(max_chosen_per_row=None):
        weights = run_mlm_flax.mask_tokens(
            input_ids, special_tokens_mask, MASK, VOCAB_SIZE, 0.15, 3, np.arange(400), max_chosen_per_row
        )[2]
        return weights == 1.0

    unlimited, limited = chosen(), chosen(max_chosen_per_row=60)
    crowded = unlimited.sum(axis=1) > 60
    assert 50 < crowded.sum() < 350, "the test needs rows on both sides of the limit"
    np.testing.assert_array_equal(limited[~crowded], unlimited[~crowded])
    assert (limited[crowded].sum(axis=1) == 60).all() and not (limited & ~unlimited).any()
    # A random subset, not the first 60: kept positions reach as far along the rows as the chosen ones.
    last_kept = [np.flatnonzero(row).max() for row in limited[crowded]]
    last_chosen = [np.flatnonzero(row).max() for row in unlimited[crowded]]
    assert np.mean(last_kept) > 0.9 * np.mean(last_chosen)


def test_masked_lm_loss_sums_equal_torch_cross_entropy_over_chosen_positions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 9, VOCAB_SIZE)).astype(np.float32) * 3
    labels = rng.integers(0, VOCAB_SIZE, (4, 9))
    labels[0, :3] = logits[0, :3].argmax(-1)  # a few correct predictions
    weights = (rng.random((4, 9)) < 0.3).astype(np.float32)
    weights[0, :3] = 1.0

    loss_sum, correct_sum, weight_sum = run_mlm_flax.masked_lm_loss_sums(jnp.asarray(logits), labels, weights)
    chosen = weights == 1.0
    reference = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits[chosen]), torch.from_numpy(labels[chosen]), reduction="sum"
    )
    assert loss_sum.dtype == correct_sum.dtype == weight_sum.dtype == jnp.float32
    np.testing.assert_allclose(loss_sum, reference.item(), rtol=1e-5)
    assert weight_sum == chosen.sum()
    assert correct_sum == (logits.argmax(-1) == labels)[chosen].sum()


def test_an_edit_of_the_training_objective_leaves_the_evaluation_metrics_as_they_were(monkeypatch):
    config = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=1)
    model = roberta.FlaxRobertaForMaskedLM(config)
    training_args = run_mlm_flax.TrainingArguments(output_dir="unused")
    schedule = run_mlm_flax.learning_rate_schedule(training_args.optimizer_settings(), total_steps=10)
    optimizer = run_mlm_flax.create_optimizer(training_args.optimizer_settings(), schedule)
    dummy_input = jnp.ones((1, 12), jnp.int32)
    abstract_state = abstract_train_state(model, optimizer, run_mlm_flax.create_mesh(), dummy_input)
    state = create_train_state(model, optimizer, abstract_state, 0, dummy_input)
    input_ids, _ = example_batch(padded=False)
    batch = {
        "input_ids": input_ids,
        "attention_mask": np.ones_like(input_ids),
        "masked_positions": np.tile(np.array([1, 4, 6], np.int32), (len(input_ids), 1)),
        "masked_labels": input_ids[:, [1, 4, 6]],
        "masked_weights": np.ones((len(input_ids), 3), np.float32),
    }

    def evaluation():
        sums = jax.jit(run_mlm_flax.make_eval_step(model))(state.params, batch)
        return run_mlm_flax.evaluation_results(jax.device_get(sums))

    def label_smoothed_objective(logits, labels, label_weights):  # as a copy edited for label smoothing has it
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), 0.1)
        return jnp.sum(optax.softmax_cross_entropy(logits.astype(jnp.float32), targets) * label_weights)

    evaluated = evaluation()
    monkeypatch.setattr(run_mlm_flax, "masked_lm_objective", label_smoothed_objective)
    assert evaluation() == evaluated  # loss, perplexity and accuracy, bit for bit
    train_step = jax.jit(run_mlm_flax.make_train_step(model, optimizer, schedule, seed=0))
    _, metrics = train_step(state, {name: values[None] for name, values in batch.items()})
    assert float(metrics["loss_sum"]) / (3 * len(input_ids)) != pytest.approx(evaluated["loss"], rel=1e-5)
    assert float(metrics["weight_sum"]) == 3 * len(input_ids)


def test_bfloat16_parameters_and_optimizer_state_stay_bfloat16_through_a_step():
    micro_batches = 2  # the accumulation path: float32 sums, then the division shared with the single-batch path
    model = roberta.FlaxRobertaForMaskedLM(tiny_config(), param_dtype=jnp.bfloat16)
    training_args = run_mlm_flax.TrainingArguments(output_dir="unused")
    schedule = run_mlm_flax.learning_rate_schedule(training_args.optimizer_settings(), total_steps=10)
    optimizer = run_mlm_flax.create_optimizer(training_args.optimizer_settings(), schedule)
    dummy_input = jnp.ones((1, 12), jnp.int32)
    abstract_state = abstract_train_state(model, optimizer, run_mlm_flax.create_mesh(), dummy_input)
    state = create_train_state(model, optimizer, abstract_state, 0, dummy_input)
    input_ids, attention_mask = example_batch(padded=False)
    rows = np.concatenate([input_ids, input_ids[:1]])  # 4 rows, split into micro-batches
    batch = {
        "input_ids": rows,
        "attention_mask": np.ones_like(rows),
        "masked_positions": np.tile(np.array([1, 4, 6], np.int32), (4, 1)),
        "masked_labels": rows[:, [1, 4, 6]],
        "masked_weights": np.ones((4, 3), np.float32),
    }
    batch = {name: values.reshape(micro_batches, -1, *values.shape[1:]) for name, values in batch.items()}

    def float_dtypes(tree):
        return {
            str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)
        }

    assert float_dtypes(state.params) == float_dtypes(state.opt_state) == {"bfloat16"}
    new_state, metrics = jax.jit(run_mlm_flax.make_train_step(model, optimizer, schedule, seed=0))(state, batch)
    # A float32 leaf after the step would mean more memory than asked for, and a recompilation at the next step.
    assert float_dtypes(new_state.params) == float_dtypes(new_state.opt_state) == {"bfloat16"}
    assert np.isfinite(float(metrics["loss_sum"])) and float(metrics["weight_sum"]) == 12
