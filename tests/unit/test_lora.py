"""LoRA adapters (flax_lm/training/lora.py): which layers PEFT's module names pick and how they map onto the
transformers model, the adapters' start (PEFT's initialisation: the adapted model computes as the base), the merge,
the adapter files read back, and the flags refused in one line. PEFT's own model on our files:
tests/parity/test_lora_parity.py; a run: tests/end_to_end/test_lora_runs.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from test_arguments import checked_arguments  # noqa: F401 (a fixture)
from test_clm import tiny_config, tiny_llama_config

from flax_lm.errors import UsageError
from flax_lm.models import stock_module
from flax_lm.training import lora

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 12)))


def base_of(config, shapes_only=False):
    """The family's module, its model of `config` and the model's parameters (with `shapes_only`, their shapes)."""
    module = stock_module(config.model_type)
    model = module.MODEL_CLASS(config)
    init = jax.eval_shape(model.init, jax.random.key(0), IDS) if shapes_only else model.init(jax.random.key(0), IDS)
    return module, model, nn.meta.unbox(init["params"])


def test_peft_module_names_pick_the_layers_and_their_transformers_names():
    module, _, params = base_of(tiny_llama_config(), shapes_only=True)
    targets = lora.adapter_targets(params, module, LLAMA_TARGETS)
    names = {target.hf_module for target in targets}
    assert (
        len(targets) == 2 * 7 and "model.layers.1.self_attn.k_proj" in names and "model.layers.0.mlp.up_proj" in names
    )
    k_proj = next(target for target in targets if target.hf_module == "model.layers.0.self_attn.k_proj")
    assert (k_proj.fan_in, k_proj.fan_out, k_proj.fan_in_fan_out) == (32, 16, False)  # one key/value head of 16
    assert {target.path[-1] for target in lora.adapter_targets(params, module, None)} == {"q_proj", "v_proj"}
    with pytest.raises(UsageError, match="^--lora_target_modules c_attn: the model has no layer of that name; its"):
        lora.adapter_targets(params, module, ("q_proj", "c_attn"))
    gpt2, _, gpt2_params = base_of(tiny_config(), shapes_only=True)
    gpt2_targets = lora.adapter_targets(gpt2_params, gpt2, ("c_attn", "c_proj", "c_fc"))
    # GPT-2's Conv1D stores its weight (in, out): PEFT's fan_in_fan_out; c_proj names the attention's and the MLP's.
    assert all(target.fan_in_fan_out for target in gpt2_targets) and len(gpt2_targets) == 2 * 4
    c_attn = next(target for target in gpt2_targets if target.hf_module == "transformer.h.1.attn.c_attn")
    assert (c_attn.fan_in, c_attn.fan_out) == (32, 96)
    assert {target.path[-1] for target in lora.adapter_targets(gpt2_params, gpt2, None)} == {"c_attn"}


def test_new_adapters_start_as_the_base_model_and_merge_into_it_exactly(tmp_path):
    config = tiny_llama_config(tie_word_embeddings=False, num_hidden_layers=1)
    module, model, base_shapes = base_of(config, shapes_only=True)
    settings = lora.LoraSettings(rank=4, alpha=8.0, dropout=0.1, target_modules=LLAMA_TARGETS)
    targets = lora.adapter_targets(base_shapes, module, LLAMA_TARGETS)
    adapted = lora.adapted_model(model, targets, settings, seed=3)
    params = nn.meta.unbox(jax.jit(adapted.init)(jax.random.key(0), IDS)["params"])
    flat = flatten_dict(params)
    q_proj = next(target.path for target in targets if target.path[-1] == "q_proj")
    a, b = flat[(*q_proj, "lora_A")], flat[(*q_proj, "lora_B")]
    # PEFT's start: A uniform within 1/sqrt(in), B zeros.
    assert a.shape == (32, 4) and 0.1 < float(jnp.abs(a).max()) <= 1 / np.sqrt(32) and not jnp.any(b)
    trained = jax.tree_util.tree_map_with_path(
        lambda path, value: value + 0.2 if path[-1].key == "lora_B" else value, params
    )
    merged = lora.merged_params(trained, targets, settings.scale)

    @jax.jit
    def logits(params, trained, merged):  # one compiled program for every comparison
        dropout = {"dropout": jax.random.key(1)}
        return (
            adapted.apply({"params": params}, IDS),
            model.apply({"params": lora.without_adapters(params)}, IDS),
            adapted.apply({"params": trained}, IDS),
            model.apply({"params": merged}, IDS),
            adapted.apply({"params": trained}, IDS, deterministic=False, rngs=dropout),
        )

    new, base, adapted_logits, merged_logits, dropped = logits(params, trained, merged)
    np.testing.assert_array_equal(new, base)  # new adapters: the base model
    assert float(jnp.abs(adapted_logits - base).max()) > 0.1
    np.testing.assert_allclose(merged_logits, adapted_logits, atol=2e-5)
    # Dropout on the adapters' input in training only: evaluation is deterministic.
    assert float(jnp.abs(dropped - adapted_logits).max()) > 1e-3
    # The files PEFT reads, read back as they were written.
    lora.write_adapter(str(tmp_path), trained, targets, settings, "base", "CAUSAL_LM")
    read = lora.read_adapters(str(tmp_path), targets, 4, jnp.float32)
    assert all(
        np.array_equal(read[path], flat_value) for path, flat_value in flatten_dict(trained).items() if path in read
    )
    assert len(read) == 2 * len(targets)
    with pytest.raises(
        UsageError, match="^.*adapter_model.safetensors has no base_model.model.model.layers.0.mlp.down_proj"
    ):
        lora.read_adapters(str(tmp_path), targets, 8, jnp.float32)
    # --lora_adapter: a run continues from the adapter's settings and weights, on the base model's weights.
    continued = lora.adapter_settings(lora.LoraSettings(0, 16.0, 0.0, None, adapter=str(tmp_path)))
    assert (continued.rank, continued.alpha, continued.dropout, continued.target_modules) == (
        4,
        8.0,
        0.1,
        tuple(sorted(LLAMA_TARGETS)),
    )
    adapters = lora.Adapters(continued, tuple(targets), "base", lambda code, shapes: lora.without_adapters(params))
    start = flatten_dict(adapters.start_params(None, params, seed=0))
    assert all(np.array_equal(start[path], value) for path, value in flatten_dict(trained).items())


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--lora_rank", "0"], "--lora_rank 0: an adapter's rank must be at least 1"),
        (["--lora_r", "4", "--model_file", "model.py"], "--lora_rank: adapters train on the layers of a stock model"),
        (["--lora_rank", "4", "--model_name_or_path", ""], "--lora_rank: adapters train on a trained model's weights"),
        (["--lora_rank", "4", "--lora_dropout", "1"], "--lora_dropout 1.0: must be at least 0 and below 1"),
        (["--merge_adapters"], "--lora_target_modules and --merge_adapters apply to adapters: add --lora_rank"),
    ],
)
def test_adapter_flags_that_cannot_apply_are_refused_in_one_line(flags, refusal, checked_arguments, tmp_path):  # noqa: F811
    (tmp_path / "model.py").write_text("")
    base = ["--model_name_or_path", "a-model"] if "--model_name_or_path" not in flags else []
    flags = [str(tmp_path / flag) if flag == "model.py" else flag for flag in flags]
    with pytest.raises(UsageError, match=f"^{refusal}"):
        checked_arguments("run_clm_flax", "--train_file", "train.txt", *base, *flags)


@pytest.mark.parametrize("optim", ["adamw", "lion"])
def test_weight_decay_reaches_the_adapters_as_trainers_does_a_peft_models(optim):
    """transformers' Trainer decays every parameter of a PEFT model but biases and norms, lora_A and lora_B among
    them; the scripts' decay mask names kernels and embeddings, so the optimizer adds the adapters to it. With zero
    gradients an update is the decay alone: -learning rate x weight decay x the parameter."""
    import run_clm_flax

    rng = np.random.default_rng(0)
    shapes = {("q_proj", "kernel"): (4, 6), ("q_proj", "bias"): (6,), ("q_proj", "lora_A"): (4, 2)}
    shapes |= {("q_proj", "lora_B"): (2, 6), ("norm", "scale"): (4,)}
    params = {path: rng.normal(size=shape).astype(np.float32) for path, shape in shapes.items()}
    params = jax.tree_util.tree_map(jnp.asarray, lora.unflatten_dict(params))
    args = run_clm_flax.TrainingArguments(
        output_dir="unused", optim=optim, learning_rate=0.01, weight_decay=0.1, max_grad_norm=0.0
    )
    schedule = run_clm_flax.learning_rate_schedule(args.optimizer_settings(), 10)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    for trains, decayed in [(lora.is_adapter, ("lora_A", "lora_B")), (None, ("kernel", "lora_A", "lora_B"))]:
        optimizer = run_clm_flax.create_optimizer(args.optimizer_settings(), schedule, trains)
        updates, _ = optimizer.update(zeros, optimizer.init(params), params)
        for path, update in flatten_dict(updates).items():
            expected = -0.01 * 0.1 * flatten_dict(params)[path] if path[-1] in decayed else 0 * update
            np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-9, err_msg=f"{trains} {path}")
