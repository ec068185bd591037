"""The optimizers (--optim) and learning-rate schedules (--lr_scheduler_type, --lr_decay_shape) of the scripts'
tables, step for step against the optax compositions they mean and transformers' schedules, on small cases; which
parameters Muon trains; the learning rate a resumed run checks. Resumes, meshes: test_resume, test_tensor_parallel."""

import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax.traverse_util import flatten_dict, unflatten_dict
from test_clm import tiny_config
from test_mlm_model import tiny_config as tiny_roberta_config
from transformers.optimization import get_wsd_schedule

import run_clm_flax
from flax_lm.models.gpt2.model import FlaxGPT2LMHeadModel
from flax_lm.models.roberta.model import FlaxRobertaForMaskedLM
from flax_lm.run.record import TrainingProgress, check_resumed_run
from flax_lm.training.train_state import abstract_model_params

PEAK, MUON_PEAK, WEIGHT_DECAY, TOTAL_STEPS = 1e-2, 5e-2, 0.1, 8
# A tiny parameter tree named as the models name theirs: a block's matrix and bias, a norm, an embedding, an
# untied output layer. Which of them AdamW decays, written out rather than computed by the script's decay_mask.
SHAPES = {
    ("transformer", "h_0", "mlp", "c_fc", "kernel"): (6, 10),
    ("transformer", "h_0", "mlp", "c_fc", "bias"): (10,),
    ("transformer", "h_0", "ln_1", "scale"): (6,),
    ("transformer", "wte", "embedding"): (12, 6),
    ("lm_head", "kernel"): (6, 12),
}
DECAYED = {path: path[-1] in ("kernel", "embedding") for path in SHAPES}
HIDDEN_MATRIX = ("transformer", "h_0", "mlp", "c_fc", "kernel")


def training_args(**overrides):
    settings = dict(
        output_dir="unused", learning_rate=PEAK, muon_learning_rate=MUON_PEAK, weight_decay=WEIGHT_DECAY,
        warmup_steps=2, lr_scheduler_type="cosine", min_lr_rate=0.1, max_grad_norm=0.0, adam_beta2=0.95,
    )  # fmt: skip
    return run_clm_flax.TrainingArguments(**{**settings, **overrides})


def reference_update(optim: str, schedule):
    """(init, update) on flat {path: array} dicts, composed from optax directly: what --optim `optim` should be."""
    mask = unflatten_dict(DECAYED)
    if optim == "muon":
        hidden = optax.contrib.muon(lambda step: schedule(step) * MUON_PEAK / PEAK, weight_decay=WEIGHT_DECAY)
        others = optax.adamw(schedule, b2=0.95, weight_decay=WEIGHT_DECAY, mask=without_hidden(mask))
        return (
            lambda params: (hidden.init(only_hidden(params)), others.init(without_hidden(params))),
            lambda grads, state, params: combined(grads, state, params, hidden, others),
        )
    single = {
        "adamw": optax.adamw(schedule, b2=0.95, weight_decay=WEIGHT_DECAY, mask=mask),
        "lion": optax.lion(schedule, b2=0.95, weight_decay=WEIGHT_DECAY, mask=mask),
        "adafactor": optax.adafactor(schedule, weight_decay_rate=WEIGHT_DECAY, weight_decay_mask=mask),
    }[optim]
    return single.init, single.update


def only_hidden(tree):
    return {HIDDEN_MATRIX[-1]: flatten_dict(tree)[HIDDEN_MATRIX]}


def without_hidden(tree):
    return unflatten_dict({path: value for path, value in flatten_dict(tree).items() if path != HIDDEN_MATRIX})


def combined(grads, state, params, hidden, others):
    hidden_updates, hidden_state = hidden.update(only_hidden(grads), state[0], only_hidden(params))
    other_updates, other_state = others.update(without_hidden(grads), state[1], without_hidden(params))
    updates = flatten_dict(other_updates) | {HIDDEN_MATRIX: hidden_updates[HIDDEN_MATRIX[-1]]}
    return unflatten_dict(updates), (hidden_state, other_state)


