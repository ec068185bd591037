"""Scaling options of run_clm_flax.py: gradient accumulation, gradient checkpointing, mixed precision, the mesh shape
(FSDP trains in tests/end_to_end/test_tensor_parallel.py, in the run of the tensor-parallel meshes)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO_DIR
from flax.traverse_util import flatten_dict
from test_clm import run_clm_flax, tiny_config

from flax_lm.devices.mesh import create_mesh
from flax_lm.errors import UsageError
from flax_lm.models import stock_module
from flax_lm.models.gpt2.model import FlaxGPT2LMHeadModel
from flax_lm.training.train_state import abstract_train_state, create_train_state, train_step_compiler_options

LENGTH = 16


def training_parts(config, length=LENGTH, adam_epsilon=1e-8, **model_options):
    """The model of `config`'s type, optimizer, schedule and abstract training state, built as the script builds
    them."""
    model = stock_module(config.model_type).MODEL_CLASS(config, **model_options)
    training_args = run_clm_flax.TrainingArguments(
        output_dir="unused", learning_rate=1e-2, weight_decay=0.1, adam_epsilon=adam_epsilon
    )
    schedule = run_clm_flax.learning_rate_schedule(training_args.optimizer_settings(), total_steps=10)
    optimizer = run_clm_flax.create_optimizer(training_args.optimizer_settings(), schedule)
    dummy_input = jnp.zeros((1, length), jnp.int32)
    abstract_state = abstract_train_state(model, optimizer, create_mesh(), dummy_input)
    return model, optimizer, schedule, abstract_state


def training_setup(config, adam_epsilon=1e-8, **model_options):
    model, optimizer, schedule, abstract_state = training_parts(config, adam_epsilon=adam_epsilon, **model_options)
    dummy_input = jnp.zeros((1, LENGTH), jnp.int32)
    state = create_train_state(model, optimizer, abstract_state, 0, dummy_input)
    train_step = jax.jit(run_clm_flax.make_train_step(model, optimizer, schedule, seed=0))
    return state, train_step


def batch(rows=8, seed=0):
    return np.random.default_rng(seed).integers(0, 512, size=(rows, LENGTH), dtype=np.int32)


def test_accumulated_micro_batches_give_the_update_of_the_whole_batch():
    config = tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    rows = batch(8)
    # Adam's first update is nearly sign(gradient); a larger epsilon keeps it smooth where gradients are
    # close to zero, so float rounding differences in the sums cannot flip it.
    state, train_step = training_setup(config, adam_epsilon=1e-3)  # not donated: both steps start from it
    whole, whole_metrics = train_step(state, {"input_ids": rows[None]})
    accumulated, accumulated_metrics = train_step(state, {"input_ids": rows.reshape(4, 2, LENGTH)})

    assert float(accumulated_metrics["token_count"]) == float(whole_metrics["token_count"]) == 8 * (LENGTH - 1)
    assert float(accumulated_metrics["loss_sum"]) == pytest.approx(float(whole_metrics["loss_sum"]), rel=1e-5)
    assert float(accumulated_metrics["grad_norm"]) == pytest.approx(float(whole_metrics["grad_norm"]), rel=1e-5)
    for got, expected in zip(jax.tree_util.tree_leaves(accumulated.params), jax.tree_util.tree_leaves(whole.params)):
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_the_z_loss_adds_its_coefficient_times_the_mean_squared_log_normalizer_to_the_trained_loss():
    config = tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    rows = batch(4)
    coefficient = 0.1  # large, so that the z-loss's share of the gradient is far above rounding
    model, optimizer, schedule, abstract_state = training_parts(config)
    state = create_train_state(model, optimizer, abstract_state, 0, jnp.zeros((1, LENGTH), jnp.int32))
    train_step = jax.jit(run_clm_flax.make_train_step(model, optimizer, schedule, seed=0, z_loss=coefficient))
    _, metrics = train_step(state, {"input_ids": rows.reshape(2, 2, LENGTH)})  # over 2 micro-batches

    def mean_loss(params, coefficient):  # computed here from the logits: cross-entropy + coefficient * mean(log(Z)^2)
        logits = model.apply({"params": params}, jnp.asarray(rows))[:, :-1].astype(jnp.float32)
        log_normalizers = jax.nn.logsumexp(logits, axis=-1)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(rows[:, 1:]))
        return jnp.mean(cross_entropy) + coefficient * jnp.mean(jnp.square(log_normalizers)), log_normalizers

    gradient = jax.jit(jax.grad(mean_loss, has_aux=True))
    grads, log_normalizers = gradient(state.params, coefficient)
    token_count = float(metrics["token_count"])
    assert token_count == 4 * (LENGTH - 1)
    expected_z_loss = coefficient * float(jnp.mean(jnp.square(log_normalizers)))
    assert float(metrics["z_loss_sum"]) / token_count == pytest.approx(expected_z_loss, rel=1e-5)
    assert run_clm_flax.train_metrics(jax.device_get(metrics))["z_loss"] == pytest.approx(expected_z_loss, rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-4)
    # ... which the cross-entropy's gradient alone would not match.
    cross_entropy_grads, _ = gradient(state.params, 0.0)
    assert float(optax.tree.norm(cross_entropy_grads)) != pytest.approx(float(metrics["grad_norm"]), rel=1e-2)


def label_smoothed_objective(logits, input_ids, weights, z_loss=0.0):
    """causal_lm_objective as a copy edited for label smoothing (0.1) would have it."""
    next_tokens, target_weights = run_clm_flax.next_token_targets(input_ids, weights)
    targets = optax.smooth_labels(jax.nn.one_hot(next_tokens, logits.shape[-1]), 0.1)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
    return {"loss_sum": jnp.sum(losses * target_weights), "token_count": jnp.sum(target_weights)}


def test_an_edit_of_the_training_objective_leaves_the_evaluation_metrics_as_they_were(monkeypatch):
    config = tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_layer=1)
    rows = batch(4)
    model, optimizer, schedule, abstract_state = training_parts(config)
    state = create_train_state(model, optimizer, abstract_state, 0, jnp.zeros((1, LENGTH), jnp.int32))
    token_bytes = np.random.default_rng(0).integers(1, 5, config.vocab_size)  # for bits per byte

    def evaluation():
        """The evaluation's results on `rows`, from the script as it is now."""
        eval_step = jax.jit(run_clm_flax.make_eval_step(model, token_bytes))
        sums = eval_step(state.params, {"input_ids": rows, "weights": np.ones(rows.shape, np.float32)})
        return run_clm_flax.evaluation_results(jax.device_get(sums))

    evaluated = evaluation()
    monkeypatch.setattr(run_clm_flax, "causal_lm_objective", label_smoothed_objective)
    assert set(evaluated) >= {"loss", "perplexity", "bits_per_byte"}
    assert evaluation() == evaluated  # bit for bit
    # What the train step trains on and logs as train/loss: the smoothed loss, not the cross-entropy.
    _, metrics = jax.jit(run_clm_flax.make_train_step(model, optimizer, schedule, seed=0))(
        state, {"input_ids": rows[None]}
    )
    edited_objective = label_smoothed_objective(model.apply({"params": state.params}, rows), rows, np.ones(rows.shape))
    assert float(metrics["loss_sum"]) == pytest.approx(float(edited_objective["loss_sum"]), rel=1e-6)
    assert float(metrics["loss_sum"]) / evaluated["tokens"] != pytest.approx(evaluated["loss"], rel=1e-5)


