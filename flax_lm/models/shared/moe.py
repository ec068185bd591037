"""The mixture-of-experts layer the MoE families share: a router that picks each token's k experts (softmax top-k, its
weights renormalised or not; DeepSeek-V3's sigmoid scores with a correction bias and group-limited top-k), and the
experts computed DROPLESS: every token reaches its k experts, the (token, expert) pairs sorted by expert and each
expert's rows multiplied by its kernels alone, as a group of jax.lax.ragged_dot or, on a CPU, as blocks of rows (no
capacity, no token dropped, no product of every token with every expert); over a mesh with an expert axis, the
experts split over its devices and the tokens exchanged between them by all-to-all. The all-experts dense formulation
(every expert on every token, weighted by the router's zeros and weights) is kept beside it: the reference the tests
compare with, and what benchmarks/benchmark_moe.py measures against. Then the router's auxiliary losses as transformers
computes them (load_balancing_loss: Switch Transformer's, transformers' load_balancing_loss_func) and the router z-loss
(ST-MoE).

The router logits of each MoE layer are sown into the "intermediates" collection ("router_logits"), which costs
nothing unless the caller asks for the collection (model.apply(..., mutable=["intermediates"])): how a training
objective adds the auxiliary losses."""

import copy
import math
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec

from flax_lm.devices.mesh import LOGICAL_AXIS_RULES
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import ACTIVATIONS, DecoderPart

# How the experts are computed: dropless grouped products (the default), or every expert on every token.
IMPLEMENTATIONS = ("dropless", "dense")
# How the router scores experts: a softmax over them (Mixtral, Qwen-MoE, OLMoE), or a sigmoid each (DeepSeek-V3).
SCORING_FUNCTIONS = ("softmax", "sigmoid")
# The mesh axes a batch's rows are split over: the devices between which expert_parallel_experts exchanges tokens are
# those of the expert axis, the others computing their rows apart.
TOKEN_AXES = dict(LOGICAL_AXIS_RULES)["batch"]


