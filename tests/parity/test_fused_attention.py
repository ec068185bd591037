"""Attention as cuDNN's fused kernel: the path every model takes on an NVIDIA GPU in half precision, which a CPU cannot
run. What a CPU can check is checked here: that the arguments handed to jax.nn.dot_product_attention pass the shape
checks of jax's own cuDNN path (forward and backward, traced with the cuDNN version faked), and that the same
arguments, computed by jax's XLA version of the function, give the written-out attention's result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo
from test_clm import TINY_FAMILY_CONFIGS, tiny_config
from test_mlm_model import example_batch
from test_mlm_model import tiny_config as tiny_roberta_config

from flax_lm.models import stock_module
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.roberta import model as roberta
from flax_lm.models.shared import common
from flax_lm.models.shared.common import fused_attention, fused_attention_arguments

SEPARATOR = 2  # the tiny RoBERTa's </s> and a stand-in end-of-text for the decoders


def model_and_input(name: str, dtype, abstract_params=False):
    """(model, (input_ids[, attention_mask]), params or with `abstract_params` their shapes) of a tiny model of each
    kind of attention: RoBERTa with right-padded rows, RoBERTa and GPT-2 with packed documents, Gemma 3 with a sliding
    window over its local layers."""
    if name.startswith("roberta"):
        input_ids, attention_mask = example_batch(padded=True)
        input_ids[:, 5] = SEPARATOR
        separator = SEPARATOR if name == "roberta-documents" else None
        config = tiny_roberta_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = roberta.MODEL_CLASS(config, dtype=dtype, document_separator_id=separator)
    else:
        input_ids = np.random.default_rng(0).integers(3, 500, size=(2, 16)).astype(np.int32)
        input_ids[:, [4, 11]] = SEPARATOR
        attention_mask = None
        if name == "gpt2-documents":
            config = tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            model = gpt2.MODEL_CLASS(config, dtype=dtype, document_separator_id=SEPARATOR)
        else:
            config = TINY_FAMILY_CONFIGS["gemma3"]()
            model = stock_module(config.model_type).MODEL_CLASS(config, dtype=dtype)
    inputs = (jnp.asarray(input_ids),) if attention_mask is None else (input_ids, jnp.asarray(attention_mask))
    init = jax.eval_shape if abstract_params else lambda function, *arguments: jax.jit(function)(*arguments)
    return model, inputs, init(model.init, jax.random.key(0), *inputs)["params"]


MODELS = ["roberta-padded", "roberta-documents", "gpt2-documents", "gemma3-window"]


def take_the_cudnn_branch(monkeypatch):
    """Every model takes its cuDNN branch on this CPU."""
    monkeypatch.setattr(common, "use_cudnn_attention", lambda dtype: True)
    monkeypatch.setattr(roberta, "use_cudnn_attention", lambda dtype: True)


def test_a_padding_mask_is_spread_over_the_queries_and_no_mask_is_left_out():
    query, key = jnp.zeros((3, 5, 2, 8)), jnp.zeros((3, 7, 1, 8))
    padding = jnp.asarray(np.arange(7)[None, :] < np.array([7, 4, 2])[:, None])[:, None, None, :]
    arguments = fused_attention_arguments(query, key, padding, window=3)
    assert arguments["mask"].shape == (3, 1, 5, 7)
    np.testing.assert_array_equal(arguments["mask"][:, 0], np.broadcast_to(padding[:, 0], (3, 5, 7)))
    assert arguments["local_window_size"] == (2, 0)
    assert fused_attention_arguments(query, key) == {}


def test_jax_cudnn_path_refuses_an_unspread_padding_mask(monkeypatch):
    """The refusal an H200 met (jax 0.11.2 checks as 0.10.2 does), reproduced on a CPU: so the next test can fail."""
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    query = jnp.ones((2, 16, 2, 32), jnp.bfloat16)
    padding = jnp.ones((2, 1, 1, 16), bool)
    with pytest.raises(ValueError, match="Bias must have same seq length as QKV, got 1 and 16"):
        jax.make_jaxpr(lambda q: jax.nn.dot_product_attention(q, q, q, mask=padding, implementation="cudnn"))(query)


@pytest.mark.parametrize("name", MODELS)
def test_jax_cudnn_path_accepts_each_models_arguments_forward_and_backward(name, monkeypatch):
    """The train step's gradient traced through jax's cuDNN attention, whose shape checks (check_layout,
    check_is_flash_attention) run while tracing; the kernel itself needs a GPU."""
    model, inputs, params = model_and_input(name, jnp.bfloat16, abstract_params=True)
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    take_the_cudnn_branch(monkeypatch)

    def loss(params):
        return model.apply({"params": params}, *inputs).astype(jnp.float32).mean()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    assert "custom_vjp_call" in jaxpr and "dot_product_attention_fwd" in jaxpr.replace("fwd_wrapper", "fwd")


@pytest.mark.parametrize("name", MODELS)
def test_the_fused_path_computes_the_written_out_attention(name, monkeypatch):
    """The cuDNN branch's arguments, computed by jax's XLA version of the function (float32, on this CPU), give the
    logits of the written-out attention, padding, documents and window included."""
    model, inputs, params = model_and_input(name, jnp.float32)
    written_out = np.asarray(jax.jit(lambda params: model.apply({"params": params}, *inputs))(params))
    original = jax.nn.dot_product_attention

    def as_xla(*arguments, implementation=None, **keywords):
        assert implementation == "cudnn"
        return original(*arguments, implementation="xla", **keywords)

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
    take_the_cudnn_branch(monkeypatch)
    fused = np.asarray(jax.jit(lambda params: model.apply({"params": params}, *inputs))(params))  # traced anew
    assert np.abs(written_out).max() > 0.1
    np.testing.assert_allclose(fused, written_out, atol=2e-5, rtol=0)


def test_fused_attention_with_xla_equals_the_written_out_causal_attention_of_segments_and_window():
    rng = np.random.default_rng(0)
    query, key, value = (jnp.asarray(rng.normal(size=(2, 12, 4, 8)), jnp.float32) for _ in range(3))
    segment_ids = jnp.asarray(np.cumsum(rng.random((2, 12)) < 0.2, axis=1))
    visible = common.causal_visibility(jnp.arange(12), jnp.arange(12), 5)[None] & common.same_segment(segment_ids)
    expected = common.attention_written_out(query, key, value, 0.3, visible)
    segments = common.same_segment(segment_ids)[:, None]
    fused = fused_attention(query, key, value, 0.3, segments, causal=True, window=5, implementation="xla")
    np.testing.assert_allclose(np.asarray(fused), np.asarray(expected), atol=1e-6, rtol=0)
