"""Matrix products in FP8 with current scaling, for the dense layers on GPUs with FP8 matrix units: each operand is
scaled by its own largest magnitude of this step (no scale is kept between steps, so nothing joins the train state or
its checkpoints), multiplied in FP8 and accumulated in float32. The quantisation itself is flax's (flax.linen.fp8_ops);
flax's own FP8 layers keep delayed scales in a variable collection instead.

The scripts' --fp8 (fp8_training) puts the products of a model's nn.Dense layers into FP8 from outside the model
code, in the train step only: the model module, its fingerprint and what its exports claim stay as they are."""

import dataclasses
import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import get_fp8_max, quantize

logger = logging.getLogger(__name__)

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


# A module's method (rows, kernel) -> rows (rows, in) times kernel (in, ...), for a product of the module's own kernel
# that is no nn.Dense layer (GPT-2's query/key/value projection, whose kernel keeps the heads as an axis): fp8_training
# computes it in FP8 too.
DENSE_PRODUCT_METHOD = "dense_product"


def fp8_dense_layer(context) -> bool:
    """Whether the intercepted call (a flax InterceptorContext) is one fp8_training computes: the call of an nn.Dense
    layer (RowsDense included) whose parameters exist (not init) and that has no product of its own (the output
    layer's logits_product keeps its precision)."""
    layer = context.module
    return (
        context.method_name == "__call__"
        and isinstance(layer, nn.Dense)
        and layer.dot_general is None
        and layer.dot_general_cls is None
        and layer.has_variable("params", "kernel")
    )


def dense_in_fp8(layer: nn.Dense, inputs):
    """What `layer` computes of `inputs`, as nn.Dense does but for its product: fp8_product over the input's positions
    as one matrix of rows, as RowsDense multiplies."""
    kernel = nn.meta.unbox(layer.get_variable("params", "kernel"))
    bias = nn.meta.unbox(layer.get_variable("params", "bias")) if layer.use_bias else None
    inputs, kernel, bias = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
    y = fp8_product(inputs.reshape(-1, inputs.shape[-1]), kernel).reshape(*inputs.shape[:-1], layer.features)
    return y if bias is None else y + bias


def kernel_product_in_fp8(rows, kernel):
    """rows (rows, in) times kernel (in, ...) as fp8_product, the kernel's trailing axes as one: a module's
    DENSE_PRODUCT_METHOD in FP8."""
    product = fp8_product(rows, kernel.reshape(kernel.shape[0], -1))
    return product.reshape(rows.shape[0], *kernel.shape[1:])


def fp8_training(model: nn.Module) -> nn.Module:
    """`model` (a flax module of flax_lm/models, or of a --model_file) with its dense layers' products in FP8: the
    model of the train step with --fp8 (flax_lm.training.setup), whose evaluation and samples use `model` itself. Its
    parameters, checkpoints and module are those of `model`. Says in one line where the backend has no FP8 matrix
    units (there XLA emulates them, so the run still trains)."""
    device = jax.devices()[0]
    if fp8_supported(device):
        logger.info("--fp8: the train step's dense layers multiply in FP8 on %s", device.device_kind)
    else:
        logger.warning(
            "--fp8: %s has no FP8 matrix units: XLA computes the FP8 products in software, FP8's rounding without its "
            "speed (slower than bfloat16); it pays on NVIDIA GPUs of compute capability 8.9 or later",
            getattr(device, "device_kind", device.platform),
        )
    fields = {field.name: getattr(model, field.name) for field in dataclasses.fields(model) if field.init}
    fields.pop("parent"), fields.pop("name")
    return fp8_training_class(type(model))(**fields)


@functools.cache
def fp8_training_class(model_class: type) -> type:
    """The subclass of `model_class` that fp8_training makes: its fields, parameters and methods, but for apply,
    which computes the dense layers in FP8 (dense_in_fp8) through a flax method interceptor. The interceptor runs
    while the step is traced, so nothing of it stays in the compiled step but the FP8 products."""

    class FP8Training(model_class):
        def apply(self, variables, *args, **kwargs):
            layers_in_fp8 = []

            def interceptor(next_fun, args, kwargs, context):
                if context.method_name == DENSE_PRODUCT_METHOD:
                    layers_in_fp8.append(context.module.name)
                    return kernel_product_in_fp8(*args, **kwargs)
                if not fp8_dense_layer(context):
                    return next_fun(*args, **kwargs)
                layers_in_fp8.append(context.module.name)
                return dense_in_fp8(context.module, *args, **kwargs)

            with nn.intercept_methods(interceptor):
                output = super().apply(variables, *args, **kwargs)
            if not layers_in_fp8:
                logger.warning(
                    "--fp8: the model has no dense layer that fp8_training multiplies; it computes as without"
                )
            return output

    FP8Training.__name__ = FP8Training.__qualname__ = f"FP8Training{model_class.__name__}"
    return FP8Training
