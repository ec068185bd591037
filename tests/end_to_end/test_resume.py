"""Never lose a run: exact resume after SIGKILL (also during a save), SIGINT, non-finite steps, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import FIXTURES_DIR, REPO_DIR
from safetensors.numpy import load_file
from test_clm import OFFLINE_ENV, model_dir_with_config, run_clm_flax, run_script, tiny_config
from transformers import GPT2Config, GPT2LMHeadModel

import generate_flax
from flax_lm.run.checkpoints import restore_checkpoint

CORPUS = FIXTURES_DIR / "en"
SECRET = "hf_SECRET_TOKEN_never_to_be_written"


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """The 1000-token test tokenizer with a GPT-2 big enough that saving a checkpoint takes a moment."""
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("resume-model"), n_embd=128)


def arguments(model_dir, output_dir, *extra):
    """A short training command line; a --train_file in `extra` replaces the English corpus (both would be read)."""
    train_file = [] if "--train_file" in extra else ["--train_file", str(CORPUS / "train.txt")]
    return [
        "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        *train_file, "--do_train", "--block_size", "32",
        "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--seed", "0", "--sample_tokens", "0",
        "--max_steps", "40", "--logging_steps", "1", "--save_steps", "8", *extra,
    ]  # fmt: skip


def losses_per_process(output_dir, tag="train/loss") -> list[dict]:
    """{step: train loss} (or the metric `tag`) logged by each process that wrote into output_dir, oldest first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = os.path.join(str(output_dir), "tensorboard")
    runs = []
    for name in sorted(os.listdir(log_dir), key=lambda name: os.path.getmtime(os.path.join(log_dir, name))):
        events = EventAccumulator(os.path.join(log_dir, name))
        events.Reload()
        runs.append({event.step: event.value for event in events.Scalars(tag)})
    return runs


def start_script(argument_list):
    return subprocess.Popen(
        [sys.executable, str(REPO_DIR / "run_clm_flax.py"), *argument_list],
        env=OFFLINE_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_when(process, condition, what: str):
    """SIGKILL `process` as soon as `condition()` holds (polled every millisecond)."""
    while process.poll() is None:
        if condition():
            process.kill()
            process.wait()
            return
        time.sleep(0.001)
    pytest.fail(f"the run ended before {what}: {process.stderr.read()[-2000:]}")


def assert_same_as_uninterrupted(output_dir, uninterrupted_dir, last_step=40, weights="model.safetensors"):
    final = load_file(os.path.join(output_dir, weights))
    expected = load_file(os.path.join(uninterrupted_dir, weights))
    assert final.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)
    uninterrupted_losses = losses_per_process(uninterrupted_dir)[0]
    resumed_losses = losses_per_process(output_dir)[-1]
    assert resumed_losses and max(resumed_losses) == last_step
    assert resumed_losses == {step: uninterrupted_losses[step] for step in resumed_losses}


