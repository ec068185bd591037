"""GPT-NeoX (Pythia) in Flax: LayerNorm, rotary positions on the first rotary_pct of each head's dimensions (their
two halves the pair's coordinates, as Llama's), the query, key and value of each head side by side in one fused
projection, and the attention and MLP added to the residual in parallel from two norms of the same input
(use_parallel_residual) or one after the other. Parameter names and layouts are one-to-one with transformers'
GPTNeoXForCausalLM; a key/value cache decodes (flax_lm.generation.sampling decodes with it).

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
    rope_parameters,
    rotary_frequencies,
    rotate,
)
from flax_lm.models.shared.hf_state_dict import params_of, shapes_of, state_dict_of, warn_of_unused
from flax_lm.models.shared.layer_norm_decoder import LayerNormPart, run_layers, token_positions

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"gpt_neox": "GPTNeoXForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True


# The rope_type values this module computes: the rotation of the rotary dimensions at GPT-NeoX's frequencies, all of
# them divided by a factor with "linear" (as transformers computes both for the rotary dimensions alone).
ROPE_TYPES = ("default", "linear")


def head_dim_of(config) -> int:
    return config.hidden_size // config.num_attention_heads


def rotary_dims(config) -> int:
    """The leading dimensions of each head that turn with the position: rotary_pct of them (transformers 5 keeps it
    as rope_parameters' partial_rotary_factor), rounded down as transformers rounds them."""
    return int(head_dim_of(config) * rope_parameters(config).get("partial_rotary_factor", 1.0))


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/gpt_neox/model.py was given a config of model type '{config.model_type}'")
    if config.hidden_size % config.num_attention_heads:
        raise UsageError(
            f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_attention_heads}; "
            "fix the config"
        )
    if config.hidden_act not in ACTIVATIONS:
        raise UsageError(f"hidden_act '{config.hidden_act}' is not supported; use one of {', '.join(ACTIVATIONS)}")
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES:
        raise UsageError(
            f"rope_parameters rope_type '{rope['rope_type']}' is not implemented by flax_lm/models/gpt_neox/model.py "
            f"(it computes {' and '.join(ROPE_TYPES)}); use one of those"
        )
    factor = rope.get("partial_rotary_factor", 1.0)
    if not 0 < factor <= 1 or rotary_dims(config) % 2:
        raise UsageError(
            f"rotary_pct (partial_rotary_factor) {factor} turns {rotary_dims(config)} of the {head_dim_of(config)} "
            "dimensions of a head; give a fraction in (0, 1] that turns an even number of them"
        )
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (num_attention_heads)": config.num_attention_heads,
                "MLP width (intermediate_size)": config.intermediate_size,
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


class NeoXPart(LayerNormPart):
    """Base of the model's parts: LayerNormPart's, with the config's LayerNorm."""

    def norm(self, name: str | None) -> nn.LayerNorm:
        return self.layer_norm(name, self.config.layer_norm_eps)


def rotate_leading(x, positions, frequencies, dims: int):
    """x (batch, length, heads, head_dim) with its first `dims` dimensions of each head turned by the rotary angles
    of `positions` (their two halves the coordinates of the pairs, as rotate turns a whole head), the rest as they
    are: GPT-NeoX's partial rotary embedding."""
    return jnp.concatenate([rotate(x[..., :dims], positions, frequencies), x[..., dims:]], axis=-1)


class NeoXAttention(NeoXPart):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        batch, length, width = x.shape
        heads, head_dim = config.num_attention_heads, head_dim_of(config)
        # The fused projection's columns are the heads in turn, each its query, key and value: split over the tensor
        # axis in contiguous pieces, each device holds whole heads.
        qkv = self.dense(3 * width, ("embed", "heads"), config.attention_bias, "query_key_value")(x)
        qkv = self.constrain(qkv.reshape(batch, length, heads, 3, head_dim), ("batch", None, "heads", None, None))
        query, key, value = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        dims = rotary_dims(config)
        frequencies = rotary_frequencies(rope_parameters(config), dims)
        query, key = (
            rotate_leading(query, positions, frequencies, dims),
            rotate_leading(key, positions, frequencies, dims),
        )
        scale, rate = 1 / math.sqrt(head_dim), config.attention_dropout
        y, layer_cache = self.attend_with_dropout(
            query, key, value, scale, rate, deterministic, cache, self.layer_index, segment_ids
        )
        y = self.dense(width, ("heads", "embed"), config.attention_bias, "dense")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class NeoXMLP(NeoXPart):
    @nn.compact
    def __call__(self, x):
        config = self.config
        x = self.dense(config.intermediate_size, ("embed", "mlp"), True, "dense_h_to_4h")(x)
        x = self.constrain(ACTIVATIONS[config.hidden_act](x), ("batch", None, "mlp"))
        x = self.dense(config.hidden_size, ("mlp", "embed"), True, "dense_4h_to_h")(x)
        return self.constrain(x, ("batch", "length", None))


