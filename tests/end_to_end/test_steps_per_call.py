"""Several training steps in one compiled call (--steps_per_call): the same losses and weights as one step per call,
calls that end where the loop logs, evaluates or saves, an exact resume inside a call's range; the persistent
compilation cache that lets the next run skip compiling, and the train step compiled ahead for the first call."""

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES_DIR, stock_code
from safetensors.numpy import load_file
from test_clm import (
    OFFLINE_ENV,
    TINY_FAMILY_CONFIGS,
    model_dir_with_config,
    run_script,
    tiny_config,
    tiny_llama_config,
)
from test_mlm_model import BOS, EOS, MASK, PAD, VOCAB_SIZE
from test_mlm_model import tiny_config as tiny_roberta_config
from test_scaling import LENGTH, batch, training_parts

import run_clm_flax
import run_mlm_flax
from flax_lm.devices.mesh import create_mesh
from flax_lm.errors import UsageError
from flax_lm.models.gpt2.model import FlaxGPT2LMHeadModel
from flax_lm.models.roberta.model import FlaxRobertaForMaskedLM
from flax_lm.run.record import TrainingProgress
from flax_lm.run.tracking import TrainingLog
from flax_lm.training.compilation import compile_in_background
from flax_lm.training.lifecycle import set_up_training
from flax_lm.training.train_state import create_train_state, repeat_train_step

CORPUS = FIXTURES_DIR / "en"
STEPS = 6


# The models of the tests of steps per call: GPT-2 with dropout (its masks must follow the step), Llama and Gemma 3
# without (a model module of its own, with a local layer; OLMo 2's module is resumed in test_resume.py).
CONFIGS = {
    "gpt2 with dropout": lambda: tiny_config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "llama": lambda: tiny_llama_config(),
    "gemma3": lambda: TINY_FAMILY_CONFIGS["gemma3"](),
}


def compiled_steps(steps_per_call: int, config):
    """A fresh training state and the script's train step, compiled to run up to `steps_per_call` steps a call."""
    model, optimizer, schedule, abstract_state = training_parts(config)
    state = create_train_state(model, optimizer, abstract_state, 0, jnp.zeros((1, LENGTH), jnp.int32))
    train_step = run_clm_flax.make_train_step(model, optimizer, schedule, seed=0)
    return state, jax.jit(repeat_train_step(train_step, steps_per_call))


def call_batches(first_step: int, steps: int, steps_per_call: int) -> dict:
    """The batches of steps first_step + 1 ... first_step + steps, each one micro-batch, filled to steps_per_call."""
    rows = [batch(4, seed=step)[None] for step in range(first_step, first_step + steps)]
    rows += [rows[-1]] * (steps_per_call - steps)
    return {"input_ids": np.stack(rows)}


@pytest.mark.parametrize("model", CONFIGS)
def test_steps_in_one_call_give_the_losses_and_weights_of_one_step_per_call(model):
    state, one_step = compiled_steps(1, CONFIGS[model]())
    losses_one_per_call = []
    for step in range(STEPS):
        state, metrics = one_step(state, call_batches(step, 1, 1), 1)
        losses_one_per_call.append(float(metrics["loss_sum"][0] / metrics["token_count"][0]))
    one_per_call = state

    state, several_steps = compiled_steps(STEPS, CONFIGS[model]())
    state, metrics = several_steps(state, call_batches(0, STEPS, STEPS), STEPS)
    losses_in_one_call = list(np.asarray(metrics["loss_sum"] / metrics["token_count"]))

    assert int(state.step) == int(one_per_call.step) == STEPS
    np.testing.assert_allclose(losses_in_one_call, losses_one_per_call, rtol=1e-6, atol=1e-6)
    for name, (in_one_call, one_at_a_time) in enumerate(
        zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(one_per_call.params))
    ):
        np.testing.assert_allclose(in_one_call, one_at_a_time, rtol=1e-5, atol=1e-6, err_msg=str(name))


def test_a_call_runs_only_its_count_of_steps_and_calls_of_any_count_compose_exactly():
    initial_state, train_steps = compiled_steps(4, CONFIGS["gpt2 with dropout"]())  # one program for every count
    whole_call, metrics = train_steps(initial_state, call_batches(0, 4, 4), 4)

    state, first = train_steps(initial_state, call_batches(0, 1, 4), 1)
    assert int(state.step) == 1 and not np.any(np.asarray(first["token_count"][1:]))
    state, rest = train_steps(state, call_batches(1, 3, 4), 3)

    # The same compiled step whatever the count: bit for bit, as a resumed run must be.
    assert int(state.step) == 4
    np.testing.assert_array_equal(first["loss_sum"][0], metrics["loss_sum"][0])
    np.testing.assert_array_equal(rest["loss_sum"][:3], metrics["loss_sum"][1:])
    for resumed, uninterrupted in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(whole_call)):
        np.testing.assert_array_equal(resumed, uninterrupted)


def loop_arguments(**overrides):
    defaults = dict(
        steps_per_call=8, logging_steps=10, save_steps=25, eval_steps=None, do_eval=True, logging_first_step=False
    )
    return SimpleNamespace(**{**defaults, **overrides})


