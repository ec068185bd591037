"""The command line of the training scripts: what the flags mean after check_arguments, which errors reach the user
as one line, and the log format the four scripts share. All in this process, before any data or model is read."""

import errno
import json
import re
import sys

import pytest
from safetensors import SafetensorError
from test_clm import run_clm_flax
from test_hostile_inputs import SCRIPTS

from flax_lm import errors
from flax_lm.command_line import arguments as training_arguments
from flax_lm.command_line import start
from flax_lm.evaluation.validation import EvaluationSchedule
from flax_lm.models.huggingface import shard_size_in_bytes
from flax_lm.run.best_model import BestModelSettings

TRAINING_SCRIPTS = ["run_clm_flax", "run_mlm_flax"]


def parse_arguments(module):
    """The argument groups of sys.argv, parsed into the script's own classes as its main() does."""
    return training_arguments.parse_training_arguments(
        module.ModelArguments, module.DataTrainingArguments, module.TrainingArguments
    )


@pytest.fixture
def checked_arguments(tmp_path, monkeypatch):
    """Parse and check a command line as a training script's main() does; returns the argument groups."""

    def check(script, *arguments):
        module = SCRIPTS[script]
        command_line = ["--output_dir", str(tmp_path / "out"), "--tokenizer_name", "a-tokenizer", *arguments]
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *command_line])
        model_args, data_args, training_args, _ = parse_arguments(module)
        start.check_flag_tables(training_args, module.FLAG_TABLES)
        module.check_arguments(model_args, data_args, training_args)
        return model_args, data_args, training_args

    return check


@pytest.mark.parametrize(
    "flags, policy",
    [
        ([], None),
        (["--gradient_checkpointing"], "nothing_saveable"),
        (["--gradient_checkpointing", "true"], "nothing_saveable"),
        (["--gradient_checkpointing=False"], None),
        (["--gradient_checkpointing", "dots_saveable"], "dots_saveable"),
        (["--gradient_checkpointing", "dots_with_no_batch_dims_saveable"], "dots_with_no_batch_dims_saveable"),
    ],
)
@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_gradient_checkpointing_takes_the_hugging_face_boolean_or_a_policy(script, flags, policy, checked_arguments):
    model_args, _, _ = checked_arguments(script, "--train_file", "train.txt", *flags)
    assert model_args.gradient_checkpointing == policy


def test_each_part_of_flax_lm_receives_the_flags_of_its_settings(checked_arguments, tmp_path):
    flags = ["--train_file", "train.txt", "--do_train", "--do_eval", "--learning_rate", "0.003", "--optim", "lion"]
    flags += ["--per_device_train_batch_size", "3", "--eval_steps", "7", "--save_steps", "14", "--report_to"]
    flags += ["tensorboard", "--load_best_model_at_end", "--resume_from_checkpoint", "--allow_resume_changes", "optim"]
    _, _, training_args = checked_arguments("run_clm_flax", *flags)
    optimizer = training_args.optimizer_settings()
    assert (optimizer.optim, optimizer.learning_rate, optimizer.trains) == ("lion", 0.003, True)
    assert training_args.training_settings().optimizer == optimizer
    assert training_args.training_settings().per_device_train_batch_size == 3
    run = training_args.run_settings()
    assert run.output == training_args.output_dir_settings() and run.output.output_dir == str(tmp_path / "out")
    assert (run.resume.resume_from_checkpoint, run.resume.allowed_changes) == ("auto", ("optim",))
    assert run.resume.allows("optim") and not run.resume.allows("learning_rate")
    assert run.best_model == BestModelSettings(metric="eval_loss", greater_is_better=False, load_at_end=True)
    assert run.tensorboard_dir == str(tmp_path / "out" / "tensorboard")
    assert training_args.evaluation_schedule() == EvaluationSchedule(do_eval=True, eval_on_start=False, eval_steps=7)


