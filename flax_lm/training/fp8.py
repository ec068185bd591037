"""Matrix products in FP8 with current scaling, for the dense layers on GPUs with FP8 matrix units: each operand is
scaled by its own largest magnitude of this step (no scale is kept between steps, so nothing joins the train state or
its checkpoints), multiplied in FP8 and accumulated in float32. The quantisation itself is flax's (flax.linen.fp8_ops);
flax's own FP8 layers keep delayed scales in a variable collection instead."""

import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import get_fp8_max, quantize

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2  # the forward and the backward formats


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """A dot_general for nn.Dense (rows, in) x (in, out), as RowsDense multiplies: fp8_product."""
    if dimension_numbers != (((1,), (0,)), ((), ())) or lhs.ndim != 2:
        raise ValueError("fp8_dot_general multiplies a (rows, in) matrix by an (in, out) kernel")
    return fp8_product(lhs, rhs)


def fp8_supported(device) -> bool:
    """Whether `device` multiplies FP8 matrices in hardware: NVIDIA GPUs from Ada and Hopper on (compute capability
    8.9 and later), where XLA hands FP8 products to cuBLAS. Elsewhere FP8 would only be emulated, slower than bf16."""
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and float(capability) >= 8.9


def fp8_scale(x, fp8_dtype):
    """The per-tensor scale of current scaling: this tensor's largest magnitude maps onto `fp8_dtype`'s largest
    number (1 for an all-zero tensor). float32; x / scale fits the format."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / get_fp8_max(fp8_dtype, jnp.float32), 1.0)


def to_fp8(x, fp8_dtype):
    """(x in `fp8_dtype` with its scale applied, the float32 scale): x is about fp8(x) * scale."""
    scale = fp8_scale(x, fp8_dtype)
    return quantize(x, fp8_dtype, scale, jnp.float32), scale


@jax.custom_vjp
def fp8_product(rows, kernel):
    """rows (rows, in) times kernel (in, out) as FP8 products with current scaling, returned in rows' dtype: both
    operands in float8_e4m3fn (more precision) in the forward pass, the output's gradient in float8_e5m2 (more
    range) in the backward pass, each tensor scaled by its own largest magnitude of this step, so no scale is kept
    between steps. Products accumulate in float32."""
    return _fp8_product_forward(rows, kernel)[0]


def _fp8_product_forward(rows, kernel):
    (rows_fp8, rows_scale), (kernel_fp8, kernel_scale) = to_fp8(rows, E4M3), to_fp8(kernel, E4M3)
    product = jnp.dot(rows_fp8, kernel_fp8, preferred_element_type=jnp.float32) * (rows_scale * kernel_scale)
    # The gradients take the dtypes of rows and kernel: the output's gradient has rows' dtype, an empty array keeps
    # the kernel's.
    return product.astype(rows.dtype), (rows_fp8, rows_scale, kernel_fp8, kernel_scale, jnp.empty(0, kernel.dtype))


def _fp8_product_backward(residuals, output_gradient):
    rows_fp8, rows_scale, kernel_fp8, kernel_scale, kernel_dtype_carrier = residuals
    gradient_fp8, gradient_scale = to_fp8(output_gradient, E5M2)
    rows_gradient = jnp.dot(gradient_fp8, kernel_fp8.T, preferred_element_type=jnp.float32)
    kernel_gradient = jnp.dot(rows_fp8.T, gradient_fp8, preferred_element_type=jnp.float32)
    return (
        (rows_gradient * (gradient_scale * kernel_scale)).astype(output_gradient.dtype),
        (kernel_gradient * (rows_scale * gradient_scale)).astype(kernel_dtype_carrier.dtype),
    )


fp8_product.defvjp(_fp8_product_forward, _fp8_product_backward)