def test_calls_end_at_every_step_that_logs_evaluates_or_saves():
    calls = run_clm_flax.steps_of_calls(0, 30, loop_arguments(eval_steps=12))
    call_ends = list(np.cumsum(calls))
    assert max(calls) <= 8 and call_ends[-1] == 30
    assert {10, 12, 20, 24, 25, 30} <= set(call_ends)
    assert run_clm_flax.steps_of_calls(0, 30, loop_arguments(eval_steps=12, do_eval=False)) == [8, 2, 8, 2, 5, 5]
    # A resumed run's calls start after its checkpoint; one step per call is the plain loop.
    assert run_clm_flax.steps_of_calls(25, 30, loop_arguments()) == [5]
    assert run_clm_flax.steps_of_calls(3, 7, loop_arguments(steps_per_call=1)) == [1, 1, 1, 1]
    # --logging_first_step: the first call ends at step 1, which is logged.
    assert run_clm_flax.steps_of_calls(0, 12, loop_arguments(logging_first_step=True)) == [1, 8, 1, 2]


def training_command(model_dir, output_dir, *extra):
    return [
        "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", str(CORPUS / "train.txt"), "--do_train", "--block_size", "32",
        "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--seed", "0", "--sample_tokens", "0",
        "--max_steps", "20", "--logging_steps", "10", "--steps_per_call", "8", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("steps-per-call-model"))


def train_in_process(arguments, monkeypatch):
    """run_clm_flax.py with `arguments`, its main() in this process: no fresh import of JAX and the libraries."""
    with monkeypatch.context() as patch:
        patch.setattr("sys.argv", ["run_clm_flax.py", *arguments])
        run_clm_flax.main()


# Where a resumed run's calls start is the loop's arithmetic, the same for every model (each model's steps in one call
# are compared with one step per call above).
def test_a_run_resumed_inside_a_call_s_range_ends_with_the_uninterrupted_weights(model_dir, tmp_path, monkeypatch):
    # Uninterrupted, the calls run steps 1-8, 9-10, 11-18 and 19-20. The interrupted run saves every 5 steps; resumed
    # from step 15, inside the uninterrupted run's call of steps 11-18, its one call runs steps 16-20.
    uninterrupted = tmp_path / "uninterrupted"
    train_in_process(training_command(model_dir, uninterrupted, "--save_steps", "20"), monkeypatch)
    interrupted = tmp_path / "interrupted"
    train_in_process(training_command(model_dir, interrupted, "--save_steps", "5"), monkeypatch)
    checkpoint = str(interrupted / "checkpoints" / "15")
    resumed = training_command(model_dir, interrupted, "--save_steps", "20", "--resume_from_checkpoint", checkpoint)
    train_in_process(resumed, monkeypatch)

    final = load_file(str(interrupted / "model.safetensors"))
    expected = load_file(str(uninterrupted / "model.safetensors"))
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)


def test_line_by_line_batches_of_several_lengths_refuse_several_steps_per_call(model_dir, monkeypatch):
    monkeypatch.setattr(run_mlm_flax, "check_common_arguments", lambda *arguments: None)
    data_args = run_mlm_flax.DataTrainingArguments(line_by_line=True)
    training_args = run_mlm_flax.TrainingArguments(output_dir="unused", steps_per_call=4)
    with pytest.raises(UsageError, match="--steps_per_call 4 needs batches of one length.*--pad_to_max_length"):
        run_mlm_flax.check_arguments(run_mlm_flax.ModelArguments(), data_args, training_args)
    # Left out, it is one step per call.
    training_args.steps_per_call = None
    run_mlm_flax.check_arguments(run_mlm_flax.ModelArguments(), data_args, training_args)
    assert training_args.steps_per_call == 1


def test_the_next_run_finds_its_compiled_steps_in_the_cache_and_none_switches_it_off(model_dir, tmp_path):
    environment = {name: value for name, value in OFFLINE_ENV.items() if not name.startswith("JAX_COMPILATION")}
    cache_home = tmp_path / "cache-home"
    command = training_command(model_dir, tmp_path / "run", "--overwrite_output_dir", "--max_steps", "4")
    run_script(command, env={**environment, "XDG_CACHE_HOME": str(cache_home)})
    cache_dir = cache_home / "flax_lm" / "compilation"
    compiled = {name for name in os.listdir(cache_dir) if name.endswith("-cache")}
    assert any(name.startswith("jit_train_steps-") for name in compiled), compiled

    # The same run again: its steps come from the cache, none compiled and kept again. (A program
    # of a few operations, jit_add, may take more than MIN_COMPILE_SECONDS_KEPT to compile on a loaded machine in one
    # run and less in the other, and so be kept by the second alone: not a miss.)
    run_script(command, env={**environment, "XDG_CACHE_HOME": str(cache_home)})
    added = {name for name in os.listdir(cache_dir) if name.endswith("-cache")} - compiled
    assert not [name for name in added if name.startswith(("jit_train_steps-", "jit_eval_step-", "jit_init-"))], added

    other_home = tmp_path / "other-home"
    run_script([*command, "--compilation_cache_dir", "none"], env={**environment, "XDG_CACHE_HOME": str(other_home)})
    assert not (other_home / "flax_lm").exists()


