"""FP8 matrix products with current scaling (flax_lm/training/fp8.py), checked on a CPU where XLA computes FP8 in
software: the products and their gradients stay within FP8's rounding of the float32 ones, a tiny model trains
to about the loss it reaches in float32, and --fp8 (fp8_training) puts the dense layers of the scripts' train steps,
and only those, into FP8. Their speed needs a GPU with FP8 matrix units."""

import logging
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO_DIR
from transformers import GPT2Config, RobertaConfig

from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.model_code import load_model_code
from flax_lm.models.roberta import model as roberta
from flax_lm.models.shared.common import RowsDense, logits_dot_general
from flax_lm.training.fp8 import fp8_dot_general, fp8_product, fp8_supported, fp8_training
from flax_lm.training.lifecycle import set_up_training

sys.path.insert(0, str(REPO_DIR))
import run_clm_flax  # noqa: E402
import run_mlm_flax  # noqa: E402


def relative_error(value, reference):
    return float(jnp.linalg.norm(value.astype(jnp.float32) - reference) / jnp.linalg.norm(reference))


@pytest.fixture
def operands():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(64, 128)), jnp.float32), jnp.asarray(rng.normal(size=(128, 32)) * 0.05)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_product_is_within_fp8_rounding_of_the_float32_one(operands, dtype):
    rows, kernel = operands
    product = fp8_product(rows.astype(dtype), kernel.astype(dtype))
    assert product.dtype == dtype
    # e4m3 keeps 3 bits of mantissa: each operand is off by up to 1/16, a sum of 128 such products by a few percent.
    assert 0.005 < relative_error(product, rows @ kernel) < 0.06


def test_an_all_zero_operand_gives_zeros_not_nans(operands):
    rows, kernel = operands
    assert float(jnp.abs(fp8_product(jnp.zeros_like(rows), kernel)).max()) == 0.0


def test_gradients_flow_to_both_operands_within_fp8_rounding(operands):
    rows, kernel = operands

    def loss(product):
        return lambda rows, kernel: jnp.sum(jnp.tanh(product(rows, kernel)) ** 2)

    rows_gradient, kernel_gradient = jax.grad(loss(fp8_product), (0, 1))(rows, kernel)
    expected_rows, expected_kernel = jax.grad(loss(jnp.dot), (0, 1))(rows, kernel)
    # The output's gradient in e5m2 (2 bits of mantissa) as well: a looser bound than the forward product's.
    assert relative_error(rows_gradient, expected_rows) < 0.12
    assert relative_error(kernel_gradient, expected_kernel) < 0.12


class TinyClassifier(nn.Module):
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        dense = {} if self.dot_general is None else {"dot_general": self.dot_general}
        return nn.Dense(4, **dense)(nn.gelu(nn.Dense(32, **dense)(x)))


def test_a_tiny_model_trains_to_about_its_float32_loss():
    rng = np.random.default_rng(1)
    inputs = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
    labels = jnp.asarray(np.argmax(np.asarray(inputs)[:, :4] + 0.5 * np.asarray(inputs)[:, 4:8], axis=1))

    def train(model):
        """The loss before each of 30 Adam steps, as one compiled loop."""
        optimizer = optax.adam(1e-2)

        def loss(params):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, inputs), labels).mean()

        def step(carry, _):
            params, state = carry
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = optimizer.update(grads, state)
            return (optax.apply_updates(params, updates), state), value

        params = model.init(jax.random.key(0), inputs)
        run = jax.jit(lambda params: jax.lax.scan(step, (params, optimizer.init(params)), length=30)[1])
        return np.asarray(run(params))

    reference, fp8 = train(TinyClassifier()), train(TinyClassifier(dot_general=fp8_dot_general))
    assert reference[-1] < 0.5 * reference[0]  # the task is learnt...
    assert abs(fp8[0] - reference[0]) < 0.02 * reference[0]  # ...from about the same start...
    assert abs(fp8[-1] - reference[-1]) < 0.1 * reference[0]  # ...to about the same loss


def test_only_gpus_with_fp8_matrix_units_count_as_supporting_it():
    assert not fp8_supported(jax.devices("cpu")[0])
    hopper, ada, ampere = (types.SimpleNamespace(platform="gpu", compute_capability=c) for c in ("9.0", "8.9", "8.0"))
    assert fp8_supported(hopper) and fp8_supported(ada) and not fp8_supported(ampere)


def test_other_products_are_refused_not_computed_wrongly():
    with pytest.raises(ValueError, match="multiplies a \\(rows, in\\) matrix"):
        fp8_dot_general(jnp.ones((2, 3, 4)), jnp.ones((4, 5)), (((2,), (0,)), ((), ())))