def outside_the_first_block(path, param) -> bool:
    """The is_trained of a copy edited to freeze GPT-2's first block."""
    return "h_0" not in [entry.key for entry in path]


def matrix_products(train_step, abstract_state) -> int:
    """The matrix products of a train step of one batch of 4 rows, as traced (before the compiler removes any)."""
    jaxpr = jax.make_jaxpr(train_step)(abstract_state, {"input_ids": jax.ShapeDtypeStruct((1, 4, LENGTH), jnp.int32)})
    return str(jaxpr).count("dot_general")


def state_bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def test_a_frozen_parameter_is_not_differentiated_updated_given_optimizer_state_or_counted_in_the_norm(monkeypatch):
    config = tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_layer=1)
    rows = batch(4)
    model, optimizer, schedule, every_parameter = training_parts(config)
    products_of_every_parameter = matrix_products(
        run_clm_flax.make_train_step(model, optimizer, schedule, 0), every_parameter
    )
    monkeypatch.setattr(run_clm_flax, "is_trained", outside_the_first_block)
    model, optimizer, schedule, abstract_state = training_parts(config)
    state = create_train_state(model, optimizer, abstract_state, 0, jnp.zeros((1, LENGTH), jnp.int32))
    train_step = run_clm_flax.make_train_step(model, optimizer, schedule, seed=0)
    new_state, metrics = jax.jit(train_step)(state, {"input_ids": rows.reshape(2, 2, LENGTH)})  # 2 micro-batches

    first_block, new_first_block = state.params["transformer"]["h_0"], new_state.params["transformer"]["h_0"]
    for before, after in zip(jax.tree_util.tree_leaves(first_block), jax.tree_util.tree_leaves(new_first_block)):
        np.testing.assert_array_equal(after, before)
    trained_kernel = ("transformer", "wpe", "embedding")
    assert not np.array_equal(
        flatten_dict(new_state.params)[trained_kernel], flatten_dict(state.params)[trained_kernel]
    )

    # The norm logged (and clipped to --max_grad_norm): that of the trained parameters' gradients alone.
    def mean_loss(params):
        logits = model.apply({"params": params}, jnp.asarray(rows))[:, :-1].astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(rows[:, 1:])))

    grads = jax.jit(jax.grad(mean_loss))(state.params)
    trained_grads = {**grads, "transformer": {**grads["transformer"], "h_0": {}}}
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(trained_grads)), rel=1e-5)
    assert float(metrics["grad_norm"]) < float(optax.tree.norm(grads)) * (1 - 1e-3)
    # No optimizer state for the frozen block: AdamW's two moments of each of its parameters are gone.
    assert state_bytes(every_parameter.opt_state) - state_bytes(new_state.opt_state) == 2 * state_bytes(first_block)
    # Its weights' gradients are not computed: a matrix product fewer for each of its 4 kernels (the attention's and
    # the MLP's two each).
    assert matrix_products(train_step, abstract_state) == products_of_every_parameter - 4