@pytest.mark.parametrize("optim", ["adamw", "muon", "lion", "adafactor"])
def test_each_optimizer_updates_as_the_optax_composition_it_names(optim):
    args = training_args(optim=optim)
    schedule = run_clm_flax.learning_rate_schedule(args.optimizer_settings(), TOTAL_STEPS)
    optimizer = run_clm_flax.create_optimizer(args.optimizer_settings(), schedule)
    reference_init, reference_update_step = reference_update(optim, schedule)
    optimizer_update, reference_update_step = jax.jit(optimizer.update), jax.jit(reference_update_step)
    rng = np.random.default_rng(0)
    params = unflatten_dict({path: rng.normal(size=shape).astype(np.float32) for path, shape in SHAPES.items()})
    initial_params, state, expected_state = params, optimizer.init(params), reference_init(params)
    for _ in range(TOTAL_STEPS):
        grads = jax.tree_util.tree_map(lambda param: rng.normal(size=param.shape).astype(np.float32), params)
        updates, state = optimizer_update(grads, state, params)
        expected, expected_state = reference_update_step(grads, expected_state, params)
        for path, update in flatten_dict(updates).items():
            np.testing.assert_allclose(update, flatten_dict(expected)[path], rtol=1e-5, atol=1e-7, err_msg=f"{path}")
        params = optax.apply_updates(params, updates)
    for path, param in flatten_dict(params).items():
        assert np.abs(param - flatten_dict(initial_params)[path]).min() > 0, f"{path} was not trained"


@pytest.mark.parametrize("optim", ["adamw", "muon", "lion", "adafactor"])
def test_each_optimizer_leaves_a_frozen_parameter_as_it_was_and_keeps_no_state_for_it(optim, monkeypatch):
    """is_trained edited to freeze the first block: its weights stay bit for bit, the others train as without the
    freeze, and the state holds nothing of the block's (clipped by a global norm of the trained gradients only)."""
    args = training_args(optim=optim, max_grad_norm=1.0)
    schedule = run_clm_flax.learning_rate_schedule(args.optimizer_settings(), TOTAL_STEPS)
    rng = np.random.default_rng(0)
    params = unflatten_dict({path: rng.normal(size=shape).astype(np.float32) for path, shape in SHAPES.items()})
    grads = jax.tree_util.tree_map(lambda param: rng.normal(size=param.shape).astype(np.float32), params)
    every_parameter = run_clm_flax.create_optimizer(args.optimizer_settings(), schedule)
    monkeypatch.setattr(run_clm_flax, "is_trained", lambda path, param: path[1].key != "h_0")
    frozen = run_clm_flax.create_optimizer(args.optimizer_settings(), schedule)
    trained_grads = {**grads, "transformer": {"wte": grads["transformer"]["wte"]}}
    trained_params = {**params, "transformer": {"wte": params["transformer"]["wte"]}}
    expected, _ = every_parameter.update(trained_grads, every_parameter.init(trained_params), trained_params)
    state = frozen.init(params)
    updates, state = frozen.update(grads, state, params)
    for path, update in flatten_dict(updates).items():
        if path[1] == "h_0":
            assert not np.any(update), path
        else:
            np.testing.assert_allclose(update, flatten_dict(expected)[path], rtol=1e-6, err_msg=f"{path}")
    new_params = optax.apply_updates(params, updates)
    for path, param in flatten_dict(params).items():
        if path[1] == "h_0":
            np.testing.assert_array_equal(flatten_dict(new_params)[path], param)
    state_elements = sum(leaf.size for leaf in jax.tree_util.tree_leaves(state))
    assert state_elements == sum(leaf.size for leaf in jax.tree_util.tree_leaves(every_parameter.init(trained_params)))


