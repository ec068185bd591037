"""The mixture-of-experts layer and families (flax_lm/models/shared/moe.py, mixtral/, qwen_moe/, olmoe/) against
transformers: the dropless experts equal the all-experts dense formulation, gradients included; the load-balancing
loss equals transformers' load_balancing_loss_func; each family's logits equal its transformers class's on every route
(no cache, prefilled cache, one token at a time) with its checkpoint read as save_pretrained writes it; greedy
left-padded decoding equals generate; the export is that layout (which transformers 4 and 5 load); the training
objective adds the aux loss as transformers does; the published presets have the published parameter counts; bad
routing is refused."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from test_models import random_torch_model
from test_scaling import training_parts
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import run_clm_flax
from flax_lm.errors import UsageError
from flax_lm.generation.sampling import generate_ids, make_sampler
from flax_lm.models import config_class, model_code, presets, stock_module
from flax_lm.models.shared import moe
from flax_lm.models.shared.moe_decoder import parameter_counts
from flax_lm.training.train_state import abstract_model_params, create_train_state

SHAPES = dict(
    vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=7, pad_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip
# Each family with what sets it apart switched on: Mixtral's sliding window, Qwen 2's shared expert and dense layer
# (mlp_only_layers), Qwen 3's renormalised weights, head norms and sparse step, OLMoE's unrenormalised weights and
# clipping.
MOE_CONFIGS = {
    "mixtral": lambda: MixtralConfig(**SHAPES, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SHAPES,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=40,
        mlp_only_layers=[1],
    ),  # fmt: skip
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SHAPES,
        head_dim=12,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),  # fmt: skip
    "olmoe": lambda: OlmoeConfig(**SHAPES, num_experts=5, num_experts_per_tok=2, clip_qkv=3.0),
}


def torch_model_and_checkpoint(model_type, tmp_path):
    """A random PyTorch model of the family and its weights as save_pretrained writes them."""
    config = MOE_CONFIGS[model_type]()
    config._attn_implementation = "eager"
    torch_model = random_torch_model(
        getattr(transformers, stock_module(model_type).HF_ARCHITECTURES[model_type]), config
    )
    torch_model.save_pretrained(tmp_path)
    return config, torch_model, load_file(str(tmp_path / "model.safetensors"))


def flax_model_and_params(config, checkpoint):
    module = stock_module(config.model_type)
    module.check_model_config(config)
    model = module.MODEL_CLASS(config)
    abstract = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32))
    assert (
        module.hf_shapes(abstract)
        == module.hf_architecture_shapes(config)
        == {name: tensor.shape for name, tensor in checkpoint.items()}
    )
    return model, module.from_hf_state_dict(checkpoint, abstract)


@pytest.mark.parametrize("model_type", MOE_CONFIGS)
def test_each_moe_family_computes_its_transformers_class_on_every_route(model_type, tmp_path):
    config, torch_model, checkpoint = torch_model_and_checkpoint(model_type, tmp_path)
    model, params = flax_model_and_params(config, checkpoint)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 16))
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(expected).max() > 1
    np.testing.assert_allclose(np.asarray(model.apply({"params": params}, jnp.asarray(ids))), expected, atol=1e-4)
    # Prefilled into a cache, and one token at a time from an empty one (relative to the largest logit, over 1).
    difference = model_code.routes_difference(model, params, ids, lambda rows: expected, generates_text=True)
    assert difference * np.abs(expected).max() < 1e-4
    # The export: the same tensors, laid out as save_pretrained lays them out, that transformers loads as they are.
    exported = stock_module(model_type).to_hf_state_dict(params)
    assert all(np.array_equal(exported[name], checkpoint[name]) for name in checkpoint)


def test_greedy_left_padded_decoding_equals_generate(tmp_path):
    config, torch_model, checkpoint = torch_model_and_checkpoint("qwen2_moe", tmp_path)
    model, params = flax_model_and_params(config, checkpoint)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(8, config.vocab_size, size=length).tolist() for length in (3, 9, 5)]
    decoded = generate_ids(make_sampler(model, config.eos_token_id), params, prompts, max_new_tokens=10)
    for prompt, new in zip(prompts, decoded):
        with torch.no_grad():
            expected = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=config.eos_token_id,
                pad_token_id=config.eos_token_id,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert new == expected


def random_routing(tokens=40, width=16, inner=24, experts=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, width)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    kernels = [
        jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)
        for shape in ((experts, width, inner), (experts, width, inner), (experts, inner, width))
    ]
    return x, logits, kernels


@pytest.mark.parametrize("grouping, renormalize", [("blocks", True), ("ragged_dot", False)])
def test_dropless_experts_equal_every_expert_on_every_token_with_their_gradients(grouping, renormalize):
    """Both grouped products, the router's weights renormalised or not, on tokens most of which go to one expert
    (groups of very different sizes, several blocks of one expert, experts with no token)."""
    x, logits, kernels = random_routing()
    logits = logits.at[:30, 3].add(4.0).at[:, 6:].add(-9.0)

    def loss(experts, x, logits, kernels):
        expert_ids, weights = moe.route(logits, 2, renormalize)
        y = experts(x, expert_ids, weights, *kernels, "silu")
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

    dropless = partial(moe.dropless_experts, grouping=grouping)
    with jax.default_matmul_precision("highest"):
        gradients = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
        (_, got), got_gradients = gradients(dropless, x, logits, kernels)
        (_, expected), expected_gradients = gradients(moe.dense_experts, x, logits, kernels)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    for got, expected in zip(jax.tree.leaves(got_gradients), jax.tree.leaves(expected_gradients)):
        assert np.abs(expected).max() > 1e-3
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_capacity_experts_drop_the_pairs_over_each_experts_capacity_and_compute_the_others_as_dense():
    """With room for every pair (a factor of experts / k), the dense formulation; with a factor of 1, on a router
    sending most tokens to one expert, the dense formulation of the pairs kept, each expert keeping its earliest."""
    x, logits, kernels = random_routing()
    logits = logits.at[:30, 3].add(4.0)
    expert_ids, weights = moe.route(logits, 2, True)
    tokens, experts = logits.shape
    roomy, nothing_dropped = moe.capacity_experts(x, expert_ids, weights, *kernels, "silu", experts / 2)
    np.testing.assert_allclose(roomy, moe.dense_experts(x, expert_ids, weights, *kernels, "silu"), atol=1e-5)
    assert float(nothing_dropped) == 0.0
    got, dropped = moe.capacity_experts(x, expert_ids, weights, *kernels, "silu", 1.0)
    capacity, queued = -(-tokens * 2 // experts), np.zeros(experts, int)
    kept_weights = np.array(weights)
    for token, choice in np.ndindex(*expert_ids.shape):
        expert = int(expert_ids[token, choice])
        queued[expert] += 1
        kept_weights[token, choice] *= queued[expert] <= capacity
    assert float(dropped) == pytest.approx(np.mean(kept_weights == 0)) and float(dropped) > 0.2
    np.testing.assert_allclose(got, moe.dense_experts(x, expert_ids, kept_weights, *kernels, "silu"), atol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_deepseek_v3_routing_chooses_and_weighs_as_transformers(renormalize):
    """Sigmoid scores, the correction bias choosing (negative biases included) but not weighing, 4 of 8 groups."""
    config = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=4,
        norm_topk_prob=renormalize, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.5)
    hidden = torch.randn(40, 16)
    with torch.no_grad():
        logits, expected_weights, expected_ids = router(hidden)
    ids, weights = moe.route(
        jnp.asarray(logits.numpy()), 6, renormalize, "sigmoid", jnp.asarray(router.e_score_correction_bias.numpy()),
        groups=8, top_groups=4, scale=2.5,
    )  # fmt: skip
    order, expected_order = np.argsort(ids, axis=-1), np.argsort(expected_ids.numpy(), axis=-1)

    def by_expert(values, order):
        return np.take_along_axis(np.asarray(values), order, axis=-1)

    np.testing.assert_array_equal(by_expert(ids, order), by_expert(expected_ids, expected_order))
    np.testing.assert_allclose(by_expert(weights, order), by_expert(expected_weights, expected_order), atol=1e-6)


def test_the_load_balancing_loss_is_transformers_with_and_without_a_mask():
    rng = np.random.default_rng(1)
    layers = [rng.standard_normal((2 * 10, 6)).astype(np.float32) * 2 for _ in range(3)]
    mask = (np.arange(10)[None, :] >= np.array([[0], [4]])).astype(np.int64)  # the second row left-padded
    for attention_mask in (None, mask):
        expected = load_balancing_loss_func(tuple(map(torch.tensor, layers)), 6, 3, None if attention_mask is None
                                            else torch.tensor(attention_mask))  # fmt: skip
        got = moe.load_balancing_loss(layers, 6, 3, None if attention_mask is None else jnp.asarray(attention_mask))
        assert abs(float(got) - float(expected)) < 1e-5
    assert float(moe.router_z_loss(layers)) > 0


# The published parameter counts, in billions, total and active per token: Mistral AI's announcement of Mixtral 8x7B
# (mistral.ai/news/mixtral-of-experts: 46.7B, 12.9B), the model card of Qwen/Qwen3-30B-A3B (30.5B, 3.3B) and the OLMoE
# paper (arXiv 2409.02060, table 1: 6.9B, 1.3B), each to one decimal, rounded (Mixtral's 12.88B is 12.9) or cut
# (Qwen's 3.35B is 3.3).
PUBLISHED_SIZES = {"mixtral-8x7b": (46.7, 12.9), "qwen3-30b-a3b": (30.5, 3.3), "olmoe-1b-7b": (6.9, 1.3)}


@pytest.mark.parametrize("preset", PUBLISHED_SIZES)
def test_the_published_presets_have_the_published_parameter_counts(preset):
    model_type, values = presets()[preset]
    config = config_class(model_type)(**values)
    module = stock_module(model_type)
    module.check_model_config(config)
    total, active = parameter_counts(config, module.moe_variant(config))
    published_total, published_active = PUBLISHED_SIZES[preset]
    assert abs(total / 1e9 - published_total) < 0.06 and abs(active / 1e9 - published_active) < 0.06, (total, active)


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok 5 must be between 1 and the number of experts"),
        ("olmoe", dict(moe_implementation="capacity"), "moe_implementation 'capacity' is not implemented"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1 is not implemented"),
    ],
)
def test_routing_a_module_does_not_compute_is_refused_in_one_line(model_type, overrides, message):
    config = MOE_CONFIGS[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(UsageError, match=message):
        stock_module(model_type).check_model_config(config)


def test_the_training_objective_adds_the_router_aux_loss_as_transformers_does(tmp_path):
    """With output_router_logits, run_clm_flax.py's train step adds router_aux_loss_coef times the load-balancing
    loss: on the same weights and tokens, the cross-entropy and the aux loss are transformers' loss and aux_loss."""
    config, torch_model, checkpoint = torch_model_and_checkpoint("mixtral", tmp_path)
    config.output_router_logits = True
    config.router_aux_loss_coef = torch_model.router_aux_loss_coef = 0.5  # which the PyTorch model keeps apart
    model, params = flax_model_and_params(config, checkpoint)
    model, optimizer, schedule, abstract_state = training_parts(config, length=12)
    state = create_train_state(model, optimizer, abstract_state, 0, jnp.zeros((1, 12), jnp.int32))
    state = state.replace(params=jax.tree.map(jnp.asarray, params))
    rows = np.random.default_rng(5).integers(0, config.vocab_size, size=(2, 12), dtype=np.int32)
    training_args = run_clm_flax.TrainingArguments(output_dir="unused", router_z_loss_coef=0.25)
    script = run_clm_flax.script_training(training_args, model)
    _, metrics = jax.jit(script.make_train_step(model, optimizer, schedule, seed=0))(state, {"input_ids": rows[None]})
    with torch.no_grad():
        expected = torch_model(torch.tensor(rows, dtype=torch.long), labels=torch.tensor(rows, dtype=torch.long),
                               output_router_logits=True)  # fmt: skip
    token_count = float(metrics["token_count"])
    aux = float(metrics["router_aux_loss_sum"]) / token_count
    assert aux == pytest.approx(0.5 * float(expected.aux_loss), abs=1e-5)
    # ST-MoE's router z-loss of transformers' router logits, and each layer's loads: the share of the top-2 choices.
    router_logits = [logits.float() for logits in expected.router_logits]
    z_loss = torch.stack([torch.logsumexp(logits, -1).square().mean() for logits in router_logits]).mean()
    router_z = float(metrics["router_z_loss_sum"]) / token_count
    assert router_z == pytest.approx(0.25 * float(z_loss), rel=1e-4)
    trained = float(metrics["loss_sum"]) / token_count + aux + router_z
    assert trained == pytest.approx(float(expected.loss) + 0.25 * float(z_loss), abs=1e-4)
    shown = run_clm_flax.train_metrics(jax.device_get(metrics))
    assert sorted(set(script.metric_sums) - set(metrics)) == [] and shown["router_z_loss"] == pytest.approx(router_z)
    assert shown["moe/load_balancing_loss"] == pytest.approx(float(expected.aux_loss), abs=1e-5)
    for layer, logits in enumerate(router_logits):
        loads = torch.bincount(logits.topk(2).indices.reshape(-1), minlength=4) / logits.topk(2).indices.numel()
        assert shown[f"moe/layer_{layer}/expert_load_max"] == pytest.approx(float(loads.max()))
        assert shown[f"moe/layer_{layer}/expert_load_min"] == pytest.approx(float(loads.min()))
    # With a capacity of half an even share, the train step drops pairs, says how many, and trains on another loss.
    capped_args = run_clm_flax.TrainingArguments(output_dir="unused", moe_capacity_factor=0.5)
    capped = run_clm_flax.script_training(capped_args, model)
    _, capped_metrics = jax.jit(capped.make_train_step(model, optimizer, schedule, seed=0))(
        state, {"input_ids": rows[None]}
    )
    dropped = [float(capped_metrics[f"moe/layer_{layer}/dropped_fraction"]) / token_count for layer in (0, 1)]
    assert set(capped.metric_sums) <= set(capped_metrics) and all(0.5 <= fraction < 1 for fraction in dropped)
    assert float(capped_metrics["loss_sum"]) != pytest.approx(float(metrics["loss_sum"]), rel=1e-4)
