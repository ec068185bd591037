"""DeepSeek-V3 in Flax: Llama's pre-norm block with multi-head latent attention (MLA) and, after the first
first_k_dense_replace layers (gated MLPs of intermediate_size), a mixture of SwiGLU experts with shared experts.

MLA: the keys and values of all heads are made from one latent of kv_lora_rank per token (kv_a_proj_with_mqa, then
RMSNorm, then kv_b_proj up to each head's qk_nope_head_dim key and v_head_dim value), and each key's last
qk_rope_head_dim dimensions are one rotary key that every head shares; the queries come through a latent of
q_lora_rank (q_a_proj, RMSNorm, q_b_proj), or straight from q_proj where q_lora_rank is null. The rotary dimensions
are interleaved pairs where rope_interleave says (DeepSeek's layout), YaRN's scaled frequencies and attention factor
where rope_parameters says yarn, whose mscale_all_dim also scales the softmax. The key/value cache holds the latent
and the rotary key (kv_lora_rank + qk_rope_head_dim numbers a token and layer, as transformers caches them), and a
decoding step multiplies the queries by kv_b_proj's key half rather than the cache by it (DeepSeek-V2's absorbed
form: the same attention, without making every head's keys and values again at each step).

The experts: a sigmoid router, the choice made by score + e_score_correction_bias (a load-balancing bias, fixed here:
no gradient reaches it) within the topk_group best of n_group groups, the weights the unbiased scores (renormalised
where norm_topk_prob says) times routed_scaling_factor, computed dropless (flax_lm/models/shared/moe.py); beside
them n_shared_experts shared experts, one gated MLP of n_shared_experts * moe_intermediate_size that every token
takes. Parameter names and layouts are one-to-one with the checkpoints of transformers' DeepseekV3ForCausalLM
(mlp.experts.N.gate_proj/up_proj/down_proj, as transformers 4 and 5 load them; the multi-token prediction layers a
checkpoint may hold past the last layer are not part of the class, and are left out on loading).

A model module: flax_lm/models/README.md says what one holds, and how an experiment trains a copy of its own."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.devices.mesh import check_expert_split, check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import (
    CausalDecoderLM,
    DecoderPart,
    KeyValueCache,
    RMSNorm,
    causal_attention,
    causal_visibility,
    check_decoder_config,
    decoder_shapes,
    linear_shapes,
    rope_parameters,
    rotary_frequencies,
    rotate,
    use_cudnn_attention,
)
from flax_lm.models.shared.moe import EXPERTS, ExpertWeights, SizedGatedMLP, check_routing, route, routed_experts
from flax_lm.models.shared.moe_decoder import from_hf_state_dict, hf_shapes, moe_implementation, to_hf_state_dict

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/README.md).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]

MODULE_FILE = "flax_lm/models/deepseek_v3/model.py"
# The rope types computed here: DeepSeek-V3's own (yarn) and the plain rotary frequencies.
ROPE_TYPES = ("default", "yarn")
# transformers' RMSNorm of the query and key/value latents keeps its default epsilon, whatever rms_norm_eps says.
LATENT_NORM_EPSILON = 1e-6


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"{MODULE_FILE} was given a config of model type '{config.model_type}'")
    if config.num_key_value_heads != config.num_attention_heads:
        raise UsageError(
            f"num_key_value_heads {config.num_key_value_heads} must equal num_attention_heads "
            f"{config.num_attention_heads}: DeepSeek-V3's latent attention makes a key and value for every head"
        )
    check_decoder_config(config, MODULE_FILE, mesh)
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(
            f"rope_parameters {rope['rope_type']} (partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)}) is "
            f"not implemented by {MODULE_FILE}; use rope_type {' or '.join(ROPE_TYPES)}, all of qk_rope_head_dim"
        )
    if config.qk_rope_head_dim % 2:
        raise UsageError(f"qk_rope_head_dim {config.qk_rope_head_dim} must be even (pairs of dimensions turn)")
    if config.n_group is None or config.topk_group is None or config.n_routed_experts < 2 * config.n_group:
        raise UsageError(
            f"n_group {config.n_group} with topk_group {config.topk_group} and {config.n_routed_experts} "
            "n_routed_experts: set both, with at least two experts a group (a group is scored by its best two)"
        )
    check_routing(config.n_routed_experts, config.num_experts_per_tok, "sigmoid", config.n_group, config.topk_group)
    if config.n_shared_experts < 1:
        raise UsageError(f"n_shared_experts {config.n_shared_experts} must be 1 or more; fix the config")
    if getattr(config, "output_router_logits", False):
        raise UsageError(
            "output_router_logits: DeepSeek-V3 balances its experts with e_score_correction_bias, not an auxiliary "
            "loss (DeepseekV3ForCausalLM computes none); set it false"
        )
    if moe_implementation(config) not in EXPERTS:
        raise UsageError(
            f"moe_implementation '{config.moe_implementation}' is not implemented by {MODULE_FILE}; use one of "
            f"{', '.join(EXPERTS)}"
        )
    if mesh is not None:
        check_tensor_split(mesh, {"expert width (moe_intermediate_size)": config.moe_intermediate_size})
        check_expert_split(mesh, config.n_routed_experts)


# ---------------------------------------------------------------------------------------------------------------------
# Rotary positions: YaRN as transformers computes it for DeepSeek-V3.


def yarn_multiplier(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor of a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1 (1 unstretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_settings(config) -> tuple[np.ndarray, float, float]:
    """(frequencies (qk_rope_head_dim // 2,), the factor multiplying the turned rotary queries and keys, the softmax
    scale) of `config`. YaRN (Peng et al., 2023, as transformers' _compute_yarn_parameters): the dimensions that turn
    fewer than beta_slow times over the original context are interpolated (their frequency divided by `factor`), those
    that turn more than beta_fast times kept, those between blended; the rotary dimensions are multiplied by the
    attention factor, and the softmax scale by yarn_multiplier(factor, mscale_all_dim) squared."""
    rope, dim = rope_parameters(config), config.qk_rope_head_dim
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if rope["rope_type"] == "default":
        return rotary_frequencies(rope, dim), 1.0, scale
    base, original_context = rope["rope_theta"], rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original_context
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_multiplier(factor, mscale) / yarn_multiplier(factor, mscale_all_dim)
        else:
            attention_factor = yarn_multiplier(factor)

    def dimension_turning(turns: float) -> float:  # the dimension that turns `turns` times over the original context
        return dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(rope.get("beta_fast") or 32), dimension_turning(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1).astype(np.float32)
    wavelength_factors = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    extrapolated = (1.0 / wavelength_factors).astype(np.float32)
    interpolated = (1.0 / (np.float32(factor) * wavelength_factors)).astype(np.float32)
    kept = 1 - ramp  # the share of each dimension's own frequency
    frequencies = (interpolated * (1 - kept) + extrapolated * kept).astype(np.float32)
    if rope.get("mscale_all_dim"):
        scale = scale * yarn_multiplier(factor, rope["mscale_all_dim"]) ** 2
    return frequencies, float(attention_factor), scale


def rotate_shared(x, positions, frequencies, interleaved: bool, attention_factor: float):
    """x (batch, length, heads, qk_rope_head_dim) turned by its rotary angles. Interleaved, the pairs are dimensions
    (0, 1), (2, 3), ...: they are gathered as the two halves common.rotate turns (the result in halves, as
    transformers lays it out: queries and keys alike, so their products are the same)."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    turned = rotate(x, positions, frequencies)
    return turned if attention_factor == 1.0 else (turned * attention_factor).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The model.


class Kernel(nn.Module):
    """An nn.Linear's weight alone, stored (in, out) as a Dense kernel: for kv_b_proj, whose two halves a decoding
    step multiplies apart."""

    shape: tuple
    logical_axes: tuple
    initializer_range: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        init = nn.with_logical_partitioning(nn.initializers.normal(self.initializer_range), self.logical_axes)
        return self.param("kernel", init, self.shape, self.param_dtype)


class LatentAttention(DecoderPart):
    """Multi-head latent attention (see the module's docstring). Without a cache, every head's keys and values are
    made from the latents, as transformers does; with one, the cache holds each token's latent and rotary key."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        config = self.config
        batch, length, _ = x.shape
        heads, nope, rope_dim, value_dim = (
            config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        )  # fmt: skip
        rank, bias = config.kv_lora_rank, config.attention_bias
        if config.q_lora_rank is None:
            query = self.dense(heads * (nope + rope_dim), ("embed", "heads"), False, "q_proj")(x)
        else:
            query = self.dense(config.q_lora_rank, ("embed", None), bias, "q_a_proj")(x)
            query = self.latent_norm("q_a_layernorm")(query)
            query = self.dense(heads * (nope + rope_dim), (None, "heads"), False, "q_b_proj")(query)
        query = self.constrain(query.reshape(batch, length, heads, nope + rope_dim), ("batch", None, "heads", None))
        latent = self.dense(rank + rope_dim, ("embed", None), bias, "kv_a_proj_with_mqa")(x)
        latent, shared_key = latent[..., :rank], latent[..., rank:]
        latent = self.latent_norm("kv_a_layernorm")(latent)  # (batch, length, rank)

        frequencies, attention_factor, scale = rotary_settings(config)
        interleaved = bool(getattr(config, "rope_interleave", True))
        query_nope = query[..., :nope]
        query_rope = rotate_shared(query[..., nope:], positions, frequencies, interleaved, attention_factor)
        shared_key = rotate_shared(shared_key[:, :, None, :], positions, frequencies, interleaved, attention_factor)
        kv_b = Kernel((rank, heads * (nope + value_dim)), (None, "heads"), config.initializer_range,
                      self.param_dtype, name="kv_b_proj")().astype(self.dtype)  # fmt: skip

        layer_cache = None
        if cache is None:
            keys_values = (latent.reshape(-1, rank) @ kv_b).reshape(batch, length, heads, nope + value_dim)
            keys_values = self.constrain(keys_values, ("batch", None, "heads", None))
            key = jnp.concatenate(
                [keys_values[..., :nope], jnp.broadcast_to(shared_key, (batch, length, heads, rope_dim))], axis=-1
            )
            y = self.uncached_attention(jnp.concatenate([query_nope, query_rope], -1), key, keys_values[..., nope:],
                                      scale, segment_ids)  # fmt: skip
        else:
            y, layer_cache = self.cached_attention(
                query_nope, query_rope, latent, shared_key[:, :, 0], kv_b.reshape(rank, heads, nope + value_dim),
                scale, cache,
            )  # fmt: skip
        y = self.dense(config.hidden_size, ("heads", "embed"), bias, "o_proj")(y.reshape(batch, length, -1))
        return self.constrain(y, ("batch", "length", None)), layer_cache

    def latent_norm(self, name: str) -> RMSNorm:
        return RMSNorm(LATENT_NORM_EPSILON, self.dtype, self.param_dtype, logical_axis=None, name=name)

    def uncached_attention(self, query, key, value, scale: float, segment_ids):
        """common.causal_attention, whose cuDNN kernel takes values as wide as the keys: narrower ones are padded
        with zeros there (their outputs cut off after)."""
        value_dim = value.shape[-1]
        if use_cudnn_attention(query.dtype) and value_dim != query.shape[-1]:
            width = max(value_dim, query.shape[-1])
            query, key, value = (
                jnp.pad(y, [(0, 0)] * 3 + [(0, width - y.shape[-1])]) for y in (query, key, value)
            )  # fmt: skip
        return causal_attention(query, key, value, scale, None, segment_ids)[..., :value_dim]

    def cached_attention(self, query_nope, query_rope, latent, shared_key, kv_b, scale: float, cache: KeyValueCache):
        """Attention of the new tokens over the cached ones and themselves, written to the cache (the layer's keys:
        latents (batch, slots, rank); its values: rotary keys (batch, slots, qk_rope_head_dim)) at `cache.index`.
        A head's key is its nope part latent @ key_half plus the shared rotary key, its value latent @ value_half:
        the queries are multiplied by the key half, and the attention-weighted latents by the value half."""
        nope = query_nope.shape[-1]

        def write(cached, new_entries):
            return jax.lax.dynamic_update_slice_in_dim(cached, new_entries.astype(cached.dtype), cache.index, axis=1)

        latents = write(cache.keys[self.layer_index], latent)
        rotary_keys = write(cache.values[self.layer_index], shared_key)
        queries_in_latent = jnp.einsum("bnhd,rhd->bnhr", query_nope, kv_b[..., :nope])
        logits = jnp.einsum("bnhr,bsr->bhns", queries_in_latent, latents.astype(query_nope.dtype),
                            preferred_element_type=jnp.float32)  # fmt: skip
        logits += jnp.einsum("bnhd,bsd->bhns", query_rope, rotary_keys.astype(query_rope.dtype),
                             preferred_element_type=jnp.float32)  # fmt: skip
        new, slots = query_nope.shape[1], latents.shape[1]
        visible = cache.mask[:, None, :] & causal_visibility(cache.index + jnp.arange(new), jnp.arange(slots))[None]
        # A padding slot's query sees nothing; the softmax then spreads evenly, harmlessly, as nobody reads it.
        weights = jax.nn.softmax(jnp.where(visible[:, None], logits * scale, jnp.finfo(jnp.float32).min), axis=-1)
        attended = jnp.einsum("bhns,bsr->bnhr", weights.astype(latents.dtype), latents).astype(query_nope.dtype)
        y = jnp.einsum("bnhr,rhv->bnhv", attended, kv_b[..., nope:])
        return self.constrain(y, ("batch", None, "heads", None)), (latents, rotary_keys)


class Router(DecoderPart):
    """transformers' DeepseekV3TopkRouter: the router's weight (`kernel`, an nn.Linear's (experts, width) in the
    checkpoint), applied in float32 as transformers keeps it, and e_score_correction_bias, which the routing reads
    but no gradient reaches (DeepSeek-V3 adjusts it by the experts' load, apart from the loss; here it stays as
    loaded). Returns (expert ids, weights), both (tokens, num_experts_per_tok); sows the logits and the expert ids,
    from which the train step counts each expert's load (moe.router_metric_sums)."""

    @nn.compact
    def __call__(self, rows):
        config = self.config
        experts = config.n_routed_experts
        init = nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), ("embed", None))
        kernel = self.param("kernel", init, (config.hidden_size, experts), self.param_dtype)
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
        correction_bias = self.param("e_score_correction_bias", bias_init, (experts,), self.param_dtype)
        logits = jnp.dot(rows.astype(jnp.float32), kernel.astype(jnp.float32))
        self.sow("intermediates", "router_logits", logits)
        expert_ids, weights = route(
            logits, config.num_experts_per_tok, config.norm_topk_prob, "sigmoid",
            jax.lax.stop_gradient(correction_bias), config.n_group, config.topk_group, config.routed_scaling_factor,
        )  # fmt: skip
        self.sow("intermediates", "expert_ids", expert_ids)
        return expert_ids, weights


