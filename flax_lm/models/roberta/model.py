"""RoBERTa for masked language modelling in Flax, with parameter names and layouts one-to-one with the Hugging Face
PyTorch checkpoint (RobertaForMaskedLM)."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import traverse_util

from flax_lm.devices.mesh import check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import (
    ACTIVATIONS,
    RowsDense,
    constrain,
    fused_attention,
    look_up,
    same_segment,
    segments_and_positions,
    tied_logits,
    use_cudnn_attention,
)

logger = logging.getLogger(__name__)

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"roberta": "RobertaForMaskedLM"}
# A masked LM: its exported directory has no generation config.
GENERATES_TEXT = False


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a RoBERTa variant this model does not implement, or one that the tensor
    axis of `mesh` cannot split."""
    if config.model_type != "roberta":
        raise UsageError(
            f"this script trains RoBERTa but the config is of model type '{config.model_type}'; "
            "use a roberta config (create_config.py --preset roberta-tiny) or run_clm_flax.py for gpt2"
        )
    if config.is_decoder or config.add_cross_attention:
        raise UsageError(
            "the config makes RoBERTa a decoder (is_decoder or add_cross_attention); "
            "masked language modelling needs an encoder, so set both to false"
        )
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise UsageError(
            f"position_embedding_type {position_embedding_type!r} in the config is not supported; only 'absolute' is"
        )
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACTIVATIONS:
        raise UsageError(
            f"hidden_act {config.hidden_act!r} in the config is not supported; use one of {', '.join(ACTIVATIONS)}"
        )
    if config.hidden_size % config.num_attention_heads != 0:
        raise UsageError(
            f"hidden_size {config.hidden_size} in the config is not a multiple of "
            f"num_attention_heads {config.num_attention_heads}"
        )
    if config.pad_token_id is None:
        raise UsageError("the config has no pad_token_id; RoBERTa needs one to number the positions")
    if not config.tie_word_embeddings:
        raise UsageError(
            "tie_word_embeddings is false in the config; this model always shares the "
            "output projection with the word embeddings"
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


def check_tokenizer(config, tokenizer):
    """Raise UsageError if the tokenizer lacks a special token RoBERTa frames its inputs with, or pads with another id
    than the config's pad_token_id, from which RoBERTa numbers the positions."""
    for role in ("bos", "eos", "pad"):
        if getattr(tokenizer, f"{role}_token_id") is None:
            raise UsageError(
                f"the tokenizer has no {role}_token, which RoBERTa needs; "
                "train it with train_tokenizer.py --model_type roberta"
            )
    if tokenizer.pad_token_id != config.pad_token_id:
        raise UsageError(
            f"the tokenizer's padding token has id {tokenizer.pad_token_id} but the config's pad_token_id is "
            f"{config.pad_token_id}; RoBERTa numbers positions from it, so make them equal "
            "(create_config.py --tokenizer_dir takes it from the tokenizer)"
        )


class RobertaModule(nn.Module):
    """Base of the model's parts: the config, the dtype of the computation, the dtype the parameters are stored
    in, and layers whose parameters carry logical axis names, so that a mesh can shard them. With `mesh`, the
    activations are laid out over it too (see constrain)."""

    config: transformers.RobertaConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each layer in the backward pass
    mesh: jax.sharding.Mesh | None = None

    def constrain(self, x, logical_axes: tuple):
        return constrain(x, self.mesh, logical_axes)

    def dense(self, features, kernel_axes, bias_axes, name):
        kernel_init = nn.initializers.normal(self.config.initializer_range)
        return RowsDense(
            features,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            kernel_init=nn.with_logical_partitioning(kernel_init, kernel_axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), bias_axes),
        )

    def layer_norm(self, name):
        return nn.LayerNorm(
            epsilon=self.config.layer_norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        )

    def embed(self, num_embeddings, axes, padding_idx=None):
        def init(key, shape, dtype):
            # The padding row starts at zero, as in PyTorch's nn.Embedding(padding_idx=...).
            table = nn.initializers.normal(self.config.initializer_range)(key, shape, dtype)
            return table if padding_idx is None else table.at[padding_idx].set(0)

        return nn.Embed(
            num_embeddings,
            self.config.hidden_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.with_logical_partitioning(init, axes),
        )

    def child(self, module_class, name):
        return module_class(self.config, self.dtype, self.param_dtype, self.remat_policy, self.mesh, name=name)