def clm_training(training_args):
    """The CLM script's training setup for a tiny GPT-2, its training blocks, and the batches of its first call."""
    model = FlaxGPT2LMHeadModel(tiny_config(), mesh=create_mesh())
    blocks = np.random.default_rng(0).integers(0, 512, size=(64, LENGTH), dtype=np.int32)
    eval_step = run_clm_flax.make_eval_step(model, None)
    script = run_clm_flax.SCRIPT_TRAINING
    setup = set_up_training(
        model, stock_code(model.config), script, eval_step, training_args.training_settings(), blocks, LENGTH
    )
    batches = run_clm_flax.train_batches_from(0, setup, None, None, None, None, training_args)
    return setup, run_clm_flax.abstract_call_batches(setup, training_args), next(iter(batches))


def mlm_training(training_args):
    """The same for the MLM script: a tiny RoBERTa, blocks of LENGTH - 2 tokens."""
    model = FlaxRobertaForMaskedLM(tiny_roberta_config(), mesh=create_mesh())
    special_ids = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, mask_token_id=MASK)
    make_batch = run_mlm_flax.BatchMaker(
        **special_ids,
        special_token_ids=(BOS, PAD, EOS, MASK),
        random_token_count=VOCAB_SIZE,
        mlm_probability=0.15,
        max_seq_length=LENGTH,
    )
    blocks = np.random.default_rng(0).integers(5, 50, size=(64, LENGTH - 2), dtype=np.int32)
    eval_step = run_mlm_flax.make_eval_step(model)
    script = run_mlm_flax.SCRIPT_TRAINING
    setup = set_up_training(
        model, stock_code(model.config), script, eval_step, training_args.training_settings(), blocks, LENGTH
    )
    batches = run_mlm_flax.train_batches_from(
        0, setup, None, make_batch, None, None, run_mlm_flax.DataTrainingArguments(), training_args
    )
    return setup, run_mlm_flax.abstract_call_batches(setup, make_batch, training_args), next(iter(batches))


@pytest.mark.parametrize("script", [run_clm_flax, run_mlm_flax])
def test_the_train_step_compiled_ahead_is_the_program_the_first_call_runs(script):
    training_args = script.TrainingArguments(
        output_dir="unused", do_train=True, max_steps=10, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, steps_per_call=3, logging_steps=10, save_steps=10,
    )  # fmt: skip
    setup, abstract_batches, (first_batches, step_tokens) = (
        clm_training(training_args) if script is run_clm_flax else mlm_training(training_args)
    )
    # The program compiled ahead is found only by arguments of its shapes, dtypes and shardings: those of the batches.
    assert {name: (value.shape, value.dtype, value.sharding) for name, value in abstract_batches.items()} == {
        name: (value.shape, value.dtype, value.sharding) for name, value in first_batches.items()
    }
    compile_in_background(
        setup.compiled_train_steps, setup.abstract_state, abstract_batches, training_args.steps_per_call
    ).join()

    compilations = []

    def count_compilations(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            compilations.append(event)

    jax.monitoring.register_event_duration_secs_listener(count_compilations)
    try:
        state = create_train_state(
            setup.model, setup.optimizer, setup.abstract_state, 0, jnp.zeros((1, LENGTH), jnp.int32)
        )
        assert compilations  # the listener hears compilations: initialising the state compiles its own program
        compilations.clear()
        state, metrics = setup.compiled_train_steps(state, first_batches, len(step_tokens))
    finally:
        jax.monitoring.unregister_event_duration_listener(count_compilations)
    assert compilations == [] and int(state.step) == len(step_tokens) == 3
    assert np.all(np.isfinite(metrics["loss_sum"])) and np.all(np.asarray(metrics["loss_sum"]) > 0)


class StepsOnTheDevices:
    """Stands in for the metrics of a call still running: ready once `finished` is set."""

    def __init__(self):
        self.finished = False

    def is_ready(self) -> bool:
        return self.finished


def test_the_progress_bar_counts_the_steps_that_finished_not_those_queued():
    log = TrainingLog(None, TrainingProgress.start(["loss_sum"]), 20, None, skip_nonfinite_steps=False)
    with log:
        log.steps_done({"loss_sum": jnp.ones(8)}, [64] * 8)  # an array computed already
        assert log.progress_bar.n == 8
        running, queued = StepsOnTheDevices(), StepsOnTheDevices()
        log.steps_done({"loss_sum": running}, [64] * 8)
        log.steps_done({"loss_sum": queued}, [64] * 2)
        assert log.progress_bar.n == 8
        running.finished = True
        log.show_finished_steps()
        assert log.progress_bar.n == 16  # in order: the queued call is not ready yet
        queued.finished = True
        log.show_finished_steps()
        assert log.progress_bar.n == 18 and log.tokens == 18 * 64
