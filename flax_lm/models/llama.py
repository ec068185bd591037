"""The Llama family in Flax: RMSNorm, rotary positions, a SwiGLU MLP and grouped-query attention, with parameter
names and layouts one-to-one with transformers' LlamaForCausalLM (so Llama 2 and 3 checkpoints, and models saved in
their layout, load), and a key/value cache for decoding (flax_lm.generation.sampling decodes with it).

A model module: flax_lm/models/__init__.py says what one holds, and how an experiment trains a copy of its own."""

import logging
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers import LlamaConfig

from flax_lm.devices.mesh import check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.common import (
    ACTIVATIONS,
    KeyValueCache,
    RowsDense,
    cached_attention,
    causal_attention,
    constrain,
    logits_dot_general,
    look_up,
    segments_and_positions,
    tied_logits,
)

logger = logging.getLogger(__name__)

# The config.model_type this module computes.
MODEL_TYPE = "llama"
# The transformers class whose checkpoint layout the parameters map onto, named in an exported config.json.
HF_ARCHITECTURE = "LlamaForCausalLM"
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# The rope_parameters["rope_type"] values this module computes: the plain rotary frequencies, all of them divided by
# a factor ("linear"), or Llama 3.1's scaling of the low frequencies ("llama3").
ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict:
    """The config's rotary settings as transformers 5 keeps them (rope_parameters), or as older configs wrote them
    (rope_theta beside an optional rope_scaling)."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters:
        parameters = dict(parameters)
    else:
        parameters = dict(getattr(config, "rope_scaling", None) or {})
        parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    parameters["rope_type"] = parameters.get("rope_type", parameters.get("type", "default"))
    return parameters


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a Llama variant this model does not implement, or one that the tensor
    axis of `mesh` cannot split."""
    if config.model_type != MODEL_TYPE:
        raise UsageError(f"the Llama model was given a config of model type '{config.model_type}'")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UsageError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of num_key_value_heads "
            f"{config.num_key_value_heads}; fix the config"
        )
    if config.hidden_act not in ACTIVATIONS:
        raise UsageError(f"hidden_act '{config.hidden_act}' is not supported; use one of {', '.join(ACTIVATIONS)}")
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES:
        raise UsageError(
            f"rope_parameters rope_type '{rope['rope_type']}' is not implemented by flax_lm/models/llama.py (it "
            f"computes {', '.join(ROPE_TYPES)}); use one of those, or implement it in rotary_frequencies of a copy "
            "of the module (--model_file)"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError("rope_parameters partial_rotary_factor is not implemented; remove it from the config")
    if getattr(config, "attention_dropout", 0.0):
        raise UsageError(
            f"attention_dropout {config.attention_dropout} is not implemented by the Llama model; set it to 0.0"
        )
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        logger.warning("pretraining_tp %s is ignored: it splits the products alone", config.pretraining_tp)
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (num_attention_heads)": config.num_attention_heads,
                "key/value heads (num_key_value_heads)": config.num_key_value_heads,
                "MLP width (intermediate_size)": config.intermediate_size,
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


def rotary_frequencies(config) -> np.ndarray:
    """(head_dim // 2,) float32 angular frequencies of the rotary positions: dimension pair i turns by
    position * frequency[i], as transformers computes them for the rope types of ROPE_TYPES."""
    rope = rope_parameters(config)
    head_dim = config.head_dim
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    frequencies = (1.0 / (np.float32(rope["rope_theta"]) ** exponents)).astype(np.float32)
    if rope["rope_type"] == "linear":
        frequencies = frequencies / np.float32(rope["factor"])
    elif rope["rope_type"] == "llama3":
        # Wavelengths shorter than the original context / high_freq_factor keep their frequency, those longer than
        # it / low_freq_factor are slowed by `factor`, and those between are blended smoothly.
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original_context = rope["original_max_position_embeddings"]
        wavelengths = 2 * math.pi / frequencies
        smooth = (original_context / wavelengths - low) / (high - low)
        blended = (1 - smooth) * frequencies / factor + smooth * frequencies
        frequencies = np.where(wavelengths > original_context / low, frequencies / factor, frequencies)
        between = (wavelengths <= original_context / low) & (wavelengths >= original_context / high)
        frequencies = np.where(between, blended, frequencies).astype(np.float32)
    return frequencies


def rotate(x, positions, frequencies):
    """x (batch, length, heads, head_dim) turned by the rotary angles of `positions` (batch, length): the first
    and second halves of each head are the two coordinates of head_dim // 2 pairs (transformers' rotate_half)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies)  # (batch, length, head_dim // 2)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    turned = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return turned.astype(x.dtype)


class LlamaModule(nn.Module):
    """Base of the model's parts: the config, the dtype of the computation, the dtype the parameters are stored
    in, and layers whose parameters carry logical axis names, so that a mesh can shard them. With `mesh`, the
    activations are laid out over it too (see constrain)."""

    config: LlamaConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each layer in the backward pass
    mesh: jax.sharding.Mesh | None = None

    def child(self, module_class, name: str | None, **fields):
        return module_class(
            self.config, self.dtype, self.param_dtype, self.remat_policy, self.mesh, name=name, **fields
        )

    def constrain(self, x, logical_axes: tuple):
        return constrain(x, self.mesh, logical_axes)

    def dense(self, features: int, names: tuple, use_bias: bool, name: str) -> RowsDense:
        """An nn.Linear of the checkpoint: weights drawn from N(0, initializer_range), zero bias."""
        return RowsDense(
            features,
            use_bias=use_bias,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(self.config.initializer_range), names),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def rms_norm(self, name: str) -> "LlamaRMSNorm":
        return LlamaRMSNorm(self.config.rms_norm_eps, self.dtype, self.param_dtype, name=name)


class LlamaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), computed in float32, times a learned `weight`, as transformers' LlamaRMSNorm."""

    epsilon: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight_init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        weight = self.param("weight", weight_init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normalized = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return weight.astype(self.dtype) * normalized.astype(self.dtype)


class LlamaAttention(LlamaModule):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        batch, length, _ = x.shape
        heads, key_value_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim

        def project(heads_count: int, name: str):
            y = self.dense(heads_count * head_dim, ("embed", "heads"), config.attention_bias, name)(x)
            return self.constrain(y.reshape(batch, length, heads_count, head_dim), ("batch", None, "heads", None))

        query, key, value = (
            project(heads, "q_proj"),
            project(key_value_heads, "k_proj"),
            project(key_value_heads, "v_proj"),
        )
        frequencies = rotary_frequencies(config)
        query, key = rotate(query, positions, frequencies), rotate(key, positions, frequencies)
        scale = 1 / math.sqrt(head_dim)
        layer_cache = None
        if cache is not None:
            y, layer_cache = cached_attention(query, key, value, scale, cache, self.layer_index, self.mesh)
        else:
            y = causal_attention(query, key, value, scale, None, segment_ids)
        # Split by heads, the projection's rows are split alike: each device sums its heads' share of the output.
        y = self.dense(config.hidden_size, ("heads", "embed"), config.attention_bias, "o_proj")(
            y.reshape(batch, length, heads * head_dim)
        )
        return self.constrain(y, ("batch", "length", None)), layer_cache


class LlamaMLP(LlamaModule):
    """down(act(gate(x)) * up(x)): SwiGLU with the config's activation (silu)."""

    @nn.compact
    def __call__(self, x):
        config = self.config
        inner, bias = config.intermediate_size, config.mlp_bias
        gate = self.dense(inner, ("embed", "mlp"), bias, "gate_proj")(x)
        up = self.dense(inner, ("embed", "mlp"), bias, "up_proj")(x)
        hidden = self.constrain(ACTIVATIONS[config.hidden_act](gate) * up, ("batch", None, "mlp"))
        y = self.dense(config.hidden_size, ("mlp", "embed"), bias, "down_proj")(hidden)
        return self.constrain(y, ("batch", "length", None))


class LlamaDecoderLayer(LlamaModule):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        attention = self.child(LlamaAttention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.rms_norm("input_layernorm")(x), positions, cache, segment_ids)
        x = x + y
        x = x + self.child(LlamaMLP, "mlp")(self.rms_norm("post_attention_layernorm")(x))
        return x, layer_cache


class LlamaModel(LlamaModule):
    """The token embedding, the layers and the final norm."""

    def setup(self):
        config = self.config
        init = nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), ("vocab", "embed"))
        self.embed_tokens = nn.Embed(
            config.vocab_size, config.hidden_size, embedding_init=init, dtype=self.dtype, param_dtype=self.param_dtype
        )
        layer = LlamaDecoderLayer
        if self.remat_policy:
            layer = nn.remat(LlamaDecoderLayer, policy=getattr(jax.checkpoint_policies, self.remat_policy))
        # A list attribute names its modules layers_0, layers_1, ...: the checkpoint's layers.0, layers.1, ...
        self.layers = [self.child(layer, None, layer_index=index) for index in range(config.num_hidden_layers)]
        self.norm = self.rms_norm("norm")

    def __call__(self, input_ids, cache: KeyValueCache | None = None, separator_id=None):
        # input_ids: (batch, length) -> hidden states (batch, length, hidden_size), and the cache with them added
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        segment_ids = None
        if cache is not None:
            positions = cache.positions(input_ids.shape[1])
        elif separator_id is not None:
            segment_ids, positions = segments_and_positions(input_ids, separator_id)
        else:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1])[None, :], input_ids.shape)
        x = self.constrain(
            look_up(self.embed_tokens, "vocab", input_ids, self.mesh, self.dtype), ("batch", "length", None)
        )
        layer_caches = []
        for layer in self.layers:
            x, layer_cache = layer(x, positions, cache, segment_ids)
            layer_caches.append(layer_cache)
        if cache is not None:
            keys, values = zip(*layer_caches)
            cache = cache.replace(keys=keys, values=values, index=cache.index + input_ids.shape[1])
        return self.norm(x), cache

    def attend(self, hidden):
        logits = tied_logits(hidden, self.embed_tokens.embedding.astype(self.dtype))
        return self.constrain(logits, ("batch", None, "vocab"))


