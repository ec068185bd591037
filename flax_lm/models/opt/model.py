"""OPT in Flax: learned positions (their table offset by 2 rows, as fairseq numbers them after the padding), LayerNorm
before each sublayer (do_layer_norm_before, most sizes) or after it (OPT-350M), a ReLU MLP, biases where enable_bias
says, and the embedding narrower than the layers where word_embed_proj_dim says (project_in and project_out between
them). Parameter names and layouts are one-to-one with transformers' OPTForCausalLM; a key/value cache decodes
(flax_lm.generation.sampling decodes with it).

A model module: flax_lm/models/__init__.py says what one holds, and how an experiment trains a copy of its own."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.devices.mesh import check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import ACTIVATIONS, KeyValueCache, RowsDense, linear_shapes, look_up
from flax_lm.models.shared.hf_state_dict import params_of, shapes_of, state_dict_of, warn_of_unused
from flax_lm.models.shared.layer_norm_decoder import LayerNormPart, run_layers, token_positions

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"opt": "OPTForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Rows of the position table before position 0's (fairseq kept them for the padding).
POSITION_OFFSET = 2


def has_final_norm(config) -> bool:
    """Whether a LayerNorm follows the last layer: with the norms before the sublayers, but for checkpoints fine-tuned
    before transformers 4.20.1 (_remove_final_layer_norm)."""
    return config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)


def projects_embedding(config) -> bool:
    """Whether the embedding is narrower (or wider) than the layers: project_in and project_out between them."""
    return config.word_embed_proj_dim != config.hidden_size


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/opt/model.py was given a config of model type '{config.model_type}'")
    if config.hidden_size % config.num_attention_heads:
        raise UsageError(
            f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_attention_heads}; "
            "fix the config"
        )
    if config.activation_function not in ACTIVATIONS:
        raise UsageError(
            f"activation_function '{config.activation_function}' is not supported; use one of {', '.join(ACTIVATIONS)}"
        )
    if config.layerdrop:
        raise UsageError(f"layerdrop {config.layerdrop} is not implemented by flax_lm/models/opt/model.py; set 0.0")
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (num_attention_heads)": config.num_attention_heads,
                "MLP width (ffn_dim)": config.ffn_dim,
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


class OPTPart(LayerNormPart):
    """Base of the model's parts: LayerNormPart's, with OPT's LayerNorm (without a weight and bias where
    layer_norm_elementwise_affine is false) and weights drawn from N(0, init_std), OPT's name for it."""

    def dense(self, features: int, names: tuple, use_bias: bool, name: str | None) -> RowsDense:
        return RowsDense(
            features,
            use_bias=use_bias,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(self.config.init_std), names),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def norm(self, name: str | None) -> nn.LayerNorm:
        # torch.nn.LayerNorm's epsilon, which OPT keeps
        return self.layer_norm(name, 1e-5, affine=self.config.layer_norm_elementwise_affine)