TRAINER_NAMES = [
    (["--bf16"], "dtype", "bfloat16"),
    (["--bf16", "true"], "dtype", "bfloat16"),
    (["--bf16=False"], "dtype", "float32"),
    (["--dataset_text_field", "body"], "text_column_name", "body"),
    (["--dataset_num_proc", "3"], "preprocessing_num_workers", 3),
    (["--lr_scheduler_type", "cosine_with_min_lr", "--min_lr_rate", "0.1"], "lr_scheduler_type", "cosine"),
    (["--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "5"], "lr_scheduler_type", "constant"),
    (["--run_name", "baseline-3"], "run_name", "baseline-3"),
]


@pytest.mark.parametrize("flags, name, value", TRAINER_NAMES)
@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_trainer_and_trl_names_of_our_flags_mean_ours(script, flags, name, value, checked_arguments):
    groups = checked_arguments(script, "--train_file", "train.txt", *flags)
    assert [getattr(group, name) for group in groups if hasattr(group, name)] == [value]


@pytest.mark.parametrize("script, length_flag", [("run_clm_flax", "block_size"), ("run_mlm_flax", "max_seq_length")])
@pytest.mark.parametrize("alias", ["--max_length", "--max_seq_length"])
def test_trls_max_length_is_the_scripts_sequence_length(script, length_flag, alias, checked_arguments):
    _, data_args, _ = checked_arguments(script, "--train_file", "train.txt", f"{alias}=48")
    assert getattr(data_args, length_flag) == 48


def test_trainer_names_in_a_json_arguments_file_mean_ours(tmp_path, monkeypatch):
    arguments_file = tmp_path / "arguments.json"
    values = {"output_dir": str(tmp_path / "out"), "tokenizer_name": "t", "train_file": "t.txt"}
    arguments_file.write_text(json.dumps({**values, "bf16": True, "max_seq_length": 32, "dataset_text_field": "x"}))
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", str(arguments_file)])
    model_args, data_args, _, _ = parse_arguments(run_clm_flax)
    assert (model_args.dtype, data_args.block_size, data_args.text_column_name) == ("bfloat16", 32, "x")


@pytest.mark.parametrize(
    "size, size_in_bytes",
    [("5KiB", 5 * 2**10), ("64kib", 64 * 2**10), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("40KB", 40_000),
     ("500 MB", 500_000_000), ("1000", 1000)],
)  # fmt: skip
def test_max_shard_size_takes_the_units_transformers_takes(size, size_in_bytes):
    """save_pretrained's decimal units (huggingface_hub's parser) and the binary ones of transformers' own."""
    assert shard_size_in_bytes(size) == size_in_bytes


@pytest.mark.parametrize("size", ["lots", "0KB", "-5KB", "infGB", "nanKiB", "5XB", "KiB", "\u00b2", "0.5"])
def test_a_max_shard_size_that_is_not_a_positive_size_is_refused(size):
    with pytest.raises(ValueError):
        shard_size_in_bytes(size)


@pytest.mark.parametrize(
    "flags, advice",
    [
        (["--torch_compile"], "--torch_compile is not supported: the steps are compiled by XLA always"),
        (["--push_to_hub"], "--push_to_hub is not supported: upload the model after training with `hf upload`"),
        (["--fp16"], "--fp16 is not supported: pass --dtype float16"),
        (["--deepspeed", "ds.json"], "--deepspeed is not supported: spread the model over the devices with --mesh"),
        (["--dataloader_num_workers", "4"], "--dataloader_num_workers is not supported: batches are assembled"),
        (["--bf16=maybe"], "--bf16 takes true or false, not maybe"),
        (["--max_shard_size", "lots"], "--max_shard_size lots is not a size; pass one such as 5GB, 500MB"),
    ],
)
@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_trainer_flags_that_cannot_apply_are_refused_saying_what_to_do(script, flags, advice, checked_arguments):
    with pytest.raises(errors.UsageError, match=f"^{re.escape(advice)}"):
        checked_arguments(script, "--train_file", "train.txt", *flags)


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_every_train_file_given_is_read_listed_or_each_after_its_own_flag(script, checked_arguments):
    _, data_args, _ = checked_arguments(
        script, "--train_file", "a.txt", "--train_file", "b.csv", "c/*.jsonl.gz", "--validation_file", "v.txt"
    )
    assert data_args.train_file == ["a.txt", "b.csv", "c/*.jsonl.gz"] and data_args.validation_file == ["v.txt"]


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_neither_do_train_nor_do_eval_trains_and_evaluates_in_both_scripts(script, checked_arguments):
    _, _, training_args = checked_arguments(script, "--train_file", "train.txt")
    assert training_args.do_train and training_args.do_eval
    _, _, training_args = checked_arguments(script, "--validation_file", "validation.txt")
    assert not training_args.do_train and training_args.do_eval, "no training data: evaluate only"
    _, _, training_args = checked_arguments(script, "--train_file", "train.txt", "--packed_data_dir", "packed")
    assert not training_args.do_train and not training_args.do_eval, "only pack the data"
    _, _, training_args = checked_arguments(script, "--train_file", "train.txt", "--do_eval")
    assert not training_args.do_train and training_args.do_eval


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_float16_is_refused_on_cpu_only(script, checked_arguments, monkeypatch):
    module = SCRIPTS[script]
    monkeypatch.setattr(module.jax, "default_backend", lambda: "cpu")
    with pytest.raises(module.UsageError, match="--dtype float16 does not run on CPU.*bfloat16"):
        checked_arguments(script, "--train_file", "train.txt", "--dtype", "float16")
    monkeypatch.setattr(module.jax, "default_backend", lambda: "gpu")
    model_args, _, _ = checked_arguments(script, "--train_file", "train.txt", "--dtype", "float16")
    assert model_args.dtype == "float16"


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_a_mesh_shape_that_does_not_fit_the_devices_is_refused_before_any_work(script, checked_arguments):
    with pytest.raises(SCRIPTS[script].UsageError, match="--mesh_shape data=3,fsdp=3 has 9 devices but there are"):
        checked_arguments(script, "--train_file", "train.txt", "--mesh_shape", "data=3,fsdp=3")


@pytest.mark.parametrize(
    "script, flag, path",
    [
        ("run_clm_flax", "--model_name_or_path", "./my-model"),
        ("run_clm_flax", "--config_name", "../configs/my-model"),
        ("run_clm_flax", "--tokenizer_name", "~/my-tokenizer"),
        ("run_mlm_flax", "--model_name_or_path", "/no/such/model"),
        ("run_mlm_flax", "--config_name", "runs/gpt2/final"),
        ("run_mlm_flax", "--tokenizer_name", "runs/my-tokenizer"),  # ./runs exists: a path, not OWNER/NAME
    ],
)
def test_a_missing_local_model_directory_is_refused_naming_the_path_not_the_hub(
    script, flag, path, checked_arguments, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(SCRIPTS[script].UsageError) as error:
        checked_arguments(script, "--train_file", "train.txt", flag, path)
    assert str(error.value) == (
        f"{flag} {path}: no such directory; pass an existing directory, or a hub name such as openai-community/gpt2"
    )


@pytest.mark.parametrize("name", ["gpt2", "openai-community/gpt2"])
def test_a_hub_name_is_left_to_the_hub(name, checked_arguments, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_args, _, _ = checked_arguments("run_clm_flax", "--train_file", "train.txt", "--model_name_or_path", name)
    assert model_args.model_name_or_path == name


def test_training_from_scratch_without_a_tokenizer_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", "--output_dir", str(tmp_path), "--train_file", "t.txt"])
    model_args, data_args, training_args, _ = parse_arguments(run_clm_flax)
    with pytest.raises(run_clm_flax.UsageError, match="training from scratch needs --tokenizer_name"):
        run_clm_flax.check_arguments(model_args, data_args, training_args)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"output_dir": "out", "push_to_hub": True},
            "--push_to_hub is not supported: upload the model after training",
        ),
        ({"output_dir": "out", "remat_policy": "dots_saveable"}, "--gradient_checkpointing dots_saveable"),
        ({"output_dir": "out", "learning_rte": 1e-3}, "unknown argument --learning_rte"),
        ({"learning_rate": 1e-3}, "missing 1 required positional argument: 'output_dir'"),
        (["--output_dir", "out"], "must hold one JSON object"),
    ],
)
def test_a_json_arguments_file_is_refused_in_one_line_as_the_command_line_is(values, message, tmp_path, monkeypatch):
    arguments_file = tmp_path / "arguments.json"
    arguments_file.write_text(json.dumps(values))
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", str(arguments_file)])
    with pytest.raises(run_clm_flax.UsageError, match=message):
        parse_arguments(run_clm_flax)


