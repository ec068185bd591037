"""The decoder of the mixture-of-experts families (mixtral/, qwen_moe/, olmoe/): Llama's pre-norm block of rotary
grouped-query attention (with what each family adds: Qwen's query/key/value biases, RMSNorm of each query and key head
as Qwen 3's or of all heads together as OLMoE's, OLMoE's clipping of the projections, sliding windows) and, in place of
the MLP, shared/moe.py's SparseMoeBlock on the layers the family makes sparse (a gated MLP on the others). A MoeVariant
says what sets each family apart, read from its config; the parameters map onto the checkpoint layout its
transformers class saves, each expert's projections as tensors of their own (experts.N.w1.weight, or
experts.N.gate_proj.weight), which transformers 4 loads as they are and transformers 5 fuses on load."""

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from flax_lm.devices.mesh import check_expert_split
from flax_lm.errors import UsageError
from flax_lm.models.shared import common
from flax_lm.models.shared.common import (
    CausalDecoderLM,
    DecoderPart,
    KeyValueCache,
    check_decoder_config,
    check_rope,
    decoder_shapes,
    head_dim_of,
    layer_windows,
    linear_shapes,
    rope_parameters,
    rotary_frequencies,
    rotate,
)
from flax_lm.models.shared.moe import CAPACITY_KEY, IMPLEMENTATIONS, SizedGatedMLP, SparseMoeBlock, check_routing


@dataclasses.dataclass(frozen=True)
class MoeVariant:
    """What sets an MoE family apart, each a function of its config (or a constant of its checkpoint layout)."""

    module_file: str
    moe_name: str  # the checkpoint's name of a layer's MoE block: "block_sparse_moe" (Mixtral) or "mlp"
    expert_names: tuple  # of each expert's gate, up and down projections
    head_norm: str | None  # RMSNorm of the queries and keys: None, "each head" (Qwen 3), "all heads" (OLMoE)
    projection_biases: Callable  # config -> (query/key/value biases, output bias)
    num_experts: Callable
    expert_inner: Callable  # config -> an expert's MLP width
    renormalize: Callable  # config -> whether the top-k weights are renormalised to sum to 1
    shared_inner: Callable = lambda config: None  # config -> Qwen 2's shared expert's MLP width, or None
    sparse_layer: Callable = lambda config, index: True  # (config, layer index) -> an MoE layer, or a gated MLP's


def moe_implementation(config) -> str:
    """How the experts are computed (config.moe_implementation, a key of this repository): "dropless" by default."""
    return getattr(config, "moe_implementation", None) or "dropless"


def check_moe_config(config, variant: MoeVariant, mesh=None):
    """Refuse what the MoE decoder does not compute, in one line: the decoder's checks (common.py), the routing's
    (moe.check_routing), experts that the expert axis of `mesh` does not divide, an unknown moe_implementation."""
    check_decoder_config(config, variant.module_file, mesh)
    check_rope(rope_parameters(config), variant.module_file)
    check_routing(variant.num_experts(config), config.num_experts_per_tok)
    if mesh is not None:
        check_expert_split(mesh, variant.num_experts(config))
    if getattr(config, CAPACITY_KEY, None) is not None:
        raise UsageError(
            f"{CAPACITY_KEY} in the config is not read by {variant.module_file}: a capacity applies to training "
            "alone, with run_clm_flax.py --moe_capacity_factor; remove it from config.json"
        )
    if moe_implementation(config) not in IMPLEMENTATIONS:
        raise UsageError(
            f"moe_implementation '{config.moe_implementation}' is not implemented by {variant.module_file}; use one "
            f"of {', '.join(IMPLEMENTATIONS)}"
        )


