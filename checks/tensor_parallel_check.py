"""Train a tiny GPT-2, Llama, Gemma 3 and OLMo 2 (the CLM script's step) and a tiny RoBERTa (the MLM script's step) a
few steps on one device and on meshes of 8 devices, and print, as one JSON line, each mesh's losses, its largest weight
difference from one device, and how much of each parameter one device holds.

Run by tests/end_to_end/test_tensor_parallel.py in a process of its own with 8 forced CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python checks/tensor_parallel_check.py data=8 tensor=8 ...
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax.traverse_util import flatten_dict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import run_clm_flax  # noqa: E402
import run_mlm_flax  # noqa: E402
from flax_lm.devices.mesh import BATCH_AXES, MESH_AXES, create_mesh  # noqa: E402
from flax_lm.models.gemma.model import FlaxGemmaForCausalLM  # noqa: E402
from flax_lm.models.gpt2.model import FlaxGPT2LMHeadModel  # noqa: E402
from flax_lm.models.llama.model import FlaxLlamaForCausalLM  # noqa: E402
from flax_lm.models.mixtral.model import FlaxMixtralForCausalLM  # noqa: E402
from flax_lm.models.olmo2.model import FlaxOlmo2ForCausalLM  # noqa: E402
from flax_lm.models.roberta.model import FlaxRobertaForMaskedLM  # noqa: E402
from flax_lm.training.train_state import abstract_train_state, create_train_state  # noqa: E402

STEPS, MICRO_BATCHES, ROWS, LENGTH, VOCAB = 3, 2, 16, 16, 512
# Beside AdamW (every mesh above): Muon orthogonalises whole matrices that the mesh splits, Adafactor keeps factored
# second moments of another shape than the parameters' (Lion's one momentum is split as AdamW's moments are).
OPTIMIZERS, OPTIMIZER_MESH = ("muon", "adafactor"), "data=2,fsdp=2,tensor=2"
# Dropout on everywhere: the meshes agree only if every device draws the masks one device would. One layer in the
# models whose layers are all alike: a second splits nothing the first does not, and compiling is most of this
# check's time, a layer's part of it a third.
GPT2 = transformers.GPT2Config(
    vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=1, n_head=8, bos_token_id=0, eos_token_id=0
)
# Grouped-query attention: 16 heads over 8 key/value heads, both split by tensor=8.
LLAMA = transformers.LlamaConfig(
    vocab_size=VOCAB, max_position_embeddings=LENGTH, hidden_size=64, num_hidden_layers=1, num_attention_heads=16,
    num_key_value_heads=8, intermediate_size=128, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
)  # fmt: skip
# The same heads in the other decoders: Gemma 3 with a sliding window and soft-capped attention besides its
# normalized heads, OLMo 2 with its norm over all the heads of a projection (split over the tensor axis). Gemma has
# two layers, one of each kind.
DECODER_SHAPES = dict(
    vocab_size=VOCAB, max_position_embeddings=LENGTH, hidden_size=64, num_hidden_layers=1, num_attention_heads=16,
    num_key_value_heads=8, intermediate_size=128, bos_token_id=0, eos_token_id=1,
)  # fmt: skip
GEMMA = transformers.Gemma3TextConfig(
    **{**DECODER_SHAPES, "num_hidden_layers": 2}, head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
    attn_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
OLMO2 = transformers.Olmo2Config(**DECODER_SHAPES)
FAMILIES_TENSOR_ONLY = ("gemma", "olmo2")
# A mixture of experts (8 of them, 2 per token, the router's aux loss trained on) meets the expert axis beside the
# three others: each device holds half the experts, halved by fsdp and tensor. Its step without remat or
# micro-batches, which the other models check: the plain step compiles faster.
MIXTRAL = transformers.MixtralConfig(
    **DECODER_SHAPES, num_local_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1
)
EXPERT_MESH, PLAIN_STEP = "fsdp=2,expert=2,tensor=2", {"remat_policy": None, "micro_batches": 1}
# GPT-2 alone also meets FSDP over every device: the state divided eight ways (the batch over data and fsdp together is
# the mesh of all three axes').
FSDP_MESH = "fsdp=8"
ROBERTA = transformers.RobertaConfig(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=8, intermediate_size=128,
    max_position_embeddings=LENGTH + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
)  # fmt: skip


def batches(script, micro_batches):
    """The global batches of every step, (micro-batch, row, ...)."""
    rng = np.random.default_rng(0)
    shape = (micro_batches, ROWS // micro_batches)
    for _ in range(STEPS):
        input_ids = rng.integers(3, VOCAB, size=(*shape, LENGTH), dtype=np.int32)
        if script is run_clm_flax:
            yield {"input_ids": input_ids}
            continue
        predictions = 4
        positions = np.stack([rng.permutation(LENGTH)[:predictions] for _ in range(ROWS)]).reshape(*shape, -1)
        yield {
            "input_ids": input_ids,
            "attention_mask": np.ones_like(input_ids),
            "masked_positions": positions.astype(np.int32),
            "masked_labels": rng.integers(3, VOCAB, size=positions.shape, dtype=np.int32),
            "masked_weights": np.ones(positions.shape, np.float32),
        }


def train(
    script, model_class, config, mesh, optim="adamw", remat_policy="nothing_saveable", micro_batches=MICRO_BATCHES
):
    """(losses, final parameters on the host, the share of each parameter the first device holds, the share of the
    optimizer state's bytes it holds, and of the bytes of the parameters and the optimizer state together)."""
    model = model_class(config, remat_policy=remat_policy, mesh=mesh)
    args = script.TrainingArguments(
        output_dir="unused", optim=optim, learning_rate=1e-2, weight_decay=0.1, adam_epsilon=1e-3
    )
    schedule = script.learning_rate_schedule(args.optimizer_settings(), 10)
    optimizer = script.create_optimizer(args.optimizer_settings(), schedule)
    dummy = jnp.zeros((1, LENGTH), jnp.int32)
    abstract = abstract_train_state(model, optimizer, mesh, dummy)
    state = create_train_state(model, optimizer, abstract, 0, dummy)
    shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, BATCH_AXES))
    step = jax.jit(
        script.make_train_step(model, optimizer, schedule, 0),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=(0,),
    )
    first_device = mesh.devices.flat[0]
    shares = {
        "/".join(path): next(s.data.size for s in leaf.addressable_shards if s.device == first_device) / leaf.size
        for path, leaf in flatten_dict(state.params).items()
    }

    def share_of_bytes(tree) -> float:
        leaves = jax.tree_util.tree_leaves(tree)
        here = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == first_device)
        return here / sum(leaf.nbytes for leaf in leaves)

    state_share, bytes_share = share_of_bytes(state.opt_state), share_of_bytes((state.params, state.opt_state))
    losses = []
    for batch in batches(script, micro_batches):
        state, metrics = step(state, jax.device_put(batch, batch_sharding))
        count = metrics["token_count"] if "token_count" in metrics else metrics["weight_sum"]
        losses.append(float(metrics["loss_sum"] / count))
    return losses, jax.tree_util.tree_map(np.asarray, state.params), shares, state_share, bytes_share