class FlaxLlamaForCausalLM(LlamaModule):
    """Llama with its language-model head; returns float32 logits (batch, length, vocab_size).

    Given a KeyValueCache (decoding), the input is the tokens that follow the cached ones, and the result is
    (logits, the cache with them added).

    With `document_separator_id` (the token that starts each document: BOS), the input is taken for documents packed
    end to end: a token attends only to its own document, and rotary positions restart at each separator, so that
    each document is computed as if alone (Megatron-LM's --reset-attention-mask --reset-position-ids).
    """

    document_separator_id: int | None = None

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, cache: KeyValueCache | None = None):
        # `deterministic` is accepted as every model of the scripts takes it: Llama has no dropout here.
        model = self.child(LlamaModel, "model")
        hidden, cache = model(input_ids, cache, self.document_separator_id)
        if self.config.tie_word_embeddings:
            logits = model.attend(hidden)
        else:
            logits = RowsDense(
                self.config.vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(self.config.initializer_range), ("embed", "vocab")
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=logits_dot_general,
                name="lm_head",
            )(hidden)
            logits = self.constrain(logits, ("batch", None, "vocab"))
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, cache)

    def empty_cache(self, prompt_mask, new_tokens: int) -> KeyValueCache:
        """The cache to decode the prompts of `prompt_mask` (batch, prompt length) and `new_tokens` more with."""
        config = self.config
        return KeyValueCache.empty(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim, prompt_mask, new_tokens, self.dtype
        )


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxLlamaForCausalLM


