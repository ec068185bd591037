"""FP8 matrix products with current scaling (flax_lm/training/fp8.py), checked on a CPU where XLA computes FP8 in
software: the products and their gradients stay within FP8's rounding of the float32 ones, and a tiny model trains
to about the loss it reaches in float32. Their speed needs a GPU with FP8 matrix units."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_lm.training.fp8 import fp8_dot_general, fp8_product, fp8_supported


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
