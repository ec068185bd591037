"""What the Flax models share: activations by their Hugging Face config names, the choice of attention kernel, and the
segments of documents packed end to end into one sequence."""

from functools import partial

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def attention_implementation(dtype) -> str | None:
    """cuDNN's fused (flash) attention on NVIDIA GPUs in half precision, XLA's attention elsewhere.

    jax.nn.dot_product_attention does not choose cuDNN by itself, and cuDNN has no float32 kernel.
    """
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


def same_segment(segment_ids):
    """(batch, length, length): whether query position q and key position k are of the same segment."""
    return segment_ids[:, :, None] == segment_ids[:, None, :]


def segments_and_positions(input_ids, separator_id: int, counted=None):
    """Segment ids and positions for a block of documents packed end to end: each `separator_id` (the token between
    documents) starts a segment, and a token's position is the number of tokens before it in its segment, of those
    where `counted` (batch, length) is true if it is given (RoBERTa does not count padding)."""
    starts = input_ids == separator_id
    segment_ids = jnp.cumsum(starts, axis=1)
    counted = jnp.ones(input_ids.shape, jnp.int32) if counted is None else counted.astype(jnp.int32)
    before = jnp.cumsum(counted, axis=1) - counted  # counted tokens before each position in the row
    return segment_ids, before - jax.lax.cummax(jnp.where(starts, before, 0), axis=1)