@pytest.fixture(scope="module")
def uninterrupted_run(model_dir, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_script(arguments(model_dir, output_dir, "--overwrite_output_dir", "--token", SECRET))
    return output_dir, result


def test_checkpoints_hold_the_newest_few_and_the_token_is_never_written(uninterrupted_run):
    output_dir, result = uninterrupted_run
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["32", "40"] or sorted(
        os.listdir(output_dir / "checkpoints"), key=int
    ) == ["24", "32", "40"]
    progress = json.loads((output_dir / "checkpoints" / "40" / "progress" / "metadata").read_text())
    assert progress["step"] == 40 and progress["epoch"] * 0 == 0 and "token" not in progress["run"]["arguments"]
    assert SECRET not in result.stdout + result.stderr
    for directory, _, files in os.walk(output_dir):
        for name in files:
            with open(os.path.join(directory, name), "rb") as file:
                assert SECRET.encode() not in file.read(), f"the token was written to {name}"


def test_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(model_dir, uninterrupted_run, tmp_path):
    """Killed in the middle of training, and in the middle of a checkpoint: the resume goes on from the last complete
    one to the weights and losses of the uninterrupted run, and removes the unfinished one."""
    output_dir = tmp_path / "killed-saving"
    checkpoints = output_dir / "checkpoints"

    def saving():
        # Orbax writes a checkpoint under a temporary name and renames it when complete.
        return checkpoints.is_dir() and any(
            "tmp" in name for name in os.listdir(checkpoints) if not name.startswith("8")
        )

    process = start_script(arguments(model_dir, output_dir))
    kill_when(process, saving, "a checkpoint after the first was being written")
    unfinished = [name for name in os.listdir(checkpoints) if "tmp" in name]

    result = run_script(arguments(model_dir, output_dir, "--resume_from_checkpoint"))
    assert_same_as_uninterrupted(output_dir, uninterrupted_run[0])
    assert "Resumed from" in result.stderr
    for name in unfinished:
        assert not (checkpoints / name).exists(), "the unfinished checkpoint should have been cleaned up"


@pytest.mark.parametrize("optimizer", ["muon", "lion", "adafactor"])
def test_each_optimizer_resumes_to_the_same_weights_and_losses(optimizer, model_dir, tmp_path, monkeypatch):
    """Its state (Muon's and Lion's momentum, Adafactor's factored second moments: the model is wide enough to factor
    its matrices) is checkpointed and restored exactly, as AdamW's is in the tests above."""
    short_run = ["--optim", optimizer, "--learning_rate", "3e-4", "--max_steps", "12", "--save_steps", "6"]
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run_main(monkeypatch, arguments(model_dir, uninterrupted, *short_run))
    shutil.copytree(uninterrupted / "checkpoints" / "6", resumed / "checkpoints" / "6")
    run_main(monkeypatch, arguments(model_dir, resumed, *short_run, "--resume_from_checkpoint"))
    assert_same_as_uninterrupted(resumed, uninterrupted, last_step=12)


def test_olmo2_with_the_z_loss_resumes_to_the_same_weights_losses_and_z_losses(
    test_tokenizer_dirs, tmp_path, monkeypatch
):
    """A model module of its own (OLMo 2's: norms after attention and MLP, QK-norm) resumed exactly, with the z-loss
    on: its sum is checkpointed with the loss's and logged as train/z_loss."""
    model_dir = model_dir_with_config(test_tokenizer_dirs["llama"], tmp_path / "olmo2", "olmo2")
    short_run = ["--max_steps", "8", "--save_steps", "4", "--z_loss", "1e-2"]
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run_main(monkeypatch, arguments(model_dir, uninterrupted, *short_run))
    shutil.copytree(uninterrupted / "checkpoints" / "4", resumed / "checkpoints" / "4")
    run_main(monkeypatch, arguments(model_dir, resumed, *short_run, "--resume_from_checkpoint"))
    assert_same_as_uninterrupted(resumed, uninterrupted, last_step=8)
    uninterrupted_z_losses = losses_per_process(uninterrupted, "train/z_loss")[0]
    assert sorted(uninterrupted_z_losses) == list(range(1, 9)) and min(uninterrupted_z_losses.values()) > 0
    resumed_z_losses = losses_per_process(resumed, "train/z_loss")[-1]
    assert resumed_z_losses == {step: uninterrupted_z_losses[step] for step in range(5, 9)}
    results = json.loads((resumed / "train_results.json").read_text())
    assert results["train_z_loss"] == pytest.approx(sum(uninterrupted_z_losses.values()) / 8, rel=1e-5)
    # Another coefficient changes the training: refused, as another learning rate is.
    shutil.copytree(uninterrupted / "checkpoints" / "4", tmp_path / "changed" / "checkpoints" / "4")
    changed = arguments(model_dir, tmp_path / "changed", *short_run, "--z_loss", "2e-2", "--resume_from_checkpoint")
    with pytest.raises(run_clm_flax.UsageError, match=r"z_loss.*--allow_resume_changes z_loss"):
        run_main(monkeypatch, changed)


def test_gpt2_with_every_block_option_resumes_exports_for_this_repository_and_generates(
    gpt2_tokenizer_dir, tmp_path, monkeypatch, capsys
):
    """QK-norm, both soft-caps and a window on the first layer, with document attention: resumed exactly; the export
    holds the Flax weights, not a GPT2LMHeadModel that transformers would compute otherwise, and generate_flax.py
    decodes from it."""
    options = dict(
        qk_norm=True, attn_logit_softcapping=5.0, final_logit_softcapping=8.0, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model_dir = model_dir_with_config(gpt2_tokenizer_dir, tmp_path / "options", **options)
    short_run = ["--max_steps", "8", "--save_steps", "4", "--document_attention"]
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run_main(monkeypatch, arguments(model_dir, uninterrupted, *short_run))
    shutil.copytree(uninterrupted / "checkpoints" / "4", resumed / "checkpoints" / "4")
    run_main(monkeypatch, arguments(model_dir, resumed, *short_run, "--resume_from_checkpoint"))
    assert_same_as_uninterrupted(resumed, uninterrupted, last_step=8, weights="flax_model.safetensors")
    assert not (resumed / "model.safetensors").exists()
    exported = json.loads((resumed / "config.json").read_text())
    assert exported.get("architectures") is None and exported["qk_norm"] is True
    monkeypatch.setattr(sys, "argv", [
        "generate_flax.py", "--model_name_or_path", str(resumed), "--prompt", "The", "--max_new_tokens", "5",
        "--min_new_tokens", "5", "--json_output",
    ])  # fmt: skip
    capsys.readouterr()
    generate_flax.main()
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 5


def test_a_stable_phase_checkpoint_branched_to_a_shorter_budget_ends_as_a_run_of_that_budget(
    model_dir, tmp_path, monkeypatch, capfd
):
    """warmup_stable_decay: a 12-step run's checkpoint 6, at the peak, resumed into another directory with --max_steps
    8, decays over the new run's last steps and ends with the weights of a run of 8 steps from the start; the longer
    run's checkpoints stay as they were."""
    schedule = ["--lr_scheduler_type", "warmup_stable_decay", "--lr_decay_ratio", "0.25", "--warmup_steps", "2"]
    longer, branch, shorter = tmp_path / "longer", tmp_path / "branch", tmp_path / "shorter"
    run_main(monkeypatch, arguments(model_dir, longer, *schedule, "--max_steps", "12", "--save_steps", "6"))
    run_main(monkeypatch, arguments(model_dir, shorter, *schedule, "--max_steps", "8"))
    stable_checkpoint = str(longer / "checkpoints" / "6")
    run_main(monkeypatch, arguments(
        model_dir, branch, *schedule, "--max_steps", "8", "--resume_from_checkpoint", stable_checkpoint
    ))  # fmt: skip
    assert "jumps" not in capfd.readouterr().err
    assert_same_as_uninterrupted(branch, shorter, last_step=8)
    assert sorted(os.listdir(longer / "checkpoints"), key=int) == ["6", "12"]


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(model_dir, tmp_path):
    output_dir = tmp_path / "interrupted"
    process = start_script(arguments(model_dir, output_dir, "--max_steps", "100000", "--save_steps", "100000"))
    stderr_lines = []
    reader = threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("step 3:" in line for line in stderr_lines):
        assert process.poll() is None and time.time() < deadline, "".join(stderr_lines)[-2000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout = process.stdout.read()
    assert process.wait(timeout=300) == 0, "".join(stderr_lines)[-2000:]
    reader.join()
    assert "SIGINT" in stdout and "--resume_from_checkpoint" in stdout
    saved_steps = [int(name) for name in os.listdir(output_dir / "checkpoints")]
    assert len(saved_steps) == 1 and saved_steps[0] >= 3
    assert f"checkpoints/{saved_steps[0]}" in stdout
    assert (output_dir / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------
# In the same process: each raises the one-line error the command line prints
# ----------------------------------------------------------------------------------------------------


def run_main(monkeypatch, argument_list):
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *argument_list])
    run_clm_flax.main()


def test_nonfinite_loss_stops_naming_the_step_and_the_last_good_checkpoint(model_dir, tmp_path, monkeypatch):
    output_dir = tmp_path / "diverged"
    # A learning rate this large overflows float32 on the second update.
    diverging = arguments(
        model_dir, output_dir, "--learning_rate", "1e30", "--max_grad_norm", "0", "--save_steps", "1"
    )
    with pytest.raises(run_clm_flax.UsageError) as error:
        run_main(monkeypatch, diverging)
    message = str(error.value)
    assert "not finite at step" in message and "--skip_nonfinite_steps" in message
    bad_step = int(message.split("not finite at step ")[1].split(";")[0])
    assert f"checkpoints/{bad_step - 1}" in message
    assert sorted(int(name) for name in os.listdir(output_dir / "checkpoints"))[-1] == bad_step - 1
    assert all(np.isfinite(value).all() for value in load_file(str(output_dir / "model.safetensors")).values())


def test_nonfinite_steps_are_skipped_on_request(model_dir, tmp_path, monkeypatch, capfd):
    output_dir = tmp_path / "skipping"
    run_main(monkeypatch, arguments(
        model_dir, output_dir, "--learning_rate", "1e30", "--max_grad_norm", "0", "--max_steps", "6",
        "--skip_nonfinite_steps",
    ))  # fmt: skip
    assert "step 2: the loss or gradient norm is not finite; the update was skipped" in capfd.readouterr().err
    assert all(np.isfinite(value).all() for value in load_file(str(output_dir / "model.safetensors")).values())


def test_checkpoint_of_another_model_shape_is_refused(model_dir, uninterrupted_run, tmp_path, monkeypatch):
    output_dir = tmp_path / "other-shape"
    shutil.copytree(uninterrupted_run[0] / "checkpoints", output_dir / "checkpoints")
    config_dir = tmp_path / "wider"
    shutil.copytree(model_dir, config_dir)
    tiny_config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2).save_pretrained(config_dir)
    resume = arguments(
        model_dir, output_dir, "--config_name", str(config_dir), "--max_steps", "50", "--resume_from_checkpoint"
    )
    with pytest.raises(
        run_clm_flax.UsageError,
        # Named by what the run record says differs, before any array's shape.
        match=r"the resumed run differs from the checkpoint's in what it trains: the model config",
    ):
        run_main(monkeypatch, resume)


def test_checkpoint_of_another_optimizer_is_refused(model_dir, uninterrupted_run, tmp_path, monkeypatch):
    output_dir = tmp_path / "other-optimizer"
    shutil.copytree(uninterrupted_run[0] / "checkpoints", output_dir / "checkpoints")
    resume = arguments(model_dir, output_dir, "--optim", "adafactor", "--max_steps", "50", "--resume_from_checkpoint")
    with pytest.raises(
        run_clm_flax.UsageError,
        match=r"the checkpoint holds the state of another optimizer \(--optim \S+ there, adafactor here\)",
    ):
        run_main(monkeypatch, resume)


@pytest.mark.parametrize(
    "location, message",
    [
        ("elsewhere", "there are no training checkpoints in {tmp_path}/elsewhere"),
        ("checkpoints/8", "there is no complete training checkpoint at {tmp_path}/checkpoints/8"),
        ("checkpoints", "there is no readable training checkpoint in {tmp_path}/checkpoints"),
    ],
)
def test_resume_from_a_location_without_a_complete_checkpoint_is_refused(location, message, tmp_path):
    # All a run killed during its first save leaves: the temporary directory Orbax was writing checkpoint 8 into.
    (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp").mkdir(parents=True)
    with pytest.raises(run_clm_flax.UsageError) as error:
        # The state is never read: each location is refused before any checkpoint is opened.
        restore_checkpoint(str(tmp_path / location), str(tmp_path), None, ["step"])
    assert str(error.value) == "--resume_from_checkpoint: " + message.format(tmp_path=tmp_path)


@pytest.mark.parametrize(
    "content, extra_arguments, message",
    [
        (b"", [], "is empty"),
        (b"valid text\n\xff\xfe\xfa not UTF-8\n", [], "UnicodeDecodeError"),
        (b"too short\n", [], "fewer tokens than one block of 32"),
        (
            b"long enough for a few blocks, " * 40 + b"\n",
            ["--per_device_train_batch_size", "64"],
            "fewer than one global batch of 64",
        ),
    ],
)
def test_unusable_data_is_refused(content, extra_arguments, message, model_dir, tmp_path, monkeypatch):
    data_file = tmp_path / "data.txt"
    data_file.write_bytes(content)
    with pytest.raises(run_clm_flax.UsageError, match=message):
        run_main(monkeypatch, arguments(
            model_dir, tmp_path / "out", "--train_file", str(data_file),
            "--validation_file", str(CORPUS / "validation.txt"),
            *extra_arguments,
        ))  # fmt: skip


def test_pickle_weights_load_only_on_request(model_dir, tmp_path, monkeypatch):
    checkpoint = tmp_path / "pickled"
    torch.manual_seed(0)
    torch_model = GPT2LMHeadModel(GPT2Config.from_pretrained(model_dir))
    # The layout of older checkpoints: a config and a pickled state dict, no safetensors.
    torch_model.config.save_pretrained(checkpoint)
    torch.save(torch_model.state_dict(), checkpoint / "pytorch_model.bin")
    evaluate = [
        "--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(checkpoint), "--tokenizer_name", model_dir,
        "--validation_file", str(CORPUS / "validation.txt"), "--do_eval", "--block_size", "32",
    ]  # fmt: skip
    with pytest.raises(run_clm_flax.UsageError, match="--allow_pickle_weights"):
        run_main(monkeypatch, evaluate)
    run_main(monkeypatch, [*evaluate, "--allow_pickle_weights"])
    assert json.loads((tmp_path / "out" / "eval_results.json").read_text())["eval_loss"] > 0


def test_remote_code_is_never_run(model_dir, tmp_path, monkeypatch):
    config_dir = tmp_path / "remote-code"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(
        json.dumps({"model_type": "custom", "auto_map": {"AutoConfig": "custom.Config"}})
    )
    marker = tmp_path / "remote-code-ran"
    (config_dir / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Config: pass\n")
    with pytest.raises(run_clm_flax.UsageError, match="cannot load --config_name"):
        run_main(monkeypatch, arguments(model_dir, tmp_path / "out", "--config_name", str(config_dir)))
    assert not marker.exists()