class DenseAndOutput(nn.Module):
    """A dense layer, an output layer (with the logits' own product) and a product of a kernel of the module's own
    (as GPT-2's query/key/value projection, by an identity kernel (2, 1, 2)) side by side on the same input."""

    @nn.compact
    def __call__(self, x):
        dense = RowsDense(2, use_bias=False, name="dense")(x)
        output = RowsDense(2, use_bias=False, dot_general=logits_dot_general, name="output")(x)
        return dense, output, self.dense_product(x, jnp.eye(2).reshape(2, 1, 2))

    def dense_product(self, rows, kernel):
        return jnp.einsum("ne,eto->nto", rows, kernel)


def test_fp8_training_rounds_the_dense_layers_products_to_e4m3_and_keeps_the_output_layers(caplog):
    model = DenseAndOutput()
    identity = {"params": {"dense": {"kernel": jnp.eye(2)}, "output": {"kernel": jnp.eye(2)}}}
    # Scaled by its largest magnitude (1.75 onto e4m3's 448), 1.03125 is 264, which e4m3 (3 bits of mantissa; 32
    # apart between 256 and 512) rounds to 256: 1.0. The identity kernel, 1 onto 448, is exact.
    x = jnp.array([[1.75, 1.03125]])
    with caplog.at_level(logging.INFO, logger="flax_lm.training.fp8"):
        fp8_model = fp8_training(model)
        dense, output, own_kernel = fp8_model.apply(identity, x)
        assert jax.tree.map(jnp.shape, fp8_model.init(jax.random.key(0), x)) == jax.tree.map(jnp.shape, identity)
    assert caplog.messages == [  # the one line of a backend without FP8 matrix units
        "--fp8: cpu has no FP8 matrix units: XLA computes the FP8 products in software, FP8's rounding without its "
        "speed (slower than bfloat16); it pays on NVIDIA GPUs of compute capability 8.9 or later"
    ]
    np.testing.assert_allclose(dense, [[1.75, 1.0]], rtol=1e-6)  # the scales' float32 rounding, no more
    np.testing.assert_allclose(own_kernel, [[[1.75, 1.0]]], rtol=1e-6)
    np.testing.assert_array_equal(output, x)
    np.testing.assert_array_equal(model.apply(identity, x)[0], x)  # the model itself, as evaluation computes it


def tiny_gpt2(mesh):
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return gpt2.MODEL_CLASS(config, jnp.bfloat16, mesh=mesh)


def tiny_roberta(mesh):
    config = RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=20, pad_token_id=1,
    )  # fmt: skip
    return roberta.MODEL_CLASS(config, jnp.bfloat16, mesh=mesh)


@pytest.mark.parametrize(
    "script, tiny_model, batch",
    [
        (run_clm_flax, tiny_gpt2, {"input_ids": ((1, 1, 2, 16), jnp.int32), "weights": ((1, 1, 2, 16), jnp.float32)}),
        (
            run_mlm_flax,
            tiny_roberta,
            {
                "input_ids": ((1, 1, 2, 16), jnp.int32), "attention_mask": ((1, 1, 2, 16), jnp.int32),
                "masked_positions": ((1, 1, 2, 3), jnp.int32), "masked_labels": ((1, 1, 2, 3), jnp.int32),
                "masked_weights": ((1, 1, 2, 3), jnp.float32),
            },
        ),
    ],
)  # fmt: skip
def test_with_fp8_the_scripts_train_steps_multiply_in_fp8_and_their_eval_steps_do_not(script, tiny_model, batch):
    model = tiny_model(script.create_mesh())
    model_code = load_model_code(model.config, None, script is run_clm_flax, "the tests", exports=False)
    training_args = script.TrainingArguments(output_dir="unused", fp8=True, max_steps=10, steps_per_call=1)
    setup = set_up_training(model, model_code, script.SCRIPT_TRAINING, script.make_eval_step(model),
                            training_args.training_settings(),                            None, 16)  # fmt: skip
    # (step of the call, micro-batch, row, ...)
    batches = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in batch.items()}
    train_steps = setup.compiled_train_steps.lower(setup.abstract_state, batches, 1).as_text()
    # The forward products' operands in e4m3, the backward ones' output gradient in e5m2.
    assert "f8E4M3FN" in train_steps and "f8E5M2" in train_steps
    eval_batch = {name: jax.ShapeDtypeStruct(value.shape[2:], value.dtype) for name, value in batches.items()}
    assert "f8E" not in setup.eval_step.lower(setup.abstract_state.params, eval_batch).as_text()