class RobertaEmbeddings(RobertaModule):
    """Word + position + token type embeddings (every token of type 0), then LayerNorm and dropout. The position ids
    (batch, seq) are RobertaModel's."""

    def setup(self):
        config = self.config
        self.word_embeddings = self.embed(config.vocab_size, ("vocab", "embed"), config.pad_token_id)
        self.position_embeddings = self.embed(
            config.max_position_embeddings, ("positions", "embed"), config.pad_token_id
        )
        self.token_type_embeddings = self.embed(config.type_vocab_size, (None, "embed"))
        self.LayerNorm = self.layer_norm("LayerNorm")
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def __call__(self, input_ids, position_ids, deterministic):
        token_type_ids = jnp.zeros_like(input_ids)
        x = (
            self.look_up(self.word_embeddings, "vocab", input_ids)
            + self.look_up(self.position_embeddings, "positions", position_ids)
            + self.look_up(self.token_type_embeddings, None, token_type_ids)
        )  # (batch, seq, hidden)
        x = self.constrain(x, ("batch", "length", None))
        return self.dropout(self.LayerNorm(x), deterministic=deterministic)

    def look_up(self, table: nn.Embed, row_axis: str | None, ids):
        return look_up(table, row_axis, ids, self.mesh, self.dtype)


def attention(query, key, value, mask, dropout: nn.Dropout):
    """Attention written out, with dropout on the attention probabilities (which jax.nn.dot_product_attention
    lacks); without dropout, XLA:CPU also runs it faster than that function's own XLA version."""
    # query, key, value: (batch, seq, heads, head_dim); mask: (batch, 1, 1 or seq, seq) bool or None
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(query.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(scores, axis=-1)).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


class RobertaSelfAttention(RobertaModule):
    """Multi-head self-attention: the query, key and value projections and the attention itself."""

    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        config = self.config
        num_heads = config.num_attention_heads
        head_dim = config.hidden_size // num_heads
        batch, seq, _ = hidden_states.shape

        def project(name):
            # Split by columns over the tensor axis: each device computes whole heads.
            x = self.dense(config.hidden_size, ("embed", "heads"), ("heads",), name)(hidden_states)
            return self.constrain(x.reshape(batch, seq, num_heads, head_dim), ("batch", None, "heads", None))

        query, key, value = project("query"), project("key"), project("value")
        no_dropout = deterministic or config.attention_probs_dropout_prob == 0
        if no_dropout and use_cudnn_attention(query.dtype):
            out = fused_attention(query, key, value, 1 / np.sqrt(head_dim), mask)
        else:
            dropout = nn.Dropout(config.attention_probs_dropout_prob, deterministic=no_dropout)
            out = attention(query, key, value, mask, dropout)
        return out.reshape(batch, seq, config.hidden_size)


class RobertaResidualOutput(RobertaModule):
    """Dense, dropout, then LayerNorm of the residual sum; ends both the attention and the MLP."""

    @nn.compact
    def __call__(self, hidden_states, residual, deterministic, kernel_axes):
        # Split by rows over the tensor axis (heads or MLP columns): one sum over the axis completes the output.
        x = self.dense(self.config.hidden_size, kernel_axes, ("embed",), "dense")(hidden_states)
        x = self.constrain(x, ("batch", "length", None))
        x = nn.Dropout(self.config.hidden_dropout_prob)(x, deterministic=deterministic)
        return self.layer_norm("LayerNorm")(x + residual)