class OPTAttention(OPTPart):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        batch, length, width = x.shape
        heads = config.num_attention_heads
        head_dim = width // heads

        def project(name: str):
            y = self.dense(width, ("embed", "heads"), config.enable_bias, name)(x)
            return self.constrain(y.reshape(batch, length, heads, head_dim), ("batch", None, "heads", None))

        # The queries scaled before their product with the keys, as OPT scales them.
        query = project("q_proj") * jnp.asarray(head_dim**-0.5, self.dtype)
        key, value = project("k_proj"), project("v_proj")
        y, layer_cache = self.attend_with_dropout(
            query, key, value, 1.0, config.attention_dropout, deterministic, cache, self.layer_index, segment_ids
        )
        y = self.dense(width, ("heads", "embed"), config.enable_bias, "out_proj")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class OPTDecoderLayer(OPTPart):
    """With do_layer_norm_before: x + attention(norm(x)), then x + mlp(norm'(x)); without it, norm(x + attention(x)),
    then norm'(x + mlp(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        config = self.config
        before = config.do_layer_norm_before
        attention_norm, mlp_norm = self.norm("self_attn_layer_norm"), self.norm("final_layer_norm")
        attention = self.child(OPTAttention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(attention_norm(x) if before else x, deterministic, cache, segment_ids)
        x = x + self.dropout(y, config.dropout, deterministic)
        x = x if before else attention_norm(x)
        y = self.dense(config.ffn_dim, ("embed", "mlp"), config.enable_bias, "fc1")(mlp_norm(x) if before else x)
        y = self.constrain(ACTIVATIONS[config.activation_function](y), ("batch", None, "mlp"))
        y = self.constrain(self.dense(config.hidden_size, ("mlp", "embed"), config.enable_bias, "fc2")(y),
                           ("batch", "length", None))  # fmt: skip
        x = x + self.dropout(y, config.dropout, deterministic)
        return (x if before else mlp_norm(x)), layer_cache


class OPTDecoder(OPTPart):
    """The token and position embeddings, project_in, the layers, the final norm and project_out."""

    def setup(self):
        config = self.config
        self.embed_tokens = self.embedding(config.vocab_size, config.word_embed_proj_dim, config.init_std)
        rows = config.max_position_embeddings + POSITION_OFFSET
        self.embed_positions = self.embedding(rows, config.hidden_size, config.init_std, ("positions", "embed"))
        if projects_embedding(config):
            self.project_in = self.dense(config.hidden_size, (None, "embed"), False, None)
            self.project_out = self.dense(config.word_embed_proj_dim, ("embed", None), False, None)
        self.layers = self.stacked_layers(OPTDecoderLayer, config.num_hidden_layers, deterministic_argnum=2)
        if has_final_norm(config):
            self.final_layer_norm = self.norm(None)

    def __call__(self, input_ids, deterministic: bool, cache: KeyValueCache | None = None, separator_id=None):
        config = self.config
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        positions, segment_ids = token_positions(input_ids, cache, separator_id)
        x = look_up(self.embed_tokens, "vocab", input_ids, self.mesh, self.dtype)
        if projects_embedding(config):
            x = self.project_in(x)
        x = x + look_up(self.embed_positions, "positions", positions + POSITION_OFFSET, self.mesh, self.dtype)
        x = self.constrain(x, ("batch", "length", None))
        x, cache = run_layers(self.layers, x, cache, deterministic, cache, segment_ids)
        if has_final_norm(config):
            x = self.final_layer_norm(x)
        return (self.project_out(x) if projects_embedding(config) else x), cache


class FlaxOPTForCausalLM(OPTPart):
    """OPT with its output layer (the token embedding, or lm_head without tie_word_embeddings); returns float32
    logits (batch, length, vocab_size).

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
        decoder = self.child(OPTDecoder, "decoder")
        hidden, cache = decoder(input_ids, deterministic, cache, self.document_separator_id)
        logits = self.output_logits(hidden, decoder.embed_tokens, config.init_std)
        return logits if cache is None else (logits, cache)

    def empty_cache(self, prompt_mask, new_tokens: int) -> KeyValueCache:
        """The cache to decode the prompts of `prompt_mask` (batch, prompt length) and `new_tokens` more with."""
        config = self.config
        head_dim = config.hidden_size // config.num_attention_heads
        return KeyValueCache.empty(
            config.num_hidden_layers, config.num_attention_heads, head_dim, prompt_mask, new_tokens, self.dtype
        )


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxOPTForCausalLM


def hf_name(flax_path: tuple) -> str:
    """('decoder', 'layers_3', 'fc1', 'kernel') -> 'model.decoder.layers.3.fc1.weight'; lm_head's as it is."""
    *modules, leaf = flax_path
    modules = [f"layers.{name[7:]}" if name.startswith("layers_") and name[7:].isdigit() else name for name in modules]
    prefix = [] if modules[0] == "lm_head" else ["model"]
    return ".".join([*prefix, *modules, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch OPTForCausalLM state dict (float32 numpy, HF names and layouts)."""
    return state_dict_of(params, hf_name)


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone."""
    return shapes_of(params, hf_name)


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes
    and placed as they are laid out; bare OPTModel checkpoints too (names without 'model.'). The checkpoint's tensors
    may be of any float dtype."""
    if not any(name.startswith("model.") for name in state_dict):
        state_dict = {f"model.{name}": value for name, value in state_dict.items()}
    params, unused = params_of(state_dict, abstract_params, hf_name)
    warn_of_unused([name for name in unused if name != "lm_head.weight"])  # tied: the embedding
    return params


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of an OPTForCausalLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head. From the config alone, so that it holds whatever is done to
    the Flax model."""
    width, inner, bias, embedding = config.hidden_size, config.ffn_dim, config.enable_bias, config.word_embed_proj_dim

    def layer_norm(name: str) -> dict:
        return {f"{name}.weight": (width,), f"{name}.bias": (width,)} if config.layer_norm_elementwise_affine else {}

    decoder = "model.decoder"
    shapes = {
        f"{decoder}.embed_tokens.weight": (config.vocab_size, embedding),
        f"{decoder}.embed_positions.weight": (config.max_position_embeddings + POSITION_OFFSET, width),
    }
    if projects_embedding(config):
        shapes |= linear_shapes(f"{decoder}.project_in", embedding, width, False)
        shapes |= linear_shapes(f"{decoder}.project_out", width, embedding, False)
    for index in range(config.num_hidden_layers):
        layer = f"{decoder}.layers.{index}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= linear_shapes(f"{layer}.self_attn.{name}", width, width, bias)
        shapes |= layer_norm(f"{layer}.self_attn_layer_norm") | layer_norm(f"{layer}.final_layer_norm")
        shapes |= linear_shapes(f"{layer}.fc1", width, inner, bias) | linear_shapes(f"{layer}.fc2", inner, width, bias)
    if has_final_norm(config):
        shapes |= layer_norm(f"{decoder}.final_layer_norm")
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, embedding)
    return shapes