def test_gradient_checkpointing_keeps_loss_and_gradients():
    config = tiny_config()  # with dropout: the recomputed blocks must draw the same masks
    rows = {"input_ids": batch(4)[None]}
    state, train_step = training_setup(config)
    plain, plain_metrics = train_step(state, rows)
    for policy in ["nothing_saveable", "dots_with_no_batch_dims_saveable"]:
        state, train_step = training_setup(config, remat_policy=policy)
        remat, remat_metrics = train_step(state, rows)
        assert float(remat_metrics["loss_sum"]) == pytest.approx(float(plain_metrics["loss_sum"]), rel=1e-6), policy
        assert float(remat_metrics["grad_norm"]) == pytest.approx(float(plain_metrics["grad_norm"]), rel=1e-5), policy
        for got, expected in zip(jax.tree_util.tree_leaves(remat.params), jax.tree_util.tree_leaves(plain.params)):
            np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=policy)


def test_gradient_checkpointing_lowers_the_step_memory():
    """Compiled with the script's options, as it trains: XLA's own estimate of the step's temporary memory."""
    config = tiny_config(n_layer=4, n_positions=128)
    input_shape = {"input_ids": jax.ShapeDtypeStruct((1, 8, 128), jnp.int32)}
    temporary_bytes = {}
    for policy in [None, "nothing_saveable"]:
        model, optimizer, schedule, abstract_state = training_parts(config, length=128, remat_policy=policy)
        train_step = jax.jit(
            run_clm_flax.make_train_step(model, optimizer, schedule, seed=0),
            compiler_options=train_step_compiler_options(),
        )
        compiled = train_step.lower(abstract_state, input_shape).compile()
        temporary_bytes[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert temporary_bytes["nothing_saveable"] < 0.7 * temporary_bytes[None], temporary_bytes


def test_bfloat16_computes_in_bfloat16_and_keeps_float32_state_and_logits():
    config = tiny_config()
    state, train_step = training_setup(config, dtype=jnp.bfloat16)
    assert {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state)) if leaf.ndim} == {
        "float32"
    }
    model = FlaxGPT2LMHeadModel(config, dtype=jnp.bfloat16)
    logits = model.apply({"params": state.params}, jnp.asarray(batch(2)))
    assert logits.dtype == jnp.float32
    reference = FlaxGPT2LMHeadModel(config).apply({"params": state.params}, jnp.asarray(batch(2)))
    difference = np.abs(np.asarray(logits) - np.asarray(reference)).max()
    assert 0 < difference < 0.05  # computed in bfloat16: close, not identical

    new_state, metrics = train_step(state, {"input_ids": batch(4)[None]})
    assert np.isfinite(float(metrics["loss_sum"]))
    jaxpr = str(jax.make_jaxpr(model.apply)({"params": state.params}, jnp.asarray(batch(2))))
    assert "bf16[2,16,128]" in jaxpr  # the MLP's activations are bfloat16


def test_bfloat16_parameters_and_optimizer_state_stay_bfloat16():
    micro_batches = 2  # the accumulation path: float32 sums, then the division shared with the single-batch path
    state, train_step = training_setup(tiny_config(), param_dtype=jnp.bfloat16)

    def float_dtypes(tree):
        return {
            str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)
        }

    assert float_dtypes(state.params) == float_dtypes(state.opt_state) == {"bfloat16"}
    new_state, metrics = train_step(state, {"input_ids": batch(4).reshape(micro_batches, -1, LENGTH)})
    # A float32 leaf after the step would mean more memory than asked for, and a recompilation at the next step.
    assert float_dtypes(new_state.params) == float_dtypes(new_state.opt_state) == {"bfloat16"}
    assert np.isfinite(float(metrics["loss_sum"]))