def test_a_json_arguments_file_may_set_gradient_checkpointing_as_a_boolean(tmp_path, monkeypatch):
    arguments_file = tmp_path / "arguments.json"
    values = {"output_dir": str(tmp_path / "out"), "tokenizer_name": "t", "train_file": "t.txt"}
    arguments_file.write_text(json.dumps({**values, "gradient_checkpointing": True}))
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", str(arguments_file)])
    model_args, data_args, training_args, _ = parse_arguments(run_clm_flax)
    run_clm_flax.check_arguments(model_args, data_args, training_args)
    assert model_args.gradient_checkpointing == "nothing_saveable"


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_library_errors_for_user_mistakes_become_one_line_and_bugs_keep_their_traceback(script):
    module = SCRIPTS[script]
    assert module.call_with_one_line_errors is errors.call_with_one_line_errors, (
        "the script's command ends in the handler of flax_lm.errors"
    )
    offline = ConnectionError("Couldn't reach 'oscar' on the Hub (OfflineModeIsEnabled)")
    assert errors.user_error_message(offline).startswith("Couldn't reach 'oscar' on the Hub (OfflineModeIsEnabled);")
    damaged = SafetensorError("Error while deserializing header: HeaderTooLarge")
    assert "HeaderTooLarge" in errors.user_error_message(damaged)
    assert errors.user_error_message(module.UsageError("--x is wrong")) == "--x is wrong"
    full = OSError(errno.ENOSPC, "No space left on device", "/data/cache/text/train-00001.arrow")
    assert errors.user_error_message(full).startswith("the disk is full writing /data/cache/text/train-00001.arrow;")
    # Writing to /dev/full is how Linux says a disk is full; the error names no file, so the data loading names the
    # directory it writes into.
    with pytest.raises(OSError) as written_to_full_disk:
        with open("/dev/full", "w") as file:
            file.write("x")
    assert errors.user_error_message(written_to_full_disk.value).startswith("the disk is full;")
    with pytest.raises(module.UsageError, match="^the disk of --cache_dir /data/cache is full; free some space"):
        with errors.naming_a_full_disk("--cache_dir", "/data/cache"), open("/dev/full", "w") as file:
            file.write("x")
    with pytest.raises(PermissionError), errors.naming_a_full_disk("--cache_dir", "/data/cache"):
        raise PermissionError(13, "Permission denied")  # not a full disk: left as it is
    for bug in (KeyError("step"), TypeError("unsupported operand"), ConnectionResetError(104, "reset by peer")):
        assert errors.user_error_message(bug) is None