def check_routing(num_experts: int, top_k: int, scoring: str = "softmax", groups: int = 1, top_groups: int = 1):
    """Refuse, in one line each, a routing the layer cannot compute: more experts per token than there are, an
    unknown scoring function, groups that do not divide the experts or fewer groups than those chosen."""
    if not 1 <= top_k <= num_experts:
        raise UsageError(
            f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts}); fix the config"
        )
    if scoring not in SCORING_FUNCTIONS:
        raise UsageError(f"scoring_func '{scoring}' is not implemented; use one of {', '.join(SCORING_FUNCTIONS)}")
    if num_experts % groups or not 1 <= top_groups <= groups or top_k > top_groups * (num_experts // groups):
        raise UsageError(
            f"n_group {groups} with topk_group {top_groups} cannot route {top_k} of {num_experts} experts: the groups "
            "must divide the experts and the chosen groups hold at least num_experts_per_tok experts; fix the config"
        )


def route(
    logits, top_k: int, renormalize: bool, scoring: str = "softmax", correction_bias=None, groups: int = 1,
    top_groups: int = 1, scale: float = 1.0,
):  # fmt: skip
    """(expert ids (tokens, k) int32, their weights (tokens, k) float32) of router `logits` (tokens, experts).

    softmax: the k most probable experts, their probabilities the weights (renormalised to sum to 1 with
    `renormalize`: Mixtral, Qwen 3's norm_topk_prob; not: OLMoE, Qwen 2's default). sigmoid (DeepSeek-V3): each
    expert's sigmoid score; the experts are chosen by score + `correction_bias` (the load-balancing bias, which does
    not weigh), within the `top_groups` groups (of `groups` equal groups of experts) whose two best biased scores sum
    highest; the weights are the unbiased scores, renormalised or not, times `scale`."""
    logits = logits.astype(jnp.float32)
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        weights, expert_ids = jax.lax.top_k(scores, top_k)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
        if groups > 1:
            grouped = choice.reshape(*choice.shape[:-1], groups, -1)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # (tokens, groups)
            _, best_groups = jax.lax.top_k(group_scores, top_groups)
            kept = jax.nn.one_hot(best_groups, groups, dtype=bool).any(-2)  # (tokens, groups)
            choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
        _, expert_ids = jax.lax.top_k(choice, top_k)
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return expert_ids.astype(jnp.int32), weights * scale


def dropless_experts(x, expert_ids, weights, gate_kernel, up_kernel, down_kernel, activation: str, grouping=None):
    """sum over each token's k experts of weight * down(act(gate(x)) * up(x)), for x (tokens, width), expert_ids and
    weights (tokens, k), kernels (experts, width, inner) and (experts, inner, width).

    Dropless: the tokens * k (token, expert) pairs are sorted by expert, each expert multiplies its own rows, and the
    outputs are put back in the pairs' order and summed per token; the work is that of the k experts each token uses,
    whatever the balance of the router (the grouped products: grouped_expert_mlp)."""
    tokens, k = expert_ids.shape
    experts = gate_kernel.shape[0]
    pairs = expert_ids.reshape(-1)
    order = jnp.argsort(pairs, stable=True)  # the pairs by expert
    group_sizes = jnp.bincount(pairs, length=experts).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # pair p is token p // k's
    kernels = [kernel.astype(x.dtype) for kernel in (gate_kernel, up_kernel, down_kernel)]
    out = grouped_expert_mlp(rows, group_sizes, *kernels, activation, grouping)
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(tokens, k, -1)  # back in the pairs' order
    return jnp.einsum("tkw,tk->tw", out, weights.astype(x.dtype))


def grouped_expert_mlp(rows, group_sizes, gate_kernel, up_kernel, down_kernel, activation: str, grouping=None):
    """down(act(gate(rows)) * up(rows)) of `rows` sorted by expert, group_sizes of them each, each expert's rows
    multiplied by its kernels alone; rows past the groups come out as zeros where they are zeros (the padding of
    expert_parallel_experts). The grouped products (`grouping`, by default the backend's best): "ragged_dot",
    jax.lax.ragged_dot over the sorted rows, which XLA computes as grouped kernels on GPUs and TPUs but on a CPU as
    every expert over every row (experts times the work); "blocks", each expert's rows padded to whole blocks of rows
    and each block multiplied by its expert's kernels (MegaBlocks' block-sparse layout, as batched products), at most
    about twice the rows' work, which is how a CPU runs it."""
    grouping = grouping or ("blocks" if jax.default_backend() == "cpu" else "ragged_dot")
    if grouping == "blocks":
        return blocked_expert_mlp(rows, group_sizes, gate_kernel, up_kernel, down_kernel, activation)
    gate, up = (jax.lax.ragged_dot(rows, kernel, group_sizes) for kernel in (gate_kernel, up_kernel))
    return jax.lax.ragged_dot(ACTIVATIONS[activation](gate) * up, down_kernel, group_sizes)


def blocked_expert_mlp(rows, group_sizes, gate_kernel, up_kernel, down_kernel, activation: str):
    """down(act(gate(rows)) * up(rows)) of `rows` sorted by expert (group_sizes of them each), each expert's rows
    padded to whole blocks: a block holds one expert's rows (and zeros), and is multiplied by that expert's kernels.
    The block is about the mean rows per expert (8 to 128), so the padding adds at most a block per expert: the
    shapes are static, the work about that of the rows, and the kernels gathered per block about twice their size."""
    count, experts = rows.shape[0], group_sizes.shape[0]
    block = int(min(128, max(8, 2 ** math.ceil(math.log2(max(1, -(-count // experts)))))))
    blocks = -(-(count + experts * (block - 1)) // block)
    padded_sizes = -(-group_sizes // block) * block
    padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
    starts = jnp.cumsum(group_sizes) - group_sizes
    # Rows past the groups (expert_parallel_experts' padding) are the last expert's, in blocks past its own.
    expert_of_row = jnp.repeat(jnp.arange(experts), group_sizes, total_repeat_length=count)
    slots = padded_starts[expert_of_row] + jnp.arange(count) - starts[expert_of_row]
    padded = jnp.zeros((blocks * block, rows.shape[1]), rows.dtype).at[slots].set(rows, unique_indices=True)
    # A block's expert: the last whose padded rows start at or before it (the blocks past them all: the last expert's,
    # multiplying zeros).
    block_expert = jnp.searchsorted(padded_starts + padded_sizes, jnp.arange(blocks) * block, side="right")
    block_expert = jnp.minimum(block_expert, experts - 1)
    padded = padded.reshape(blocks, block, -1)

    def product(y, kernel):
        return jnp.einsum("bri,bio->bro", y, jnp.take(kernel, block_expert, axis=0))

    hidden = ACTIVATIONS[activation](product(padded, gate_kernel)) * product(padded, up_kernel)
    return product(hidden, down_kernel).reshape(blocks * block, -1)[slots]


def dense_experts(x, expert_ids, weights, gate_kernel, up_kernel, down_kernel, activation: str):
    """What dropless_experts computes, as every expert on every token weighted by the router (zero for the experts a
    token does not use): experts / k times the work and memory. The reference."""
    experts = gate_kernel.shape[0]
    combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(expert_ids, experts, dtype=x.dtype), weights.astype(x.dtype))
    gate = jnp.einsum("tw,ewi->tei", x, gate_kernel.astype(x.dtype))
    up = jnp.einsum("tw,ewi->tei", x, up_kernel.astype(x.dtype))
    out = jnp.einsum("tei,eiw->tew", ACTIVATIONS[activation](gate) * up, down_kernel.astype(x.dtype))
    return jnp.einsum("tew,te->tw", out, combine)


EXPERTS = {"dropless": dropless_experts, "dense": dense_experts}


def exchanges_tokens(mesh, tokens: int) -> bool:
    """Whether the dropless experts of `tokens` rows are computed by expert_parallel_experts over `mesh`: one with an
    expert axis of more than one device, and rows that the batch's mesh axes divide (a batch they do not, as a
    generation's odd number of prompts, is computed by dropless_experts, as XLA lays it out)."""
    if mesh is None or mesh.shape.get("expert", 1) == 1:
        return False
    return tokens % math.prod(mesh.shape[axis] for axis in TOKEN_AXES) == 0


def expert_parallel_experts(x, expert_ids, weights, gate_kernel, up_kernel, down_kernel, activation: str, mesh):
    """What dropless_experts computes, with the experts split over the expert axis of `mesh` (each device holding
    experts / E of them) and the tokens exchanged between its devices (expert parallelism, as GShard): each device
    sends each (token, expert) pair of its rows to the device holding the expert, in one all-to-all, multiplies the
    pairs it receives by its experts (grouped_expert_mlp) and sends the outputs back in a second; with a tensor
    axis, each device of a tensor group its share of the experts' inner columns, the outputs summed over the group.

    Dropless with static shapes: a device may receive every pair of every device for its experts, so each device
    sends every other a fixed buffer of the most pairs it can send one (its tokens times min(k, experts per device),
    a token's k experts being distinct), the unused rows zeros. An all-to-all of ragged sizes
    (jax.lax.ragged_all_to_all) would send the pairs alone, but XLA:CPU does not compile it, and its receiving
    buffer would be as large. The fixed buffer costs E * min(k, experts / E) / k times the pairs' traffic and
    memory, and on a CPU the blocks' products over the whole received buffer: E * min(k, experts / E) / k times the
    experts' work of dropless_experts (docs/model-families.md has the figures)."""
    devices, tensor = mesh.shape["expert"], mesh.shape.get("tensor", 1)
    inner_axis = "tensor" if gate_kernel.shape[-1] % tensor == 0 and tensor > 1 else None
    rows_spec = PartitionSpec(TOKEN_AXES, None)

    def on_each_device(x, expert_ids, weights, gate_kernel, up_kernel, down_kernel):
        tokens, k = expert_ids.shape
        local_experts, width = gate_kernel.shape[0], x.shape[-1]
        room = tokens * min(k, local_experts)  # the most pairs one device can send another
        pairs = expert_ids.reshape(-1)  # pair p is token p // k's
        destination = pairs // local_experts
        queued = jax.nn.one_hot(destination, devices, dtype=jnp.int32)
        place = jnp.sum((jnp.cumsum(queued, axis=0) - 1) * queued, axis=-1)  # each pair's place among those sent
        slots = destination * room + place
        sent = jnp.zeros((devices * room, width), x.dtype).at[slots].set(jnp.repeat(x, k, axis=0), unique_indices=True)
        # Each row's expert among the receiver's, and past them (local_experts) for the unused rows.
        sent_experts = jnp.full(devices * room, local_experts, jnp.int32).at[slots].set(pairs % local_experts)
        received, received_experts = (jax.lax.all_to_all(y, "expert", 0, 0, tiled=True) for y in (sent, sent_experts))
        order = jnp.argsort(received_experts, stable=True)  # the rows by expert, the unused ones last
        group_sizes = jnp.bincount(received_experts, length=local_experts).astype(jnp.int32)
        kernels = [kernel.astype(x.dtype) for kernel in (gate_kernel, up_kernel, down_kernel)]
        out = grouped_expert_mlp(jnp.take(received, order, axis=0), group_sizes, *kernels, activation)
        out = jnp.take(out, jnp.argsort(order), axis=0)  # in the order received, to be sent back so
        out = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)
        y = jnp.einsum("tkw,tk->tw", jnp.take(out, slots, axis=0).reshape(tokens, k, width), weights.astype(x.dtype))
        return jax.lax.psum(y, inner_axis) if inner_axis else y

    inward, outward = PartitionSpec("expert", None, inner_axis), PartitionSpec("expert", inner_axis, None)
    computed = jax.shard_map(
        on_each_device, mesh=mesh, in_specs=(rows_spec, rows_spec, rows_spec, inward, inward, outward),
        out_specs=rows_spec,
    )  # fmt: skip
    return computed(x, expert_ids, weights, gate_kernel, up_kernel, down_kernel)


def routed_experts(x, expert_ids, weights, kernels, activation: str, implementation: str, mesh=None):
    """The MoE layers' experts of `implementation` (EXPERTS) over rows `x`: dropless ones over a mesh with an expert
    axis exchange the tokens between its devices (expert_parallel_experts) where the rows allow it."""
    if implementation == "dropless" and exchanges_tokens(mesh, x.shape[0]):
        return expert_parallel_experts(x, expert_ids, weights, *kernels, activation, mesh)
    return EXPERTS[implementation](x, expert_ids, weights, *kernels, activation)


def capacity_experts(x, expert_ids, weights, gate_kernel, up_kernel, down_kernel, activation: str, factor: float):
    """(what dropless_experts computes, but for the pairs over capacity, the fraction of pairs dropped): the classic
    fixed-capacity dispatch (GShard, Switch Transformer), for comparison with the dropless default. Each expert takes
    at most ceil(factor * tokens * k / experts) of the (token, expert) pairs, the earlier tokens first; a dropped
    pair adds nothing to its token (the residual carries it). The kept rows are copied into one buffer of capacity
    rows per expert, each expert multiplies its buffer (its work and memory fixed by the factor, whatever the
    router does) and the rows are gathered back."""
    tokens, k = expert_ids.shape
    experts, width = gate_kernel.shape[0], x.shape[-1]
    capacity = max(1, math.ceil(factor * tokens * k / experts))
    pairs = expert_ids.reshape(-1)  # token by token: the earlier tokens are queued first
    queued = jax.nn.one_hot(pairs, experts, dtype=jnp.int32)
    place = jnp.sum((jnp.cumsum(queued, axis=0) - 1) * queued, axis=-1)  # each pair's place in its expert's queue
    kept = place < capacity
    slots = jnp.where(kept, pairs * capacity + place, experts * capacity)  # a dropped pair's slot: past the end
    rows = jnp.zeros((experts * capacity, width), x.dtype).at[slots].set(jnp.repeat(x, k, axis=0), mode="drop")
    rows = rows.reshape(experts, capacity, width)
    kernels = [kernel.astype(x.dtype) for kernel in (gate_kernel, up_kernel, down_kernel)]
    gate, up = (jnp.einsum("ecw,ewi->eci", rows, kernel) for kernel in kernels[:2])
    out = jnp.einsum("eci,eiw->ecw", ACTIVATIONS[activation](gate) * up, kernels[2]).reshape(-1, width)
    out = jnp.take(out, slots, axis=0, mode="fill", fill_value=0).reshape(tokens, k, width)
    return jnp.einsum("tkw,tk->tw", out, weights.astype(x.dtype)), 1.0 - jnp.mean(kept.astype(jnp.float32))


def load_balancing_loss(router_logits, num_experts: int, top_k: int, mask=None):
    """Switch Transformer's load-balancing loss as transformers' load_balancing_loss_func computes it over the router
    logits of every MoE layer (a sequence of (tokens, experts) arrays): num_experts * sum over experts of (the number
    of times it is chosen per token) * (its mean router probability), the tokens of every layer pooled; with `mask`
    (tokens,), only the tokens it marks count (padding does not). top_k for a perfectly even router, up to num_experts
    for one that gives every token to one expert; the training loss adds it times router_aux_loss_coef."""
    counts = jnp.zeros(num_experts, jnp.float32)
    probabilities = jnp.zeros(num_experts, jnp.float32)
    rows = 0.0
    for logits in router_logits:
        logits = logits.reshape(-1, num_experts).astype(jnp.float32)
        weight = jnp.ones(logits.shape[0], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
        scores = jax.nn.softmax(logits, axis=-1)
        _, chosen = jax.lax.top_k(scores, top_k)
        counts = counts + jnp.einsum("tke,t->e", jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), weight)
        probabilities = probabilities + jnp.einsum("te,t->e", scores, weight)
        rows = rows + weight.sum()
    return num_experts * jnp.sum((counts / rows) * (probabilities / rows))


def router_z_loss(router_logits, mask=None):
    """ST-MoE's router z-loss: the mean over tokens (those `mask` marks) and MoE layers of logsumexp(logits)^2, which
    keeps the router logits small (a flag of run_clm_flax.py weighs it)."""
    losses = []
    for logits in router_logits:
        squared = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1).reshape(-1) ** 2
        weight = jnp.ones_like(squared) if mask is None else mask.reshape(-1).astype(jnp.float32)
        losses.append(jnp.sum(squared * weight) / jnp.maximum(weight.sum(), 1.0))
    return jnp.mean(jnp.stack(losses))


# The config attribute of the train step's model under run_clm_flax.py --moe_capacity_factor (with_capacity): not a
# key of a config file, which would make the evaluation and the exports drop tokens too (the MoE decoder refuses it).
CAPACITY_KEY = "moe_capacity_factor"


def with_capacity(model, factor: float | None):
    """`model` with its MoE layers computing capacity_experts of `factor` (a copy of its config says so): the train
    step's model under --moe_capacity_factor; the model itself (what evaluation, sampling and exports compute) stays
    dropless. The model itself where `factor` is 0 or None."""
    if not factor:
        return model
    config = copy.copy(model.config)
    setattr(config, CAPACITY_KEY, factor)
    return model.clone(config=config)


def router_logits_by_layer(intermediates) -> dict:
    """{"layer_3": its router logits (tokens, experts)} of each MoE layer that sowed them into `intermediates` (the
    collection model.apply(..., mutable=["intermediates"]) returns), named by the decoder layer holding it."""
    return sown_by_layer(intermediates, "router_logits")


def sown_by_layer(intermediates, name: str) -> dict:
    """{"layer_3": what its MoE layer sowed as `name`} of each layer that did."""
    by_layer = {}
    for path, sown in flatten_dict(intermediates).items():
        if path[-1] == name:
            layer = next((part for part in path if part.startswith("layers_")), "/".join(path[:-1]))
            by_layer[layer.replace("layers_", "layer_")] = sown[0]
    return by_layer


def router_metric_names(model, dummy_input) -> tuple[str, ...]:
    """The sums router_metric_sums makes for `model` without coefficients (none for a model without routers), from
    the layers its initialisation sows router logits in: traced, not computed."""
    init = partial(model.init, deterministic=True, mutable=True)  # init keeps no intermediates otherwise
    variables = jax.eval_shape(init, jax.random.key(0), dummy_input)
    layers = router_logits_by_layer(variables.get("intermediates", {}))
    if not layers:
        return ()
    per_layer = [f"moe/{layer}/expert_load_{end}" for layer in layers for end in ("max", "min")]
    dropped = [
        f"moe/{layer}/dropped_fraction" for layer in sown_by_layer(variables["intermediates"], "dropped_fraction")
    ]
    return ("moe/load_balancing_loss", "moe/router_z_loss", *per_layer, *dropped)


def router_metric_sums(intermediates, top_k: int, token_count, aux_coefficient=0.0, z_coefficient=0.0) -> dict:
    """What the routers sowed in `intermediates` add to a train step's sums, each times `token_count` as the loss is
    summed, so that the sums of several steps over their tokens are means: to watch the routers (a collapsing one
    sends most tokens to few experts), the load-balancing loss (k for an even router) and router z-loss of all the
    MoE layers, and per layer the largest and smallest fraction of the (token, expert) pairs the layer routed that one
    expert got ("moe/layer_3/expert_load_max"; 1/experts each for an even router): the experts the router sowed
    (expert_ids: DeepSeek-V3's, chosen by its biased scores within groups), else the top-k of its logits; with a
    capacity, the fraction of its (token, expert) pairs it dropped; with a coefficient, that coefficient times the
    loss, which the trained loss adds (router_aux_loss_sum, router_z_loss_sum). Every token counts, as in
    transformers' loss without an attention mask. Empty for a model without routers."""
    by_layer = router_logits_by_layer(intermediates)
    if not by_layer:
        return {}
    experts = next(iter(by_layer.values())).shape[-1]
    balance = load_balancing_loss(by_layer.values(), experts, top_k)
    z_loss = router_z_loss(by_layer.values())
    sums = {"moe/load_balancing_loss": balance * token_count, "moe/router_z_loss": z_loss * token_count}
    chosen_by_layer = sown_by_layer(intermediates, "expert_ids")
    for layer, logits in by_layer.items():
        chosen = chosen_by_layer.get(layer)
        if chosen is None:  # a softmax router's choice: the top-k of its logits
            _, chosen = jax.lax.top_k(logits.reshape(-1, experts).astype(jnp.float32), top_k)
        load = jnp.bincount(chosen.reshape(-1), length=experts) / chosen.size
        sums |= {f"moe/{layer}/expert_load_max": load.max() * token_count}
        sums |= {f"moe/{layer}/expert_load_min": load.min() * token_count}
    for layer, dropped in sown_by_layer(intermediates, "dropped_fraction").items():  # with a capacity
        sums[f"moe/{layer}/dropped_fraction"] = dropped * token_count
    if aux_coefficient:
        sums["router_aux_loss_sum"] = aux_coefficient * balance * token_count
    if z_coefficient:
        sums["router_z_loss_sum"] = z_coefficient * z_loss * token_count
    return sums


class SparseMoeBlock(DecoderPart):
    """A mixture-of-experts MLP: the router ("gate", an nn.Linear of the checkpoint: (experts, width)), the experts'
    gated MLPs (`expert_names`: the checkpoint's names of the gate, up and down projections of each, stored here as one
    (experts, in, out) array each under "experts") and, with `shared_inner`, Qwen 2's shared expert, a gated MLP that
    every token takes, scaled by sigmoid(shared_expert_gate(x))."""

    experts: int = 8
    top_k: int = 2
    inner: int = 0
    renormalize: bool = True
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")
    shared_inner: int | None = None
    implementation: str = "dropless"
    capacity_factor: float | None = None  # capacity_experts in place of the implementation (with_capacity)

    @nn.compact
    def __call__(self, x):
        config = self.config
        batch, length, width = x.shape
        rows = x.reshape(-1, width)
        logits = self.dense(self.experts, ("embed", None), False, "gate")(rows)
        self.sow("intermediates", "router_logits", logits)
        expert_ids, weights = route(logits, self.top_k, self.renormalize)
        kernels = ExpertWeights(
            self.experts, self.inner, width, self.expert_names, config.initializer_range, self.param_dtype,
            name="experts",
        )()  # fmt: skip
        kernels = [kernel.astype(self.dtype) for kernel in kernels]
        if self.capacity_factor:
            y, dropped = capacity_experts(rows, expert_ids, weights, *kernels, config.hidden_act, self.capacity_factor)
            self.sow("intermediates", "dropped_fraction", dropped)
        else:
            y = routed_experts(rows, expert_ids, weights, kernels, config.hidden_act, self.implementation, self.mesh)
        if self.shared_inner:
            shared = self.child(SizedGatedMLP, "shared_expert", inner=self.shared_inner)(rows)
            y = y + jax.nn.sigmoid(self.dense(1, ("embed", None), False, "shared_expert_gate")(rows)) * shared
        return self.constrain(y.reshape(batch, length, width).astype(self.dtype), ("batch", "length", None))


class SizedGatedMLP(DecoderPart):
    """down(act(gate(x)) * up(x)) of `inner` width (common.GatedMLP's is the config's intermediate_size): the
    MoE families' dense layers (Qwen's mlp_only_layers) and Qwen 2's shared expert."""

    inner: int = 0

    @nn.compact
    def __call__(self, x):
        gate = self.dense(self.inner, ("embed", "mlp"), False, "gate_proj")(x)
        up = self.dense(self.inner, ("embed", "mlp"), False, "up_proj")(x)
        hidden = ACTIVATIONS[self.config.hidden_act](gate) * up
        return self.dense(self.config.hidden_size, ("mlp", "embed"), False, "down_proj")(hidden)


class ExpertWeights(nn.Module):
    """The experts' stacked kernels, (experts, width, inner) for the gate and up projections and (experts, inner,
    width) for the down one, named as the checkpoint names each expert's, on the logical "expert" axis."""

    experts: int
    inner: int
    width: int
    names: tuple
    initializer_range: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        def kernel(name, shape, axes):
            init = nn.with_logical_partitioning(nn.initializers.normal(self.initializer_range), axes)
            return self.param(name, init, shape, self.param_dtype)

        gate_name, up_name, down_name = self.names
        inward = ((self.experts, self.width, self.inner), ("expert", "embed", "mlp"))
        return (
            kernel(gate_name, *inward),
            kernel(up_name, *inward),
            kernel(down_name, (self.experts, self.inner, self.width), ("expert", "mlp", "embed")),
        )