@pytest.mark.parametrize(
    "mesh_shape, message",
    [
        ("data=3,fsdp=3", "has 9 devices but there are 1"),
        ("data=1,model=1", "the axes are data, fsdp, expert and tensor"),
        ("fsdp", "write it as"),
    ],
)
def test_bad_mesh_shape_is_refused(mesh_shape, message):
    with pytest.raises(UsageError, match=message):
        create_mesh(mesh_shape)


@pytest.mark.parametrize(
    "model_type, expert_axis, message",
    [
        ("mixtral", 3, "expert=3 does not divide the 8 experts of the model"),
        ("llama", 2, "expert=2 splits a mixture of experts' experts, and this model has none"),
    ],
)
def test_an_expert_axis_the_model_cannot_split_is_refused_before_any_work(model_type, expert_axis, message):
    """Checked as every tool loads its model code, from the mesh's sizes (no mesh of that many devices needed)."""
    from types import SimpleNamespace

    from flax_lm.models import config_class, presets
    from flax_lm.models.model_code import load_model_code

    config = config_class(model_type)(**presets()[f"{model_type}-tiny"][1])
    mesh = SimpleNamespace(shape={"data": 1, "fsdp": 1, "expert": expert_axis, "tensor": 1})
    with pytest.raises(UsageError, match=message):
        load_model_code(config, None, True, "run_clm_flax.py", mesh, exports=False)
    load_model_code(config, None, True, "run_clm_flax.py", SimpleNamespace(shape=mesh.shape | {"expert": 1}))


def test_command_line_accumulation_matches_the_larger_batch(gpt2_tokenizer_dir, tmp_path, monkeypatch):
    from test_clm import scalars

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in os.listdir(gpt2_tokenizer_dir):
        (model_dir / name).write_bytes((gpt2_tokenizer_dir / name).read_bytes())
    tiny_config(vocab_size=1000, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).save_pretrained(model_dir)
    losses = {}
    for name, batch_options in [
        ("whole", ["--per_device_train_batch_size", "8"]),
        ("accumulated", ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]),
    ]:
        monkeypatch.setattr(sys, "argv", [
            "run_clm_flax.py", "--output_dir", str(tmp_path / name), "--config_name", str(model_dir),
            "--tokenizer_name", str(model_dir),
            "--train_file", str(REPO_DIR / "tests" / "fixtures" / "en" / "train.txt"),
            "--do_train", "--block_size", "32", "--max_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-3",
            "--adam_epsilon", "1e-3", "--sample_tokens", "0", *batch_options,
        ])  # fmt: skip
        run_clm_flax.main()
        losses[name] = [loss for _, loss in scalars(tmp_path / name, "train/loss")]
    assert len(losses["whole"]) == 3
    np.testing.assert_allclose(losses["accumulated"], losses["whole"], rtol=1e-5)


@pytest.mark.parametrize("scheduler", ["linear", "cosine"])
def test_the_decay_ends_at_min_lr_rate_of_the_peak(scheduler):
    training_args = run_clm_flax.TrainingArguments(
        output_dir="unused", learning_rate=1e-2, warmup_steps=2, lr_scheduler_type=scheduler, min_lr_rate=0.1
    )
    schedule = run_clm_flax.learning_rate_schedule(training_args.optimizer_settings(), total_steps=10)
    rates = np.array([float(schedule(step)) for step in range(13)])
    np.testing.assert_allclose(rates[:3], [0.0, 5e-3, 1e-2], rtol=1e-6)  # the warm-up, to the peak
    assert np.all(np.diff(rates[2:11]) < 0)  # then down, step by step
    np.testing.assert_allclose(rates[10:], 1e-3, rtol=1e-6)  # to a tenth of the peak, where it stays
    # A quarter of the way down (step 4 of the 8 after warm-up), between the peak and the floor:
    share_left = {"linear": 0.75, "cosine": 0.5 * (1 + np.cos(np.pi / 4))}[scheduler]
    np.testing.assert_allclose(rates[4], 1e-3 + share_left * 9e-3, rtol=1e-5)
    without_floor = run_clm_flax.TrainingArguments(
        output_dir="unused", learning_rate=1e-2, lr_scheduler_type=scheduler
    )
    assert float(run_clm_flax.learning_rate_schedule(without_floor.optimizer_settings(), total_steps=10)(10)) == 0.0