class MoeAttention(DecoderPart):
    """Llama's attention with the family's biases, query/key norms and clipping (clip_qkv)."""

    layer_index: int = 0
    variant: MoeVariant | None = None

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        config, variant = self.config, self.variant
        head_dim = head_dim_of(config)
        projections_bias, output_bias = variant.projection_biases(config)
        query, key, value = self.head_projections(x, projections_bias)
        if variant.head_norm == "each head":
            query = self.rms_norm("q_norm", logical_axis=None)(query)
            key = self.rms_norm("k_norm", logical_axis=None)(key)
        elif variant.head_norm == "all heads":
            query, key = (
                self.rms_norm(name, logical_axis="heads")(y.reshape(*y.shape[:2], -1)).reshape(y.shape)
                for name, y in (("q_norm", query), ("k_norm", key))
            )
        if (clip := getattr(config, "clip_qkv", None)) is not None:
            query, key, value = (jnp.clip(y, -clip, clip) for y in (query, key, value))
        frequencies = rotary_frequencies(rope_parameters(config), head_dim)
        query, key = rotate(query, positions, frequencies), rotate(key, positions, frequencies)
        window = layer_windows(config)[self.layer_index]
        scale = 1 / math.sqrt(head_dim)
        y, layer_cache = self.attend(query, key, value, scale, cache, self.layer_index, segment_ids, window)
        y = self.dense(config.hidden_size, ("heads", "embed"), output_bias, "o_proj")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class MoeDecoderLayer(DecoderPart):
    """x + attention(norm(x)), then x + moe(norm(x)) (or a gated MLP's on the layers the family keeps dense). A
    family's layer class sets VARIANT."""

    layer_index: int = 0

    VARIANT = None  # the MoeVariant

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        config, variant = self.config, self.VARIANT
        attention = self.child(MoeAttention, "self_attn", layer_index=self.layer_index, variant=variant)
        y, layer_cache = attention(self.rms_norm("input_layernorm")(x), positions, cache, segment_ids)
        x = x + y
        if variant.sparse_layer(config, self.layer_index):
            mlp = self.child(
                SparseMoeBlock, variant.moe_name, experts=variant.num_experts(config),
                top_k=config.num_experts_per_tok, inner=variant.expert_inner(config),
                renormalize=variant.renormalize(config),
                expert_names=variant.expert_names, shared_inner=variant.shared_inner(config),
                implementation=moe_implementation(config), capacity_factor=getattr(config, CAPACITY_KEY, None),
            )  # fmt: skip
        else:
            mlp = self.child(SizedGatedMLP, "mlp", inner=config.intermediate_size)
        return x + mlp(self.rms_norm("post_attention_layernorm")(x)), layer_cache


class MoeCausalLM(CausalDecoderLM):
    """An MoE family's decoder with its language-model head: see CausalDecoderLM. A family's class sets
    LAYER_CLASS."""


# ---------------------------------------------------------------------------------------------------------------------
# The checkpoint layout: each expert's projections as nn.Linear weights of their own, as save_pretrained writes them.


def is_expert_kernel(path: tuple) -> bool:
    return len(path) >= 2 and path[-2] == "experts"


def expert_names(path: tuple, experts: int) -> list[str]:
    """('model', 'layers_0', 'mlp', 'experts', 'gate_proj') -> model.layers.0.mlp.experts.N.gate_proj.weight."""
    prefix = common.hf_name((*path[:-1], "bias"))[: -len(".bias")]
    return [f"{prefix}.{expert}.{path[-1]}.weight" for expert in range(experts)]


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """The parameters as the transformers checkpoint names and lays them out (float32 numpy): common.py's mapping,
    and each expert's slice of the stacked (experts, in, out) kernels as an nn.Linear weight (out, in) of its own."""
    flat = flatten_dict(params)
    state_dict = common.to_hf_state_dict(unflatten_dict({p: v for p, v in flat.items() if not is_expert_kernel(p)}))
    for path, value in flat.items():
        if is_expert_kernel(path):
            value = np.asarray(value, dtype=np.float32)
            for name, kernel in zip(expert_names(path, value.shape[0]), value):
                state_dict[name] = np.ascontiguousarray(kernel.T)
    return state_dict


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone."""
    flat = flatten_dict(params)
    shapes = common.hf_shapes(unflatten_dict({p: v for p, v in flat.items() if not is_expert_kernel(p)}))
    for path, value in flat.items():
        if is_expert_kernel(path):
            shapes |= {name: tuple(value.shape[:0:-1]) for name in expert_names(path, value.shape[0])}
    return shapes


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params`, placed as they are laid out (common.py's
    from_hf_state_dict); each expert's tensors are stacked into the kernel of all."""
    flat = flatten_dict(abstract_params)
    params, used = {}, set()
    for path, expected in flat.items():
        if not is_expert_kernel(path):
            continue
        names = expert_names(path, expected.shape[0])
        if missing := [name for name in names if name not in state_dict]:
            raise UsageError(f"the checkpoint has no tensor {missing[0]}; it does not match the model config")
        for name in names:
            if state_dict[name].shape != expected.shape[:0:-1]:
                raise UsageError(
                    f"checkpoint tensor {name} has shape {state_dict[name].shape} but the config needs "
                    f"{expected.shape[:0:-1]}; pass the config the checkpoint was trained with"
                )
        stacked = np.stack([np.asarray(state_dict[name], dtype=expected.dtype).T for name in names])
        params[path] = jax.device_put(stacked, getattr(expected, "sharding", None))
        used.update(names)
    rest = common.from_hf_state_dict(
        {name: tensor for name, tensor in state_dict.items() if name not in used},
        unflatten_dict({path: value for path, value in flat.items() if not is_expert_kernel(path)}),
    )
    return unflatten_dict(flatten_dict(rest) | params)