class DeepseekMoE(DecoderPart):
    """transformers' DeepseekV3MoE: the routed experts (dropless, shared/moe.py) plus the shared experts."""

    @nn.compact
    def __call__(self, x):
        config = self.config
        batch, length, width = x.shape
        rows = x.reshape(-1, width)
        expert_ids, weights = self.child(Router, "gate")(rows)
        kernels = ExpertWeights(
            config.n_routed_experts, config.moe_intermediate_size, width, ("gate_proj", "up_proj", "down_proj"),
            config.initializer_range, self.param_dtype, name="experts",
        )()  # fmt: skip
        kernels = [kernel.astype(self.dtype) for kernel in kernels]
        y = routed_experts(
            rows, expert_ids, weights, kernels, config.hidden_act, moe_implementation(config), self.mesh
        )
        shared_inner = config.moe_intermediate_size * config.n_shared_experts
        y = y + self.child(SizedGatedMLP, "shared_experts", inner=shared_inner)(rows)
        return self.constrain(y.reshape(batch, length, width).astype(self.dtype), ("batch", "length", None))


class DeepseekV3DecoderLayer(DecoderPart):
    """x + attention(norm(x)), then x + mlp(norm(x)): a gated MLP of intermediate_size on the first
    first_k_dense_replace layers, the experts on the others."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        config = self.config
        attention = self.child(LatentAttention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.rms_norm("input_layernorm")(x), positions, cache, segment_ids)
        x = x + y
        if self.layer_index < config.first_k_dense_replace:
            mlp = self.child(SizedGatedMLP, "mlp", inner=config.intermediate_size)
        else:
            mlp = self.child(DeepseekMoE, "mlp")
        return x + mlp(self.rms_norm("post_attention_layernorm")(x)), layer_cache


class FlaxDeepseekV3ForCausalLM(CausalDecoderLM):
    """DeepSeek-V3 with its language-model head: see CausalDecoderLM. Its cache holds latents (see LatentAttention)."""

    LAYER_CLASS = DeepseekV3DecoderLayer

    def empty_cache(self, prompt_mask, new_tokens: int) -> KeyValueCache:
        """The cache to decode the prompts of `prompt_mask` (batch, prompt length) and `new_tokens` more with: a
        latent (kv_lora_rank) and a rotary key (qk_rope_head_dim) a token and layer."""
        config = self.config
        batch, slots = prompt_mask.shape[0], prompt_mask.shape[1] + new_tokens
        layers = range(config.num_hidden_layers)
        mask = jnp.concatenate([prompt_mask.astype(bool), jnp.ones((batch, new_tokens), bool)], axis=1)
        return KeyValueCache(
            keys=tuple(jnp.zeros((batch, slots, config.kv_lora_rank), self.dtype) for _ in layers),
            values=tuple(jnp.zeros((batch, slots, config.qk_rope_head_dim), self.dtype) for _ in layers),
            mask=mask,
            index=jnp.zeros((), jnp.int32),
        )


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxDeepseekV3ForCausalLM


# ---------------------------------------------------------------------------------------------------------------------
# The checkpoint layout (shared/moe_decoder.py's mapping: each expert's projections as tensors of their own).


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a DeepseekV3ForCausalLM of `config` as save_pretrained writes them
    (e_score_correction_bias, a buffer, among them)."""
    width, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
    rank, rope_dim, nope = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim

    def gated_mlp(prefix: str, inner: int) -> dict:
        shapes = linear_shapes(f"{prefix}.gate_proj", width, inner, False)
        shapes |= linear_shapes(f"{prefix}.up_proj", width, inner, False)
        return shapes | linear_shapes(f"{prefix}.down_proj", inner, width, False)

    def layer_shapes(layer: str) -> dict:
        attention, query_width = f"{layer}.self_attn", heads * (nope + rope_dim)
        if config.q_lora_rank is None:
            shapes = linear_shapes(f"{attention}.q_proj", width, query_width, False)
        else:
            shapes = linear_shapes(f"{attention}.q_a_proj", width, config.q_lora_rank, bias)
            shapes[f"{attention}.q_a_layernorm.weight"] = (config.q_lora_rank,)
            shapes |= linear_shapes(f"{attention}.q_b_proj", config.q_lora_rank, query_width, False)
        shapes |= linear_shapes(f"{attention}.kv_a_proj_with_mqa", width, rank + rope_dim, bias)
        shapes[f"{attention}.kv_a_layernorm.weight"] = (rank,)
        shapes |= linear_shapes(f"{attention}.kv_b_proj", rank, heads * (nope + config.v_head_dim), False)
        shapes |= linear_shapes(f"{attention}.o_proj", heads * config.v_head_dim, width, bias)
        if int(layer.rsplit(".", 1)[1]) < config.first_k_dense_replace:
            shapes |= gated_mlp(f"{layer}.mlp", config.intermediate_size)
        else:
            experts = config.n_routed_experts
            shapes |= {f"{layer}.mlp.gate.weight": (experts, width), f"{layer}.mlp.gate.e_score_correction_bias":
                       (experts,)}  # fmt: skip
            for expert in range(experts):
                shapes |= gated_mlp(f"{layer}.mlp.experts.{expert}", config.moe_intermediate_size)
            shapes |= gated_mlp(f"{layer}.mlp.shared_experts", config.moe_intermediate_size * config.n_shared_experts)
        return shapes | {
            f"{layer}.{norm}.weight": (width,) for norm in ("input_layernorm", "post_attention_layernorm")
        }

    return decoder_shapes(config, layer_shapes)


def parameter_counts(config) -> tuple[int, int]:
    """(parameters, those active for a token) of the DeepseekV3ForCausalLM of `config`: its checkpoint's tensors but
    the correction biases (buffers, not parameters); a token uses num_experts_per_tok of each MoE layer's routed
    experts, and every other parameter."""
    total = active = 0
    for name, shape in hf_architecture_shapes(config).items():
        size = math.prod(shape)
        if name.endswith("e_score_correction_bias"):
            continue
        total += size
        active += size * config.num_experts_per_tok // config.n_routed_experts if ".experts." in name else size
    return total, active