class NeoXLayer(NeoXPart):
    """Parallel: x + attention(norm(x)) + mlp(norm'(x)); else x + attention(norm(x)), then y + mlp(norm'(y))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        rate = self.config.hidden_dropout
        attention = self.child(NeoXAttention, "attention", layer_index=self.layer_index)
        y, layer_cache = attention(self.norm("input_layernorm")(x), positions, deterministic, cache, segment_ids)
        y = self.dropout(y, rate, deterministic)
        mlp = self.child(NeoXMLP, "mlp")
        if self.config.use_parallel_residual:
            return x + y + self.dropout(mlp(self.norm("post_attention_layernorm")(x)), rate, deterministic), (
                layer_cache
            )
        x = x + y
        return x + self.dropout(mlp(self.norm("post_attention_layernorm")(x)), rate, deterministic), layer_cache


class NeoXModel(NeoXPart):
    """The embedding (embed_in), the layers and the final LayerNorm."""

    def setup(self):
        config = self.config
        self.embed_in = self.embedding(config.vocab_size, config.hidden_size, config.initializer_range)
        self.emb_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = self.stacked_layers(NeoXLayer, config.num_hidden_layers, deterministic_argnum=3)
        self.final_layer_norm = self.norm(None)

    def __call__(self, input_ids, deterministic: bool, cache: KeyValueCache | None = None, separator_id=None):
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        positions, segment_ids = token_positions(input_ids, cache, separator_id)
        x = look_up(self.embed_in, "vocab", input_ids, self.mesh, self.dtype)
        x = self.constrain(self.emb_dropout(x, deterministic=deterministic), ("batch", "length", None))
        x, cache = run_layers(self.layers, x, cache, positions, deterministic, cache, segment_ids)
        return self.final_layer_norm(x), cache


class FlaxGPTNeoXForCausalLM(NeoXPart):
    """GPT-NeoX with its output layer (embed_out; the embedding, with tie_word_embeddings); returns float32 logits
    (batch, length, vocab_size).

    Given a KeyValueCache (decoding), the input is the tokens that follow the cached ones, and the result is
    (logits, the cache with them added).

    With `document_separator_id`, the input is taken for documents packed end to end, each separator starting the
    next: a token attends only to its own document, and positions restart at each separator (Megatron-LM's
    --reset-attention-mask --reset-position-ids).
    """

    document_separator_id: int | None = None

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, cache: KeyValueCache | None = None):
        model = self.child(NeoXModel, "gpt_neox")
        hidden, cache = model(input_ids, deterministic, cache, self.document_separator_id)
        logits = self.output_logits(hidden, model.embed_in, self.config.initializer_range)
        return logits if cache is None else (logits, cache)

    def empty_cache(self, prompt_mask, new_tokens: int) -> KeyValueCache:
        """The cache to decode the prompts of `prompt_mask` (batch, prompt length) and `new_tokens` more with."""
        config = self.config
        return KeyValueCache.empty(
            config.num_hidden_layers, config.num_attention_heads, head_dim_of(config), prompt_mask, new_tokens,
            self.dtype,
        )  # fmt: skip


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxGPTNeoXForCausalLM

# The export's tensor names that transformers renames as it loads a checkpoint (its conversion mapping for
# GPTNeoXForCausalLM), under which a PyTorch model built in memory takes them with load_state_dict.
LOADED_NAMES = {"embed_out.weight": "lm_head.weight"}

# Flax parameter names -> the checkpoint's: the layers' list, the leaves, and the output layer, which
# GPTNeoXForCausalLM's checkpoints (and save_pretrained) name embed_out.
NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "lm_head": "embed_out"}


def hf_name(flax_path: tuple) -> str:
    """('gpt_neox', 'layers_3', 'attention', 'dense', 'kernel') -> 'gpt_neox.layers.3.attention.dense.weight'."""
    names = [f"layers.{name[7:]}" if name.startswith("layers_") else NAMES.get(name, name) for name in flax_path]
    return ".".join(names)


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch GPTNeoXForCausalLM state dict (float32 numpy, HF names and layouts)."""
    return state_dict_of(params, hf_name)


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone."""
    return shapes_of(params, hf_name)


# Buffers some checkpoints carry (the causal mask, rotary frequencies), which the model computes.
HF_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes
    and placed as they are laid out; the output layer read as embed_out (the published checkpoints') or lm_head
    (transformers 5's name for it in memory). The checkpoint's tensors may be of any float dtype."""
    if "lm_head.weight" in state_dict and "embed_out.weight" not in state_dict:
        state_dict = {"embed_out.weight" if name == "lm_head.weight" else name: v for name, v in state_dict.items()}
    params, unused = params_of(state_dict, abstract_params, hf_name)
    # A tied output layer is the embedding.
    warn_of_unused([name for name in unused if not name.endswith(HF_BUFFERS) and name != "embed_out.weight"])
    return params


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a GPTNeoXForCausalLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied output layer. From the config alone, so that it holds whatever is
    done to the Flax model."""
    width, inner, bias = config.hidden_size, config.intermediate_size, config.attention_bias

    def layer_norm(name: str) -> dict:
        return {f"{name}.weight": (width,), f"{name}.bias": (width,)}

    shapes = {"gpt_neox.embed_in.weight": (config.vocab_size, width)}
    for index in range(config.num_hidden_layers):
        layer = f"gpt_neox.layers.{index}"
        shapes |= layer_norm(f"{layer}.input_layernorm") | layer_norm(f"{layer}.post_attention_layernorm")
        shapes |= linear_shapes(f"{layer}.attention.query_key_value", width, 3 * width, bias)
        shapes |= linear_shapes(f"{layer}.attention.dense", width, width, bias)
        shapes |= linear_shapes(f"{layer}.mlp.dense_h_to_4h", width, inner, True)
        shapes |= linear_shapes(f"{layer}.mlp.dense_4h_to_h", inner, width, True)
    shapes |= layer_norm("gpt_neox.final_layer_norm")
    if not config.tie_word_embeddings:
        shapes["embed_out.weight"] = (config.vocab_size, width)
    return shapes