def hf_name(flax_path: tuple) -> str:
    """('model', 'layers_3', 'self_attn', 'q_proj', 'kernel') -> 'model.layers.3.self_attn.q_proj.weight'."""
    *modules, leaf = flax_path
    modules = [
        f"layers.{module[7:]}" if module.startswith("layers_") and module[7:].isdigit() else module
        for module in modules
    ]
    return ".".join([*modules, "weight" if leaf in ("kernel", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch LlamaForCausalLM state dict (float32 numpy, HF names and layouts): every
    dense kernel, stored (in, out) here, is an nn.Linear weight (out, in) there."""
    state_dict = {}
    for path, value in flatten_dict(params).items():
        value = np.asarray(value, dtype=np.float32)
        state_dict[hf_name(path)] = np.ascontiguousarray(value.T if path[-1] == "kernel" else value)
    return state_dict


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone (arrays or
    jax.ShapeDtypeStruct): nothing is read or allocated. It follows to_hf_state_dict; change both together."""
    return {
        hf_name(path): tuple(value.shape[::-1] if path[-1] == "kernel" else value.shape)
        for path, value in flatten_dict(params).items()
    }


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a LlamaForCausalLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head: what exported weights must be for transformers to load
    them. From the config alone, so that it holds whatever is done to the Flax model."""
    width, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    heads, key_value_heads = config.num_attention_heads, config.num_key_value_heads

    def linear(name: str, fan_in: int, fan_out: int, bias: bool) -> dict:  # nn.Linear stores its weight (out, in)
        return {f"{name}.weight": (fan_out, fan_in)} | ({f"{name}.bias": (fan_out,)} if bias else {})

    shapes = {"model.embed_tokens.weight": (config.vocab_size, width)}
    for index in range(config.num_hidden_layers):
        layer = f"model.layers.{index}"
        attention, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        shapes |= linear(f"{attention}.q_proj", width, heads * head_dim, config.attention_bias)
        shapes |= linear(f"{attention}.k_proj", width, key_value_heads * head_dim, config.attention_bias)
        shapes |= linear(f"{attention}.v_proj", width, key_value_heads * head_dim, config.attention_bias)
        shapes |= linear(f"{attention}.o_proj", heads * head_dim, width, config.attention_bias)
        shapes |= linear(f"{mlp}.gate_proj", width, inner, config.mlp_bias)
        shapes |= linear(f"{mlp}.up_proj", width, inner, config.mlp_bias)
        shapes |= linear(f"{mlp}.down_proj", inner, width, config.mlp_bias)
        shapes |= {f"{layer}.input_layernorm.weight": (width,), f"{layer}.post_attention_layernorm.weight": (width,)}
    shapes["model.norm.weight"] = (width,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, width)
    return shapes


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes;
    the checkpoint's tensors may be of any float dtype (bfloat16, as Llama checkpoints are saved)."""
    params, used = {}, set()
    for path, expected in flatten_dict(abstract_params).items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"the checkpoint has no tensor {name}; it does not match the model config")
        value = np.asarray(state_dict[name])
        if path[-1] == "kernel":
            value = value.T
        if value.shape != expected.shape:
            raise UsageError(
                f"checkpoint tensor {name} has shape {value.shape} but the config needs {expected.shape}; "
                "pass the config the checkpoint was trained with"
            )
        params[path] = value.astype(expected.dtype)
        used.add(name)
    # The rotary frequencies some checkpoints carry are computed from the config here; a tied lm_head is the embedding.
    ignored = [
        name
        for name in state_dict
        if name not in used and not name.endswith(".rotary_emb.inv_freq") and name != "lm_head.weight"
    ]
    if ignored:
        logger.warning(
            "Ignoring %d checkpoint tensors the model does not use: %s", len(ignored), ", ".join(ignored[:5])
        )
    return unflatten_dict(params)
