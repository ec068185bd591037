"""The T5 model's own ways of computing what a plain formula would (flax_lm/models/t5/model.py): the position bias's
gradient taken as a product, and dropout masks drawn from 16-bit random numbers. The logits are compared with
transformers' in tests/parity/test_t5.py."""

import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.models.t5.model import DROPOUT_LEVELS, add_position_bias, keep_mask


def test_the_position_bias_has_the_gradient_of_a_broadcast_sum():
    scores = jax.random.normal(jax.random.key(0), (3, 2, 5, 7))
    bias = jax.random.normal(jax.random.key(1), (1, 2, 5, 7))
    weights = jax.random.normal(jax.random.key(2), scores.shape)

    def loss(add, scores, bias):
        return jnp.sum(jnp.tanh(add(scores, bias)) * weights)

    expected = jax.grad(lambda scores, bias: loss(jnp.add, scores, bias), argnums=(0, 1))(scores, bias)
    gradients = jax.jit(jax.grad(lambda scores, bias: loss(add_position_bias, scores, bias), argnums=(0, 1)))(
        scores, bias
    )
    np.testing.assert_array_equal(add_position_bias(scores, bias), scores + bias)
    for got, want in zip(gradients, expected, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_keep_mask_keeps_values_at_the_probability_it_reports_for_an_odd_last_axis():
    mask, kept_probability = keep_mask(jax.random.key(0, impl="philox2x32"), 0.9, (64, 33, 129))
    assert mask.shape == (64, 33, 129) and mask.dtype == jnp.bool_
    assert kept_probability == round(0.9 * DROPOUT_LEVELS) / DROPOUT_LEVELS
    # 272,448 draws: the kept fraction's standard deviation is 0.0006.
    assert abs(float(mask.mean()) - kept_probability) < 0.003
    # Both halves of the 32 random bits are used, and independently: the two halves of the last axis agree as often
    # as independent draws do.
    first, second = mask[..., :64], mask[..., 65:129]
    assert abs(float((first == second).mean()) - (kept_probability**2 + (1 - kept_probability) ** 2)) < 0.005
    other, _ = keep_mask(jax.random.key(1, impl="philox2x32"), 0.9, (64, 33, 129))
    assert not np.array_equal(mask, other)
