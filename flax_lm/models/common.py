"""What the Flax models share: activations by their Hugging Face config names, and the choice of attention kernel."""

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
