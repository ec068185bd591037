"""GPT-J in Flax: rotary positions on the first rotary_dim dimensions of each head, turned in interleaved pairs
(dimensions 2i and 2i + 1, as Mesh Transformer JAX does), the attention and the MLP computed in parallel from one
LayerNorm of the block's input and both added to it, and an output layer with a bias. Parameter names and layouts are
one-to-one with transformers' GPTJForCausalLM; a key/value cache decodes (flax_lm.generation.sampling decodes with it).

A model module: flax_lm/models/__init__.py says what one holds, and how an experiment trains a copy of its own."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.devices.mesh import check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import (
    ACTIVATIONS,
    KeyValueCache,
    linear_shapes,
    look_up,
    rotary_frequencies,
)
from flax_lm.models.shared.hf_state_dict import params_of, shapes_of, state_dict_of, warn_of_unused
from flax_lm.models.shared.layer_norm_decoder import LayerNormPart, run_layers, token_positions

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"gptj": "GPTJForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# GPT-J's rotary base, which its config does not hold.
ROTARY_BASE = 10000.0


def head_dim_of(config) -> int:
    return config.n_embd // config.n_head


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/gptj/model.py was given a config of model type '{config.model_type}'")
    if config.n_embd % config.n_head:
        raise UsageError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}; fix the config")
    if config.activation_function not in ACTIVATIONS:
        raise UsageError(
            f"activation_function '{config.activation_function}' is not supported; use one of {', '.join(ACTIVATIONS)}"
        )
    rotary_dim, head_dim = config.rotary_dim, head_dim_of(config)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UsageError(
            f"rotary_dim {rotary_dim!r} is not an even number of a head's {head_dim} dimensions; set it, e.g. "
            f"--set rotary_dim={min(64, head_dim - head_dim % 2)}"
        )
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (n_head)": config.n_head,
                "MLP width (n_inner)": inner_width(config),
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


def inner_width(config) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.n_embd


def rotate_interleaved(x, positions, frequencies, dims: int):
    """x (batch, length, heads, head_dim) with its first `dims` dimensions of each head turned by the rotary angles
    of `positions` (batch, length), dimensions 2i and 2i + 1 the coordinates of pair i (transformers'
    rotate_every_two), the rest as they are."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies)  # (batch, length, dims // 2)
    # The angles' sines and cosines in the model's dtype, as GPT-J's table of them is cast.
    cos, sin = (f(angles)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    pairs = x[..., :dims].reshape(*x.shape[:-1], dims // 2, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    turned = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return jnp.concatenate([turned.reshape(*x.shape[:-1], dims), x[..., dims:]], axis=-1)


class GPTJAttention(LayerNormPart):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        batch, length, width = x.shape
        heads, head_dim = config.n_head, head_dim_of(config)

        def project(name: str):
            y = self.dense(width, ("embed", "heads"), False, name)(x)
            return self.constrain(y.reshape(batch, length, heads, head_dim), ("batch", None, "heads", None))

        query, key, value = project("q_proj"), project("k_proj"), project("v_proj")
        frequencies = rotary_frequencies({"rope_type": "default", "rope_theta": ROTARY_BASE}, config.rotary_dim)
        query = rotate_interleaved(query, positions, frequencies, config.rotary_dim)
        key = rotate_interleaved(key, positions, frequencies, config.rotary_dim)
        scale, rate = 1 / math.sqrt(head_dim), config.attn_pdrop
        y, layer_cache = self.attend_with_dropout(
            query, key, value, scale, rate, deterministic, cache, self.layer_index, segment_ids
        )
        y = self.dense(width, ("heads", "embed"), False, "out_proj")(y)
        y = self.constrain(y, ("batch", "length", None))
        return self.dropout(y, config.resid_pdrop, deterministic), layer_cache


class GPTJMLP(LayerNormPart):
    @nn.compact
    def __call__(self, x, deterministic: bool):
        config = self.config
        x = self.dense(inner_width(config), ("embed", "mlp"), True, "fc_in")(x)
        x = self.constrain(ACTIVATIONS[config.activation_function](x), ("batch", None, "mlp"))
        x = self.constrain(self.dense(config.n_embd, ("mlp", "embed"), True, "fc_out")(x), ("batch", "length", None))
        return self.dropout(x, config.resid_pdrop, deterministic)


class GPTJBlock(LayerNormPart):
    """x + attention(ln_1(x)) + mlp(ln_1(x)): both from the one norm, in parallel."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        normed = self.layer_norm("ln_1", self.config.layer_norm_epsilon)(x)
        attention = self.child(GPTJAttention, "attn", layer_index=self.layer_index)
        y, layer_cache = attention(normed, positions, deterministic, cache, segment_ids)
        return x + y + self.child(GPTJMLP, "mlp")(normed, deterministic), layer_cache


class GPTJModel(LayerNormPart):
    """The token embedding (wte), the blocks (h) and the final LayerNorm (ln_f)."""

    def setup(self):
        config = self.config
        self.wte = self.embedding(config.vocab_size, config.n_embd, config.initializer_range)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = self.stacked_layers(GPTJBlock, config.n_layer, deterministic_argnum=3)
        self.ln_f = self.layer_norm(None, config.layer_norm_epsilon)

    def __call__(self, input_ids, deterministic: bool, cache: KeyValueCache | None = None, separator_id=None):
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        positions, segment_ids = token_positions(input_ids, cache, separator_id)
        x = look_up(self.wte, "vocab", input_ids, self.mesh, self.dtype)
        x = self.constrain(self.drop(x, deterministic=deterministic), ("batch", "length", None))
        x, cache = run_layers(self.h, x, cache, positions, deterministic, cache, segment_ids)
        return self.ln_f(x), cache


class OutputBias(LayerNormPart):
    """The output layer's bias alone, where its weight is the token embedding (tie_word_embeddings)."""

    @nn.compact
    def __call__(self, logits):
        init = nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",))
        return logits + self.param("bias", init, (self.config.vocab_size,), self.param_dtype).astype(jnp.float32)


class FlaxGPTJForCausalLM(LayerNormPart):
    """GPT-J with its output layer (lm_head, with a bias); returns float32 logits (batch, length, vocab_size).

    Given a KeyValueCache (decoding), the input is the tokens that follow the cached ones, and the result is
    (logits, the cache with them added).

    With `document_separator_id`, the input is taken for documents packed end to end, each separator starting the
    next: a token attends only to its own document, and positions restart at each separator (Megatron-LM's
    --reset-attention-mask --reset-position-ids).
    """

    document_separator_id: int | None = None

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, cache: KeyValueCache | None = None):
        config = self.config
        transformer = self.child(GPTJModel, "transformer")
        hidden, cache = transformer(input_ids, deterministic, cache, self.document_separator_id)
        logits = self.output_logits(hidden, transformer.wte, config.initializer_range, use_bias=True)
        if config.tie_word_embeddings:
            logits = self.child(OutputBias, "lm_head")(logits)
        return logits if cache is None else (logits, cache)

    def empty_cache(self, prompt_mask, new_tokens: int) -> KeyValueCache:
        """The cache to decode the prompts of `prompt_mask` (batch, prompt length) and `new_tokens` more with."""
        config = self.config
        return KeyValueCache.empty(
            config.n_layer, config.n_head, head_dim_of(config), prompt_mask, new_tokens, self.dtype
        )


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxGPTJForCausalLM


def hf_name(flax_path: tuple) -> str:
    """('transformer', 'h_3', 'attn', 'q_proj', 'kernel') -> 'transformer.h.3.attn.q_proj.weight'."""
    *modules, leaf = flax_path
    modules = [f"h.{module[2:]}" if module.startswith("h_") and module[2:].isdigit() else module for module in modules]
    return ".".join([*modules, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch GPTJForCausalLM state dict (float32 numpy, HF names and layouts)."""
    return state_dict_of(params, hf_name)


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone."""
    return shapes_of(params, hf_name)


# Buffers some checkpoints carry (the causal mask, the rotary table), which the model computes.
HF_BUFFERS = (".attn.bias", ".attn.masked_bias", ".embed_positions")


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes
    and placed as they are laid out. The checkpoint's tensors may be of any float dtype."""
    params, unused = params_of(state_dict, abstract_params, hf_name)
    # A tied lm_head weight is the embedding.
    warn_of_unused([name for name in unused if not name.endswith(HF_BUFFERS) and name != "lm_head.weight"])
    return params


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a GPTJForCausalLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head weight (its bias is its own). From the config alone, so that
    it holds whatever is done to the Flax model."""
    width, inner = config.n_embd, inner_width(config)

    def layer_norm(name: str) -> dict:
        return {f"{name}.weight": (width,), f"{name}.bias": (width,)}

    shapes = {"transformer.wte.weight": (config.vocab_size, width)}
    for index in range(config.n_layer):
        block = f"transformer.h.{index}"
        shapes |= layer_norm(f"{block}.ln_1")
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= linear_shapes(f"{block}.attn.{name}", width, width, False)
        shapes |= linear_shapes(f"{block}.mlp.fc_in", width, inner, True)
        shapes |= linear_shapes(f"{block}.mlp.fc_out", inner, width, True)
    shapes |= layer_norm("transformer.ln_f")
    shapes["lm_head.bias"] = (config.vocab_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, width)
    return shapes