def moe_architecture_shapes(config, variant: MoeVariant) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of the family's transformers class of `config` as save_pretrained writes
    them, without a tied lm_head; from the config alone."""
    width, head_dim = config.hidden_size, head_dim_of(config)
    heads, key_value_heads = config.num_attention_heads, config.num_key_value_heads
    projections_bias, output_bias = variant.projection_biases(config)

    def gated_mlp(prefix: str, names: tuple, inner: int) -> dict:
        gate, up, down = names
        shapes = linear_shapes(f"{prefix}.{gate}", width, inner, False)
        shapes |= linear_shapes(f"{prefix}.{up}", width, inner, False)
        return shapes | linear_shapes(f"{prefix}.{down}", inner, width, False)

    def layer_shapes(layer: str) -> dict:
        attention = f"{layer}.self_attn"
        shapes = linear_shapes(f"{attention}.q_proj", width, heads * head_dim, projections_bias)
        shapes |= linear_shapes(f"{attention}.k_proj", width, key_value_heads * head_dim, projections_bias)
        shapes |= linear_shapes(f"{attention}.v_proj", width, key_value_heads * head_dim, projections_bias)
        shapes |= linear_shapes(f"{attention}.o_proj", heads * head_dim, width, output_bias)
        if variant.head_norm == "each head":
            shapes |= {f"{attention}.q_norm.weight": (head_dim,), f"{attention}.k_norm.weight": (head_dim,)}
        elif variant.head_norm == "all heads":
            shapes |= {
                f"{attention}.q_norm.weight": (heads * head_dim,),
                f"{attention}.k_norm.weight": (key_value_heads * head_dim,),
            }
        if variant.sparse_layer(config, int(layer.rsplit(".", 1)[1])):
            moe, experts = f"{layer}.{variant.moe_name}", variant.num_experts(config)
            shapes[f"{moe}.gate.weight"] = (experts, width)
            for expert in range(experts):
                shapes |= gated_mlp(f"{moe}.experts.{expert}", variant.expert_names, variant.expert_inner(config))
            if shared_inner := variant.shared_inner(config):
                shapes |= gated_mlp(f"{moe}.shared_expert", ("gate_proj", "up_proj", "down_proj"), shared_inner)
                shapes[f"{moe}.shared_expert_gate.weight"] = (1, width)
        else:
            shapes |= gated_mlp(f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj"), config.intermediate_size)
        norms = ("input_layernorm", "post_attention_layernorm")
        return shapes | {f"{layer}.{norm}.weight": (width,) for norm in norms}

    return decoder_shapes(config, layer_shapes)


def parameter_counts(config, variant: MoeVariant) -> tuple[int, int]:
    """(parameters, those active for a token) of the family's model of `config`, from its checkpoint's tensors
    (moe_architecture_shapes): a token uses num_experts_per_tok of each MoE layer's experts, and every other
    parameter."""
    experts, total, active = variant.num_experts(config), 0, 0
    for name, shape in moe_architecture_shapes(config, variant).items():
        size = math.prod(shape)
        total += size
        active += size * config.num_experts_per_tok // experts if ".experts." in name else size
    return total, active