def muon_parameters(model, length: int) -> set[str]:
    params = abstract_model_params(model, jnp.zeros((1, length), jnp.int32))
    labels = jax.tree_util.tree_map_with_path(lambda path, param: run_clm_flax.is_hidden_matrix(path, param), params)
    return {"/".join(path) for path, is_muon in flatten_dict(labels).items() if is_muon}


def test_muon_trains_the_kernels_of_the_blocks_and_no_embedding_norm_bias_or_head():
    untied = FlaxGPT2LMHeadModel(tiny_config(n_layer=2, tie_word_embeddings=False))
    projections = ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")
    assert muon_parameters(untied, 8) == {f"transformer/h_{n}/{name}/kernel" for n in (0, 1) for name in projections}
    roberta = FlaxRobertaForMaskedLM(tiny_roberta_config())
    layers = ("attention/self/query", "attention/self/key", "attention/self/value", "attention/output/dense")
    layers += ("intermediate/dense", "output/dense")
    expected = {f"roberta/encoder/layer_{n}/{name}/kernel" for n in range(2) for name in layers}
    assert muon_parameters(roberta, 8) == expected  # the head's dense kernel (lm_head/dense) stays AdamW's


def test_muon_orthogonalises_each_expert_of_a_mixture_as_a_matrix_of_its_own():
    """A mixture's stacked expert kernels (experts, in, out) are Muon's, each expert's slice updated as Muon updates
    that matrix alone: not AdamW's, and not one matrix of the whole stack."""
    settings = training_args(optim="muon", warmup_steps=0).optimizer_settings()  # no rate of 0 at the first step
    muon = run_clm_flax.OPTIMIZERS["muon"](settings, run_clm_flax.learning_rate_schedule(settings, TOTAL_STEPS))
    rng = np.random.default_rng(0)
    stack, stack_grads = rng.normal(size=(2, 3, 4, 6)).astype(np.float32)
    stacked = {"layers_0": {"experts": {"w1": stack}}}
    assert run_clm_flax.is_hidden_matrix(jax.tree_util.tree_flatten_with_path(stacked)[0][0][0], stack)
    update, _ = muon.update({"layers_0": {"experts": {"w1": stack_grads}}}, muon.init(stacked), stacked)
    for expert in range(3):
        alone = {"layers_0": {"dense": {"kernel": stack[expert]}}}
        expected, _ = muon.update({"layers_0": {"dense": {"kernel": stack_grads[expert]}}}, muon.init(alone), alone)
        np.testing.assert_allclose(
            update["layers_0"]["experts"]["w1"][expert], expected["layers_0"]["dense"]["kernel"], rtol=1e-5, atol=1e-7
        )


def wsd_rates(total_steps: int, **overrides) -> np.ndarray:
    schedule = run_clm_flax.learning_rate_schedule(
        training_args(lr_scheduler_type="warmup_stable_decay", **overrides).optimizer_settings(), total_steps
    )
    return np.array([float(schedule(step)) for step in range(total_steps + 3)])