def without_key_bias(params) -> dict:
    """The parameters but the keys' bias: its gradient is zero but for rounding (the softmax over the keys ignores a
    shift shared by all), which Lion's sign and Adafactor's normalisation make into steps of full size that differ
    with the order of the sums, from one device to a mesh."""
    keys = slice(GPT2.n_embd, 2 * GPT2.n_embd)
    return {
        path: np.delete(value, keys) if path.endswith("attn/c_attn/bias") else value
        for path, value in flatten_dict(params, sep="/").items()
    }


def results_of(losses, params, shares, state_share, bytes_share, reference_params) -> dict:
    differences = jax.tree_util.tree_map(lambda a, b: float(np.max(np.abs(a - b))), params, reference_params)
    return {
        "losses": losses,
        "largest_weight_difference": max(jax.tree_util.tree_leaves(differences)),
        "shares": shares,
        "state_share": state_share,
        "bytes_share": bytes_share,
    }


def main():
    one_device = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), MESH_AXES)
    results = {}
    mesh_shapes = {"clm": [*sys.argv[1:], FSDP_MESH], **dict.fromkeys(FAMILIES_TENSOR_ONLY, ["tensor=8"])}
    mesh_shapes["mixtral"] = [EXPERT_MESH]
    for name, script, model_class, config in (
        ("clm", run_clm_flax, FlaxGPT2LMHeadModel, GPT2),
        ("llama", run_clm_flax, FlaxLlamaForCausalLM, LLAMA),
        ("gemma", run_clm_flax, FlaxGemmaForCausalLM, GEMMA),
        ("olmo2", run_clm_flax, FlaxOlmo2ForCausalLM, OLMO2),
        ("mixtral", run_clm_flax, FlaxMixtralForCausalLM, MIXTRAL),
        ("mlm", run_mlm_flax, FlaxRobertaForMaskedLM, ROBERTA),
    ):
        options = PLAIN_STEP if name == "mixtral" else {}
        reference_losses, reference_params, *_ = train(script, model_class, config, one_device, **options)
        results[name] = {"one device": {"losses": reference_losses}}
        # The other decoders meet the mesh where their heads are: split one key/value head to a device.
        for mesh_shape in mesh_shapes.get(name, sys.argv[1:]):
            trained = train(script, model_class, config, create_mesh(mesh_shape), **options)
            results[name][mesh_shape] = results_of(*trained, reference_params)
    # The other optimizers of --optim, on the mesh of all three axes. Their update follows the gradient's sum, which
    # comes with the same shardings with or without remat and micro-batches (AdamW's runs above check those on this
    # mesh): the plain step is compiled faster.
    for optim in OPTIMIZERS:
        reference_losses, reference_params, *_ = train(
            run_clm_flax, FlaxGPT2LMHeadModel, GPT2, one_device, optim, remat_policy=None, micro_batches=1
        )
        losses, params, *shares = train(
            run_clm_flax, FlaxGPT2LMHeadModel, GPT2, create_mesh(OPTIMIZER_MESH), optim, remat_policy=None,
            micro_batches=1,
        )  # fmt: skip
        results[f"clm {optim}"] = {
            "one device": {"losses": reference_losses},
            OPTIMIZER_MESH: results_of(losses, without_key_bias(params), *shares, without_key_bias(reference_params)),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