class RobertaAttention(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        attended = self.child(RobertaSelfAttention, "self")(hidden_states, mask, deterministic)
        return self.child(RobertaResidualOutput, "output")(
            attended, hidden_states, deterministic, kernel_axes=("heads", "embed")
        )


class RobertaIntermediate(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states):
        x = self.dense(self.config.intermediate_size, ("embed", "mlp"), ("mlp",), "dense")(hidden_states)
        x = ACTIVATIONS[self.config.hidden_act](x)  # (batch, seq, intermediate)
        return self.constrain(x, ("batch", None, "mlp"))


class RobertaLayer(RobertaModule):
    """One post-LayerNorm transformer block: attention, then the MLP, each followed by residual + LayerNorm."""

    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        x = self.child(RobertaAttention, "attention")(hidden_states, mask, deterministic)
        h = self.child(RobertaIntermediate, "intermediate")(x)
        return self.child(RobertaResidualOutput, "output")(h, x, deterministic, kernel_axes=("mlp", "embed"))


class RobertaEncoder(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        layer = RobertaLayer
        if self.remat_policy:
            # Argument 3 (deterministic) is a Python bool that selects code, not an array.
            layer = nn.remat(
                RobertaLayer, policy=getattr(jax.checkpoint_policies, self.remat_policy), static_argnums=(3,)
            )
        for i in range(self.config.num_hidden_layers):
            hidden_states = self.child(layer, f"layer_{i}")(hidden_states, mask, deterministic)
        return hidden_states


class RobertaModel(RobertaModule):
    """Embeddings and encoder, without a head: returns hidden states (batch, seq, hidden)."""

    def setup(self):
        self.embeddings = self.child(RobertaEmbeddings, "embeddings")
        self.encoder = self.child(RobertaEncoder, "encoder")

    def __call__(self, input_ids, attention_mask, deterministic, separator_id=None):
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        mask = None
        if attention_mask is not None:
            attention_mask = self.constrain(attention_mask, ("batch", None))
            mask = attention_mask[:, None, None, :].astype(bool)  # (batch, 1, 1, seq): True = may attend
        # RoBERTa (after fairseq) numbers real tokens pad+1, pad+2, ... and gives padding the position
        # pad itself, so a sequence of length L needs max_position_embeddings >= L + pad + 1.
        pad = self.config.pad_token_id
        is_token = (input_ids != pad).astype(jnp.int32)
        if separator_id is None:
            tokens_before = jnp.cumsum(is_token, axis=1) - is_token
        else:
            segment_ids, tokens_before = segments_and_positions(input_ids, separator_id, counted=is_token)
            same = same_segment(segment_ids)[:, None]  # (batch, 1, seq, seq)
            mask = same if mask is None else mask & same
        position_ids = (tokens_before + 1) * is_token + pad
        x = self.embeddings(input_ids, position_ids, deterministic)
        return self.encoder(x, mask, deterministic)


class RobertaLMHead(RobertaModule):
    """Dense + GELU + LayerNorm, then scores against the (shared) word embeddings plus a bias."""

    @nn.compact
    def __call__(self, hidden_states, word_embeddings):
        x = self.dense(self.config.hidden_size, ("embed", None), ("embed",), "dense")(hidden_states)
        x = self.layer_norm("layer_norm")(ACTIVATIONS["gelu"](x))
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
            (self.config.vocab_size,),
            self.param_dtype,
        )
        # Float32 logits for the loss, whatever the compute dtype.
        logits = tied_logits(x, word_embeddings.astype(self.dtype)) + bias.astype(jnp.float32)
        return self.constrain(logits, ("batch", None, "vocab"))  # (batch, seq, vocab)


class FlaxRobertaForMaskedLM(RobertaModule):
    """RoBERTa encoder with its masked-language-modelling head; returns float32 logits (batch, seq, vocab),
    or (batch, predictions, vocab) at `masked_positions` only.

    With `document_separator_id` (</s>, which joins the texts of a packed block), the input is taken for documents
    packed end to end, each separator starting the document after it: a token attends only to its own document,
    and positions restart at each separator, so that each document is computed as if alone, led by its separator
    where a sequence of its own has <s>. Without it, the model is Hugging Face's RobertaForMaskedLM, which sees a row
    as one sequence.
    """

    document_separator_id: int | None = None

    def setup(self):
        check_model_config(self.config)
        self.roberta = self.child(RobertaModel, "roberta")
        self.lm_head = self.child(RobertaLMHead, "lm_head")

    def __call__(self, input_ids, attention_mask=None, deterministic: bool = True, masked_positions=None):
        hidden_states = self.roberta(input_ids, attention_mask, deterministic, self.document_separator_id)
        if masked_positions is not None:
            # masked_positions: (batch, predictions) int. Training predicts about 15% of the tokens, so running
            # the head (whose vocabulary projection is the largest matmul of a small model) only there saves
            # most of its work.
            masked_positions = constrain(masked_positions, self.mesh, ("batch", None))
            rows = jnp.arange(hidden_states.shape[0])[:, None]
            hidden_states = hidden_states[rows, masked_positions]  # (batch, predictions, hidden)
        # The output projection is the word embedding table itself (tied weights, as in RoBERTa).
        word_embeddings = self.roberta.embeddings.word_embeddings.embedding  # (vocab, hidden)
        return self.lm_head(hidden_states, word_embeddings)


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxRobertaForMaskedLM


# Tensors a RobertaForMaskedLM checkpoint may hold that this model does not need: the decoder weight and
# bias are tied to the word embeddings and lm_head.bias (save_pretrained leaves them out), the pooler
# belongs to RobertaModel, and older checkpoints saved the constant position_ids/token_type_ids buffers.
IGNORED_HF_TENSORS = (
    "lm_head.decoder.weight",
    "lm_head.decoder.bias",
    "roberta.embeddings.position_ids",
    "roberta.embeddings.token_type_ids",
)


IGNORED_HF_PREFIXES = ("roberta.pooler.",)


def hf_name(path: tuple) -> str:
    """('roberta', 'encoder', 'layer_3', 'intermediate', 'dense', 'kernel') -> PyTorch's name for it:
    'roberta.encoder.layer.3.intermediate.dense.weight'."""
    *modules, leaf = path
    # "layer_3" is the Flax name of PyTorch's "layer.3"; "layer_norm" stays as it is.
    modules = [f"layer.{m[6:]}" if m.startswith("layer_") and m[6:].isdigit() else m for m in modules]
    return ".".join([*modules, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch RobertaForMaskedLM state dict (float32 numpy, HF names and layouts).

    Dense kernels are (in, out) in Flax and (out, in) in PyTorch, so they are transposed. The tied
    lm_head.decoder tensors are left out, as save_pretrained does.
    """
    state_dict = {}
    for path, value in traverse_util.flatten_dict(params).items():
        value = np.asarray(value, dtype=np.float32)
        state_dict[hf_name(path)] = np.ascontiguousarray(value.T if path[-1] == "kernel" else value)
    return state_dict


def from_hf_state_dict(state_dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init).

    Accepts checkpoints with or without the tied lm_head.decoder tensors and the pooler. Raises
    UsageError naming the first tensor that is missing, unexpected or of the wrong shape for the model.
    """
    expected = traverse_util.flatten_dict(abstract_params)
    flat_params = {}
    for path, abstract in expected.items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"checkpoint has no tensor {name}; is it a RobertaForMaskedLM checkpoint?")
        array = np.asarray(state_dict[name], dtype=np.float32)
        is_kernel = path[-1] == "kernel"
        needed_shape = abstract.shape[::-1] if is_kernel else abstract.shape  # in the PyTorch layout
        if array.shape != needed_shape:
            raise UsageError(
                f"checkpoint tensor {name} has shape {array.shape} but the config needs "
                f"{needed_shape}; pass the matching --config_name"
            )
        flat_params[path] = np.ascontiguousarray(array.T if is_kernel else array).astype(abstract.dtype)
    used_names = {hf_name(path) for path in expected}
    for name in state_dict:
        if name not in used_names and name not in IGNORED_HF_TENSORS and not name.startswith(IGNORED_HF_PREFIXES):
            raise UsageError(
                f"checkpoint tensor {name} is not part of RobertaForMaskedLM with this config; "
                "pass the matching --config_name"
            )
    return traverse_util.unflatten_dict(flat_params)


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone (arrays or
    jax.ShapeDtypeStruct): nothing is read or allocated. It follows to_hf_state_dict; change both together."""
    return {
        hf_name(path): tuple(value.shape[::-1] if path[-1] == "kernel" else value.shape)
        for path, value in traverse_util.flatten_dict(params).items()
    }


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a RobertaForMaskedLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without the lm_head.decoder tied to the word embeddings and to lm_head.bias: what
    exported weights must be for transformers to load them. From the config alone, so that it holds whatever is
    done to the Flax model."""
    hidden, intermediate = config.hidden_size, config.intermediate_size

    def linear(name: str, fan_in: int, fan_out: int) -> dict:  # nn.Linear stores its weight (out, in)
        return {f"{name}.weight": (fan_out, fan_in), f"{name}.bias": (fan_out,)}

    def layer_norm(name: str) -> dict:
        return {f"{name}.weight": (hidden,), f"{name}.bias": (hidden,)}

    shapes = {
        "roberta.embeddings.word_embeddings.weight": (config.vocab_size, hidden),
        "roberta.embeddings.position_embeddings.weight": (config.max_position_embeddings, hidden),
        "roberta.embeddings.token_type_embeddings.weight": (config.type_vocab_size, hidden),
        **layer_norm("roberta.embeddings.LayerNorm"),
    }
    for index in range(config.num_hidden_layers):
        layer = f"roberta.encoder.layer.{index}"
        for projection in ("query", "key", "value"):
            shapes |= linear(f"{layer}.attention.self.{projection}", hidden, hidden)
        shapes |= linear(f"{layer}.attention.output.dense", hidden, hidden)
        shapes |= layer_norm(f"{layer}.attention.output.LayerNorm")
        shapes |= linear(f"{layer}.intermediate.dense", hidden, intermediate)
        shapes |= linear(f"{layer}.output.dense", intermediate, hidden) | layer_norm(f"{layer}.output.LayerNorm")
    shapes |= linear("lm_head.dense", hidden, hidden) | layer_norm("lm_head.layer_norm")
    shapes["lm_head.bias"] = (config.vocab_size,)
    return shapes