def transformers_rates(total_steps: int, warmup_steps: int, decay_steps: int, shape: str, floor: float):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    scheduler = get_wsd_schedule(
        optimizer, warmup_steps, decay_steps, total_steps, decay_type=shape, min_lr_ratio=floor
    )
    return np.array([PEAK * scheduler.lr_lambdas[0](step) for step in range(total_steps + 3)])


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("warmup_steps, floor", [(3, 0.0), (0, 0.1)])
def test_warmup_stable_decay_gives_transformers_rates(shape, warmup_steps, floor):
    # transformers warms up from the floor, the scripts from 0: the cases warm up without a floor or have no warm-up.
    rates = wsd_rates(20, warmup_steps=warmup_steps, min_lr_rate=floor, lr_decay_ratio=0.3, lr_decay_shape=shape)
    np.testing.assert_allclose(rates, transformers_rates(20, warmup_steps, 6, shape, floor), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(rates[warmup_steps : 20 - 6], PEAK, rtol=1e-7)  # stable until the decay
    np.testing.assert_allclose(rates[20:], PEAK * floor, atol=1e-9)


@pytest.mark.parametrize("scheduler", ["linear", "cosine"])
def test_linear_and_cosine_decay_over_every_step_after_the_warm_up_as_optax_and_transformers_do(scheduler):
    schedule = run_clm_flax.learning_rate_schedule(training_args(lr_scheduler_type=scheduler).optimizer_settings(), 20)
    rates = np.array([float(schedule(step)) for step in range(23)])
    if scheduler == "cosine":
        expected = optax.warmup_cosine_decay_schedule(0.0, PEAK, 2, 20, end_value=PEAK * 0.1)
        np.testing.assert_allclose(rates, [float(expected(step)) for step in range(23)], rtol=1e-6)
    else:  # transformers warms up from the floor, the scripts from 0
        np.testing.assert_allclose(rates[2:], transformers_rates(20, 2, 18, "linear", 0.1)[2:], rtol=1e-6)
        np.testing.assert_allclose(rates[:2], [0.0, PEAK / 2], rtol=1e-6)


def test_a_decay_can_start_from_any_step_of_the_stable_phase():
    """A 60-step run branched from step 40 of a 100-step one, in its stable phase, has the same rates up to its decay:
    the decay is placed by the run's last step alone."""
    longer, shorter = wsd_rates(100, lr_decay_ratio=0.2), wsd_rates(60, lr_decay_ratio=0.2)
    np.testing.assert_array_equal(shorter[:48], longer[:48])  # both at the peak until step 48, where 60's decay starts
    assert shorter[59] < PEAK * 0.2 < longer[59]
    np.testing.assert_allclose(longer[2:80], PEAK, rtol=1e-7)


def resumed_record(step: int, learning_rate: float) -> dict:
    return dict(step=step, global_batch_size=4, block_size=8, training_examples=100, learning_rate=learning_rate)


@pytest.mark.parametrize(
    "max_steps, jumps",
    [(60, False), (100, False), (45, True)],  # 45 steps decay from step 36, before the checkpoint's step 40
)
def test_a_resume_warns_only_where_the_learning_rate_jumps(max_steps, jumps, caplog):
    args = training_args(lr_scheduler_type="warmup_stable_decay", max_steps=max_steps, do_train=True)
    setup = SimpleNamespace(
        learning_rate_schedule=run_clm_flax.learning_rate_schedule(args.optimizer_settings(), max_steps),
        train_batch_size=4, row_length=8, train_examples=range(100), total_steps=max_steps, model_code=None,
    )  # fmt: skip
    # Step 40 of a 100-step run, in its stable phase, trained at the peak.
    with caplog.at_level(logging.WARNING):
        run = {"arguments": {}, "model_code": {"fingerprint": "the same"}}  # the same run but for --max_steps
        check_resumed_run(resumed_record(40, PEAK), run, TrainingProgress.start(()), setup, args.resume_settings())
    assert ("the learning rate jumps at the resume" in caplog.text) == jumps, caplog.text


def test_an_is_trained_that_freezes_every_parameter_is_refused():
    """A copy whose is_trained returns False everywhere would log a gradient norm of 0 and train nothing, silently."""
    from flax_lm.errors import UsageError
    from flax_lm.training.optimizers import trained_only

    params = {"wte": {"embedding": jnp.ones((4, 2))}, "h": {"kernel": jnp.ones((2, 2))}}
    with pytest.raises(UsageError, match="is_trained returns False for every parameter"):
        trained_only(optax.adamw(1e-3), lambda path, param: False).init(params)
    state = trained_only(optax.adamw(1e-3), lambda path, param: path[0].key == "h").init(params)
    assert len(jax.tree_util.tree_leaves(state)) < len(jax.tree_util.tree_leaves(optax.adamw(1e-3).init(params)))
