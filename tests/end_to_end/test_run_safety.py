"""An output directory under hostile conditions: two runs at once, stale or damaged checkpoints, leftovers of a
killed run, and the one resume command that is safe to repeat until the run is done.

Each case starts from a copy of one short complete run (checkpoints at steps 2, 4 and 6), damages or prepares
it, runs the script again, and checks the outcome: the run works and ends with the weights of the untouched
run, or it stops with one line and leaves the directory as it was.
"""

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from jax.experimental.compilation_cache import compilation_cache
from safetensors.numpy import load_file, save_file
from test_clm import OFFLINE_ENV, model_dir_with_config, run_clm_flax
from test_mlm import run_mlm_flax

import flax_lm.run.output_dir
import flax_lm.training.compilation
from flax_lm.errors import UsageError
from flax_lm.models.huggingface import read_exported_params, read_safetensors_checkpoint
from flax_lm.run.checkpoints import open_checkpoints
from flax_lm.run.checksums import CHECKPOINT_CHECKSUMS, SAVED_WITH_CHECKSUMS, checkpoint_checksum_problem
from flax_lm.run.output_dir import OUTPUT_DIR_LOCK, lock_output_dir
from flax_lm.run.run_files import RUN_FILES, run_files
from flax_lm.run.tracking import TrainingLog

CORPUS = FIXTURES_DIR / "en"


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("safety-model"), n_layer=1)


@pytest.fixture(scope="module", autouse=True)
def cached_environment(tmp_path_factory):
    """Compiling is most of these runs' time: every run here, in this process or another, shares one compilation
    cache, so each program is compiled once."""
    cache_dir = str(tmp_path_factory.mktemp("compilation-cache"))
    settings = {"jax_compilation_cache_dir": cache_dir, "jax_persistent_cache_min_compile_time_secs": 0}
    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    yield {**OFFLINE_ENV, "JAX_COMPILATION_CACHE_DIR": cache_dir, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    for name, value in previous.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def arguments(model_dir, output_dir, *extra):
    return [
        "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", str(CORPUS / "train.txt"), "--do_train", "--block_size", "32",
        "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--seed", "0", "--sample_tokens", "0",
        "--max_steps", "6", "--logging_steps", "2", "--save_steps", "2", "--save_total_limit", "10", *extra,
    ]  # fmt: skip


def run_main(monkeypatch, argument_list):
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *argument_list])
    run_clm_flax.main()


@pytest.fixture(scope="module")
def complete_run(model_dir, cached_environment, tmp_path_factory):
    """A run of 6 steps, checkpoints at 2, 4 and 6; every case works on a copy of it. In this process, as the cases
    run the script: its programs are then compiled and cached once for all of them."""
    output_dir = tmp_path_factory.mktemp("complete")
    with pytest.MonkeyPatch.context() as monkeypatch:
        run_main(monkeypatch, arguments(model_dir, output_dir))
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["2", "4", "6"]
    return output_dir


def copy_of(complete_run, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(complete_run, output_dir)
    return output_dir


def assert_same_weights(output_dir, expected_dir):
    final, expected = (
        load_file(str(output_dir / "model.safetensors")),
        load_file(str(expected_dir / "model.safetensors")),
    )
    assert final.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)


def snapshot(directory) -> dict:
    """Every file under `directory` with its size and modification time, but the lock (which names its holder)."""
    return {
        os.path.relpath(os.path.join(root, name), directory): (
            os.path.getsize(os.path.join(root, name)),
            os.path.getmtime(os.path.join(root, name)),
        )
        for root, _, names in os.walk(directory)
        for name in names
        if name != OUTPUT_DIR_LOCK
    }


def largest_data_file(checkpoint):
    files = [os.path.join(root, name) for root, _, names in os.walk(checkpoint / "state") for name in names]
    return max((path for path in files if f"{os.sep}d{os.sep}" in path), key=os.path.getsize)


def truncate_largest_data_file(checkpoint):
    os.truncate(largest_data_file(checkpoint), os.path.getsize(largest_data_file(checkpoint)) // 2)


def overwrite_bytes_of_largest_data_file(checkpoint):
    """Bytes changed in place, the file's size kept: what Orbax restores without a complaint, as NaN or worse."""
    path = largest_data_file(checkpoint)
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        file.write(b"\xff" * 1000)


def as_saved_before_checksums(checkpoint):
    """A checkpoint as versions of before checksums saved it: no checksums.json, and no word of one in its record."""
    os.remove(checkpoint / CHECKPOINT_CHECKSUMS)
    record = json.loads((checkpoint / "progress" / "metadata").read_text())
    del record[SAVED_WITH_CHECKSUMS]
    (checkpoint / "progress" / "metadata").write_text(json.dumps(record))


# How a checkpoint gets damaged: a disk filling up, a copy cut short, a file system losing a write. Each is found
# by the checkpoint's checksums; these damage checkpoints saved before there were checksums, which Orbax must find.
DAMAGE = {
    "truncated data file": truncate_largest_data_file,
    "corrupt _METADATA": lambda checkpoint: (checkpoint / "state" / "_METADATA").write_text('{"tree_metadata": {'),
    "corrupt manifest.ocdbt": lambda checkpoint: (checkpoint / "state" / "manifest.ocdbt").write_bytes(b"\0" * 16),
    "corrupt progress JSON": lambda checkpoint: (checkpoint / "progress" / "metadata").write_text('{"step": 6, "tr'),
    "progress record of another step": lambda checkpoint: (checkpoint / "progress" / "metadata").write_text(
        json.dumps({**json.loads((checkpoint / "progress" / "metadata").read_text()), "step": 5})
    ),
}  # fmt: skip


# Orbax leaves the reads of a checkpoint it failed to read to a closed event loop, which each ends in an exception
# ignored in TensorStore's threads: flax_lm.run.checkpoints silences those. Others it leaves (a read's coroutine that
# never ended, seen once in a whole suite) may still print as pytest's unraisable-exception warnings: not failures.
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(
    model_dir, damage, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = copy_of(complete_run, tmp_path)
    as_saved_before_checksums(output_dir / "checkpoints" / "6")
    DAMAGE[damage](output_dir / "checkpoints" / "6")
    os.remove(output_dir / "model.safetensors")

    run_main(monkeypatch, arguments(model_dir, output_dir, "--resume_from_checkpoint"))
    log = capfd.readouterr().err
    assert f"skipping the training checkpoint {output_dir}/checkpoints/6: it is unreadable" in log
    assert f"Resumed from {output_dir}/checkpoints/4 at step 4" in log
    assert "does not fit" not in log
    # The damaged checkpoint is kept aside for inspection, and this run's own step 6 was saved in its place.
    assert os.listdir(output_dir / "discarded-checkpoints") == ["6"]
    assert "step 6: training checkpoint committed" in log
    assert_same_weights(output_dir, complete_run)


def remove_checksum_of(checkpoint, relative_path):
    checksums = json.loads((checkpoint / CHECKPOINT_CHECKSUMS).read_text())
    del checksums[relative_path]
    (checkpoint / CHECKPOINT_CHECKSUMS).write_text(json.dumps(checksums))


# What is done to the checksums of a checkpoint whose bytes were changed, and the damage the resume must name.
CHECKSUMS_TAMPERING = {
    "left as they are": (lambda checkpoint, changed: None, "its file {changed} differs from the checksum taken"),
    "checksums.json deleted": (
        lambda checkpoint, changed: os.remove(checkpoint / CHECKPOINT_CHECKSUMS),
        "its checksums.json is missing, though its progress record says it was saved with one",
    ),
    "the changed file's checksum taken out": (
        remove_checksum_of,
        "its file {changed} is not in its checksums.json (the list was edited or cut short",
    ),
}


@pytest.mark.parametrize("tampering", CHECKSUMS_TAMPERING)
def test_a_checkpoint_whose_bytes_changed_at_the_same_size_is_found_by_its_checksums_and_skipped(
    model_dir, tampering, complete_run, tmp_path, monkeypatch, capfd
):
    """Also where its checksums were deleted or edited: its record says it was saved with them."""
    output_dir = copy_of(complete_run, tmp_path)
    overwrite_bytes_of_largest_data_file(output_dir / "checkpoints" / "6")
    changed = os.path.relpath(largest_data_file(output_dir / "checkpoints" / "6"), output_dir / "checkpoints" / "6")
    tamper, reason = CHECKSUMS_TAMPERING[tampering]
    tamper(output_dir / "checkpoints" / "6", changed)

    run_main(monkeypatch, arguments(model_dir, output_dir, "--resume_from_checkpoint"))
    log = capfd.readouterr().err
    assert (
        f"skipping the training checkpoint {output_dir}/checkpoints/6: it is damaged ({reason.format(changed=changed)}"
    ) in log
    assert f"Resumed from {output_dir}/checkpoints/4 at step 4" in log
    assert "has no checksums" not in log
    # Nothing of the changed bytes was trained on, and the checkpoint this run saved in its place verifies.
    assert_same_weights(output_dir, complete_run)
    assert checkpoint_checksum_problem(str(output_dir / "checkpoints" / "6")) is None


def test_a_non_finite_step_names_the_newest_intact_checkpoint_as_the_last_good_one(complete_run, tmp_path):
    output_dir = copy_of(complete_run, tmp_path)
    overwrite_bytes_of_largest_data_file(output_dir / "checkpoints" / "6")
    with open_checkpoints(str(output_dir), 10) as checkpoints:
        message = str(TrainingLog.nonfinite_error(7, checkpoints))
    assert f"the last good checkpoint is {output_dir}/checkpoints/4." in message and "checkpoints/6" not in message


def test_a_non_finite_step_after_a_checkpoint_without_checksums_does_not_call_it_good(complete_run, tmp_path):
    """A checkpoint saved before checkpoints had checksums cannot be checked: named, but not as good."""
    output_dir = copy_of(complete_run, tmp_path)
    as_saved_before_checksums(output_dir / "checkpoints" / "6")
    with open_checkpoints(str(output_dir), 10) as checkpoints:
        message = str(TrainingLog.nonfinite_error(7, checkpoints))
    assert f"the newest checkpoint is {output_dir}/checkpoints/6, saved without checksums" in message
    assert "last good" not in message


@pytest.mark.parametrize("damage", ["truncated data file", "corrupt progress JSON"])
def test_a_damaged_checkpoint_asked_for_by_path_is_refused_in_one_line(
    model_dir, damage, complete_run, tmp_path, monkeypatch
):
    output_dir = copy_of(complete_run, tmp_path)
    DAMAGE[damage](output_dir / "checkpoints" / "6")
    before = snapshot(output_dir)
    resume = arguments(model_dir, output_dir, "--resume_from_checkpoint", str(output_dir / "checkpoints" / "6"))
    with pytest.raises(
        run_clm_flax.UsageError,
        match=r"checkpoints/6 is damaged \(its file .* differs .*\); resume from an earlier one",
    ) as error:
        run_main(monkeypatch, resume)
    assert "\n" not in str(error.value) and "config" not in str(error.value)
    assert snapshot(output_dir) == before


def test_a_leftover_temporary_checkpoint_blocks_neither_a_resume_nor_a_fresh_start(
    model_dir, complete_run, tmp_path, monkeypatch
):
    # A run killed while writing checkpoint 6: Orbax leaves it under a temporary name.
    output_dir = copy_of(complete_run, tmp_path)
    unfinished = output_dir / "checkpoints" / "6.orbax-checkpoint-tmp-1234"
    os.rename(output_dir / "checkpoints" / "6", unfinished)
    run_main(monkeypatch, arguments(model_dir, output_dir, "--resume_from_checkpoint"))
    assert not unfinished.exists()
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["2", "4", "6"]
    assert_same_weights(output_dir, complete_run)

    # A run killed before its first checkpoint was complete leaves only the temporary directory.
    fresh_dir = tmp_path / "fresh"
    (fresh_dir / "checkpoints" / "2.orbax-checkpoint-tmp-99").mkdir(parents=True)
    run_main(monkeypatch, arguments(model_dir, fresh_dir))
    assert sorted(os.listdir(fresh_dir / "checkpoints"), key=int) == ["2", "4", "6"]
    assert_same_weights(fresh_dir, complete_run)


def test_resume_with_nothing_to_resume_starts_a_new_run(model_dir, complete_run, tmp_path, monkeypatch, capfd):
    output_dir = tmp_path / "new"
    run_main(monkeypatch, arguments(model_dir, output_dir, "--resume_from_checkpoint"))
    assert "No training checkpoint to resume from" in capfd.readouterr().err
    assert_same_weights(output_dir, complete_run)


def test_resume_of_a_complete_run_exits_cleanly_and_only_fills_in_what_is_missing(
    model_dir, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = copy_of(complete_run, tmp_path)
    os.remove(output_dir / "model.safetensors")
    evaluate = ["--do_eval", "--validation_file", str(CORPUS / "validation.txt"), "--resume_from_checkpoint"]
    run_main(monkeypatch, arguments(model_dir, output_dir, *evaluate))
    log = capfd.readouterr().err
    assert "The run is complete (step 6 of 6)" in log and "exported the model" not in log
    assert_same_weights(output_dir, complete_run)
    assert (output_dir / "run_clm_flax.py").read_bytes() == (REPO_DIR / "run_clm_flax.py").read_bytes()
    assert json.loads((output_dir / "eval_results.json").read_text())["step"] == 6

    before = snapshot(output_dir)
    run_main(monkeypatch, arguments(model_dir, output_dir, *evaluate))
    assert "evaluation is in" in capfd.readouterr().err
    changed = {
        name for name in set(before) | set(snapshot(output_dir)) if before.get(name) != snapshot(output_dir).get(name)
    }
    # Only the logs: the new event file, and the record of it as the run's.
    assert all(name.startswith("tensorboard") or name == RUN_FILES for name in changed), changed


def test_a_resume_on_other_training_data_is_refused_unless_allowed_and_then_recorded(
    model_dir, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = copy_of(complete_run, tmp_path)
    lines = (CORPUS / "train.txt").read_text().splitlines(keepends=True)
    first_half = tmp_path / "first-half.txt"
    first_half.write_text("".join(lines[: len(lines) // 2]))
    resume = arguments(model_dir, output_dir, "--max_steps", "8", "--resume_from_checkpoint")
    resume[resume.index(str(CORPUS / "train.txt"))] = str(first_half)

    with pytest.raises(UsageError, match=r"differs from the checkpoint's in what it trains: the training data"):
        run_main(monkeypatch, resume)
    run_main(monkeypatch, [*resume, "--allow_resume_changes", "training_data"])
    log = capfd.readouterr().err
    assert "Resumed with a change allowed from step 6: the training data" in log
    assert "step 8: training checkpoint committed" in log
    (change,) = json.loads((output_dir / "train_results.json").read_text())["resume_changes"]
    assert change["step"] == 6 and change["name"] == "training_data"

    run_main(monkeypatch, resume)  # its own checkpoint, on the data it was trained on
    assert "the training data changed" not in capfd.readouterr().err


def test_a_train_only_resume_leaves_the_earlier_evaluation_out_of_all_results(
    model_dir, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = copy_of(complete_run, tmp_path)
    evaluate = ["--do_eval", "--validation_file", str(CORPUS / "validation.txt"), "--resume_from_checkpoint"]
    run_main(monkeypatch, arguments(model_dir, output_dir, *evaluate))
    assert json.loads((output_dir / "all_results.json").read_text())["step"] == 6
    evaluation = (output_dir / "eval_results.json").read_text()

    run_main(monkeypatch, arguments(model_dir, output_dir, "--max_steps", "8", "--resume_from_checkpoint"))
    all_results = json.loads((output_dir / "all_results.json").read_text())
    assert all_results["train_steps"] == 8
    assert not [name for name in all_results if name.startswith("eval_") or name in ("perplexity", "step")]
    assert (output_dir / "eval_results.json").read_text() == evaluation
    assert (
        "eval_results.json holds the evaluation of step 6, not of the trained model's step 8, so all_results.json "
        "leaves it out; resume with --do_eval to evaluate the trained model"
    ) in capfd.readouterr().err


def test_overwrite_removes_the_previous_runs_checkpoints_and_logs_which(
    model_dir, complete_run, tmp_path, monkeypatch, capfd
):
    # The earlier run saved at 2, 4 and 6; this one saves at 3 and 6: a stale 6 would take the place of its own.
    output_dir = copy_of(complete_run, tmp_path)
    run_main(monkeypatch, arguments(model_dir, output_dir, "--overwrite_output_dir", "--save_steps", "3"))
    log = capfd.readouterr().err
    assert (
        "--overwrite_output_dir: removed the previous run's checkpoints/, tensorboard/, code/, train_results.json"
        in log
    )
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["3", "6"]
    progress = json.loads((output_dir / "checkpoints" / "6" / "progress" / "metadata").read_text())
    assert progress["run"]["arguments"]["save_steps"] == 3
    assert len(os.listdir(output_dir / "tensorboard")) == 1


# Files of the user's put into a complete run's directory, beside and inside the run's own folders.
USER_FILES = {
    "checkpoints/notes.txt": "the user's notes, beside the checkpoints",
    "checkpoints/mine/important.bin": "a folder of the user's in checkpoints/",
    "tensorboard/notes.txt": "the user's notes, beside the logs",
    "code/0123456789ab/experiment.py": "# not the code of any run: its hash is not its folder's name",
    "run_mlm_flax.py": "# the user's own masked-LM script, which no run here copied",
    "notes.md": "the user's notes on the run",
}


@pytest.mark.parametrize("record", ["run_files.json", "none (a directory of an earlier version)"])
def test_overwrite_removes_what_runs_wrote_and_keeps_the_users_files_anywhere(
    model_dir, record, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = copy_of(complete_run, tmp_path)
    if record != "run_files.json":
        os.remove(output_dir / RUN_FILES)  # what is a run's is recognised by its content
    for path, text in USER_FILES.items():
        (output_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / path).write_text(text)
    # The export's tokenizer.json, linked to a file outside: the export replaces the link, and leaves the file.
    (tmp_path / "tokenizer.json").write_text("someone else's")
    os.replace(output_dir / "tokenizer.json", tmp_path / "exported-tokenizer.json")
    os.symlink(tmp_path / "tokenizer.json", output_dir / "tokenizer.json")

    run_main(monkeypatch, arguments(model_dir, output_dir, "--overwrite_output_dir", "--save_steps", "3"))
    assert (tmp_path / "tokenizer.json").read_text() == "someone else's"
    assert not (output_dir / "tokenizer.json").is_symlink()
    assert (output_dir / "tokenizer.json").read_text() == (tmp_path / "exported-tokenizer.json").read_text()
    log = capfd.readouterr().err
    assert "--overwrite_output_dir: removed the previous run's checkpoints/, tensorboard/, code/" in log
    assert (
        "--overwrite_output_dir: kept checkpoints/mine, checkpoints/notes.txt, code/0123456789ab, "
        "tensorboard/notes.txt, run_mlm_flax.py, which no run wrote"
    ) in log
    for path, text in USER_FILES.items():
        assert (output_dir / path).read_text() == text, path
    assert sorted(os.listdir(output_dir / "checkpoints")) == ["3", "6", "mine", "notes.txt"]
    assert len(os.listdir(output_dir / "tensorboard")) == 2  # the new run's events, the user's notes
    progress = json.loads((output_dir / "checkpoints" / "6" / "progress" / "metadata").read_text())
    assert progress["run"]["arguments"]["save_steps"] == 3
    recorded = json.loads((output_dir / RUN_FILES).read_text())["paths"]
    assert not [path for path in recorded if path in USER_FILES or path.startswith(("checkpoints/mine", "code/0"))]


# A record edited by hand or by another program, naming what no run writes inside its directory.
HOSTILE_RECORDS = {
    "a path up and out": "../../victim/file1",
    "an absolute path": "{victim}/file1",
    "a path out through ..": "checkpoints/../../../victim/file3",
    "the directory itself, as .": ".",
    "the directory itself, as an empty path": "",
    "a run's kind of file, through a link out": "tensorboard/events.out.tfevents.1",
    "a file of a kind no run writes": "notes.md",
}


@pytest.mark.parametrize("case", HOSTILE_RECORDS)
def test_overwrite_refuses_a_record_naming_anything_but_the_runs_files_inside_and_removes_nothing(case, tmp_path):
    victim, output_dir = tmp_path / "victim", tmp_path / "elsewhere" / "run"
    victim.mkdir()
    (output_dir / "checkpoints" / "2").mkdir(parents=True)
    for path in (victim / "file1", victim / "file3", victim / "events.out.tfevents.1", output_dir / "notes.md"):
        path.write_text("not the run's")
    os.symlink(victim, output_dir / "tensorboard")
    entry = HOSTILE_RECORDS[case].format(victim=victim)
    (output_dir / RUN_FILES).write_text(json.dumps({"paths": ["checkpoints/", "checkpoints/2", entry]}))
    before = snapshot(tmp_path)
    with pytest.raises(UsageError) as error:
        flax_lm.run.output_dir.clear_previous_run(str(output_dir), [])
    assert str(error.value).startswith(
        f"{output_dir / RUN_FILES}, the record of what runs wrote there, lists {entry!r}, which "
    )
    assert "\n" not in str(error.value)
    assert snapshot(tmp_path) == before and (output_dir / "checkpoints" / "2").is_dir()


def test_a_recorded_checkpoint_in_checkpoints_linked_to_another_disk_is_still_the_runs(tmp_path):
    """checkpoints/ may be a link (the checkpoints on another disk): what the record names in it is removed there."""
    output_dir, other_disk = tmp_path / "run", tmp_path / "other-disk"
    (other_disk / "2").mkdir(parents=True)
    output_dir.mkdir()
    os.symlink(other_disk, output_dir / "checkpoints")
    (output_dir / RUN_FILES).write_text(json.dumps({"paths": ["checkpoints/", "checkpoints/2"]}))
    flax_lm.run.output_dir.clear_previous_run(str(output_dir), [])
    assert os.listdir(other_disk) == [] and os.path.islink(output_dir / "checkpoints")


def test_output_files_that_are_links_are_replaced_as_links_never_written_through(tmp_path, caplog):
    """A results file, a code copy, the record and an export's files (written by save_pretrained, which opens them
    as they are) that are links to a file elsewhere: each becomes the run's file; the file elsewhere is unchanged."""
    elsewhere, output_dir = tmp_path / "elsewhere.txt", tmp_path / "run"
    elsewhere.write_text("someone else's")
    output_dir.mkdir()
    links = ["tokenizer.json", "train_results.json.tmp", "run_files.json.tmp", "run_clm_flax.py"]
    for name in [*links, "my-data.txt"]:
        os.symlink(elsewhere, output_dir / name)
    os.symlink(tmp_path / "nothing", output_dir / "config.json")  # a link to nothing: writing it would create that
    with caplog.at_level(logging.WARNING), flax_lm.run.output_dir.links_replaced(str(output_dir)):
        for name in ("tokenizer.json", "config.json"):
            with open(output_dir / name, "w") as file:  # as save_pretrained writes
                file.write("the export's")
    flax_lm.run.output_dir.write_json(str(output_dir / "train_results.json"), {"train_steps": 1})
    flax_lm.run.output_dir.keep_code_versions(str(output_dir), [str(REPO_DIR / "run_clm_flax.py")], 0)
    assert elsewhere.read_text() == "someone else's" and not (tmp_path / "nothing").exists()
    for name in ("tokenizer.json", "config.json", "train_results.json", "run_clm_flax.py", RUN_FILES):
        assert (output_dir / name).is_file() and not (output_dir / name).is_symlink(), name
    assert (output_dir / "tokenizer.json").read_text() == "the export's"
    assert os.readlink(output_dir / "my-data.txt") == str(elsewhere)  # a link the export does not write stays
    assert sorted(name for name in os.listdir(output_dir) if name.startswith(".")) == []
    assert f"replaced the link {output_dir / 'tokenizer.json'} (to {elsewhere})" in caplog.text


def test_an_unreadable_record_of_the_runs_files_is_refused_in_one_line_not_guessed_around(tmp_path):
    (tmp_path / RUN_FILES).write_text('{"paths": ["checkpoints/2"')  # cut short
    with pytest.raises(
        UsageError, match=r"run_files.json, the record of what runs wrote there, is unreadable; restore"
    ):
        run_files(str(tmp_path))


def test_overwrite_refuses_a_folder_of_the_users_named_as_a_step_and_changes_nothing(
    model_dir, complete_run, tmp_path, monkeypatch
):
    output_dir = copy_of(complete_run, tmp_path)
    (output_dir / "checkpoints" / "99").mkdir()
    (output_dir / "checkpoints" / "99" / "important.bin").write_bytes(b"the user's")
    before = snapshot(output_dir)
    with pytest.raises(UsageError) as error:
        run_main(monkeypatch, arguments(model_dir, output_dir, "--overwrite_output_dir"))
    assert str(error.value) == (
        f"--overwrite_output_dir: {output_dir}/checkpoints/99 was not written by a run of this directory, and Orbax "
        "would take it for the training checkpoint of its step; move it out of checkpoints/ (or rename it) and run "
        "again"
    )
    assert snapshot(output_dir) == before


def shard(model_dir, shard_count: int) -> dict:
    """Split MODEL_DIR/model.safetensors into transformers' shards and index, as large models are published; returns
    the tensors."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for number in range(shard_count):
        shard_name = f"model-{number + 1:05d}-of-{shard_count:05d}.safetensors"
        part = names[number::shard_count]
        save_file({name: tensors[name] for name in part}, str(model_dir / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard_name))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.remove(model_dir / "model.safetensors")
    return tensors


def test_continuing_a_sharded_model_in_place_leaves_one_model_that_every_loader_reads(
    model_dir, complete_run, tmp_path, monkeypatch, capfd
):
    """--model_name_or_path D --output_dir D: the export replaces the shards and their index, which no loader (this
    project's or transformers') may read afterwards as the model."""
    in_place = tmp_path / "model"
    shutil.copytree(
        complete_run,
        in_place,
        ignore=shutil.ignore_patterns("checkpoints", "tensorboard", "code", "*.py", "*_results.json", RUN_FILES),
    )
    started_from = shard(in_place, 3)

    run_main(
        monkeypatch,
        arguments(
            model_dir, in_place, "--model_name_or_path", str(in_place), "--overwrite_output_dir", "--max_steps", "2"
        ),
    )
    assert (
        "removed model-00001-of-00003.safetensors, model-00002-of-00003.safetensors, "
        "model-00003-of-00003.safetensors, model.safetensors.index.json"
    ) in capfd.readouterr().err
    assert not [name for name in os.listdir(in_place) if name.startswith("model") and name != "model.safetensors"]
    trained = load_file(str(in_place / "model.safetensors"))
    read_back = read_safetensors_checkpoint(str(in_place), None)
    assert any(not np.array_equal(trained[name], started_from[name]) for name in trained)
    for name in trained:
        np.testing.assert_array_equal(read_back[name], trained[name], err_msg=name)


def test_overwrite_through_a_link_to_another_disk_empties_the_checkpoints_there_and_keeps_the_link(
    model_dir, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = copy_of(complete_run, tmp_path)
    other_disk = tmp_path / "other-disk" / "checkpoints"
    other_disk.parent.mkdir()
    shutil.move(output_dir / "checkpoints", other_disk)
    os.symlink(other_disk, output_dir / "checkpoints")
    (other_disk / "notes.txt").write_text("the user's own file, beside the checkpoints")

    run_main(monkeypatch, arguments(model_dir, output_dir, "--overwrite_output_dir", "--save_steps", "3"))
    log = capfd.readouterr().err
    target = os.path.realpath(other_disk)
    assert f"removed the previous run's checkpoints/ (in {target}, where the link leads), tensorboard/" in log
    assert os.readlink(output_dir / "checkpoints") == str(other_disk)
    assert sorted(os.listdir(other_disk)) == ["3", "6", "notes.txt"]
    progress = json.loads((other_disk / "6" / "progress" / "metadata").read_text())
    assert progress["run"]["arguments"]["save_steps"] == 3


def test_the_loader_reads_model_safetensors_before_an_index_beside_it_as_transformers_does(tmp_path):
    save_file({"weight": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    save_file({"weight": np.zeros(2, np.float32)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    weight_map = {"weight": "model-00001-of-00001.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_array_equal(read_safetensors_checkpoint(str(tmp_path), None)["weight"], np.ones(2))


def test_a_directory_with_an_export_of_own_code_and_weights_for_transformers_is_refused(tmp_path):
    """transformers would load model.safetensors, this project's tools flax_model.safetensors: two models."""
    save_file({"weight": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    save_file({"weight": np.zeros(2, np.float32)}, str(tmp_path / "flax_model.safetensors"))
    with pytest.raises(
        UsageError, match="holds both flax_model.safetensors and model.safetensors, which transformers"
    ):
        read_exported_params(str(tmp_path), None, None, None)


def test_a_file_of_the_users_in_the_way_of_a_code_copy_is_moved_aside_and_said(tmp_path, caplog):
    """The script's and the model file's copies, where the output directory holds a file of that name that is no
    version of the run's code: the user's own, or the run's copy edited since."""
    output_dir, experiment = tmp_path / "run", tmp_path / "experiment"
    output_dir.mkdir()
    experiment.mkdir()
    (experiment / "same.py").write_text("# the experiment's model file\n")
    (output_dir / "same.py").write_text("# the user's own file of the same name\n")
    code_files = [str(REPO_DIR / "run_clm_flax.py"), str(experiment / "same.py")]
    new_run = flax_lm.run.output_dir.OutputDirSettings(
        output_dir=str(output_dir), do_train=True, overwrite_output_dir=True, resume_from_checkpoint=None
    )
    with caplog.at_level(logging.WARNING):
        flax_lm.run.output_dir.prepare_output_dir(new_run, 0, code_files).release()
    assert f"moved your same.py in {output_dir} to same.py.kept" in caplog.text
    assert (output_dir / "same.py.kept").read_text() == "# the user's own file of the same name\n"
    assert (output_dir / "same.py").read_text() == "# the experiment's model file\n"

    # The run's copy of the script, edited by the user after the run: a new run in the directory keeps the edit.
    (output_dir / "run_clm_flax.py").write_text("# the user's edit of the copy\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        flax_lm.run.output_dir.prepare_output_dir(new_run, 0, code_files).release()
    assert f"moved your run_clm_flax.py in {output_dir} to run_clm_flax.py.kept" in caplog.text
    assert (output_dir / "run_clm_flax.py.kept").read_text() == "# the user's edit of the copy\n"
    assert (output_dir / "run_clm_flax.py").read_bytes() == (REPO_DIR / "run_clm_flax.py").read_bytes()
    assert (output_dir / "same.py.kept").is_file() and not (output_dir / "same.py.kept-2").exists()


def test_a_disk_without_room_for_a_checkpoint_stops_the_run_in_one_line_before_anything_is_written(
    model_dir, tmp_path, monkeypatch
):
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=100_000))
    output_dir = tmp_path / "full"
    with pytest.raises(UsageError) as error:
        run_main(monkeypatch, arguments(model_dir, output_dir))
    assert re.fullmatch(
        rf"the disk of {output_dir}/checkpoints has 0\.1 MB free, less than the 0\.\d MB that the training checkpoint "
        r"and model of step 2 take; nothing of them was written: free some space there, then continue with "
        r"--resume_from_checkpoint",
        str(error.value),
    )
    assert os.listdir(output_dir / "checkpoints") == [] and not (output_dir / "model.safetensors").exists()


def test_a_second_run_in_a_directory_in_use_stops_in_one_line_and_changes_nothing(
    model_dir, complete_run, tmp_path, monkeypatch
):
    output_dir = copy_of(complete_run, tmp_path)
    before = snapshot(output_dir)
    # Another run holds the lock (a lock taken by another open file, as another process's would be).
    with open(output_dir / ".lock", "a+") as other_run:
        fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in ([], ["--overwrite_output_dir"], ["--resume_from_checkpoint"]):
            with pytest.raises(run_clm_flax.UsageError, match=f"--output_dir {output_dir} is in use by another run"):
                run_main(monkeypatch, arguments(model_dir, output_dir, *extra))
    assert snapshot(output_dir) == before


def test_a_checkpoint_announced_as_committed_survives_sigkill_and_the_lock_does_not(
    model_dir, cached_environment, complete_run, tmp_path, monkeypatch, capfd
):
    output_dir = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, str(REPO_DIR / "run_clm_flax.py"), *arguments(model_dir, output_dir)],
        env=cached_environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    announced = None
    for line in process.stderr:
        if "training checkpoint committed to" in line:
            announced = int(line.split("step ")[1].split(":")[0])
            process.kill()
            break
    process.wait()
    assert announced is not None, "the run ended before announcing a checkpoint"

    run_main(monkeypatch, arguments(model_dir, output_dir, "--resume_from_checkpoint"))
    resumed = [line for line in capfd.readouterr().err.splitlines() if "Resumed from" in line]
    assert len(resumed) == 1 and int(resumed[0].split("at step ")[1]) >= announced
    assert_same_weights(output_dir, complete_run)


def test_divergence_without_a_checkpoint_is_one_line_and_does_not_advise_resuming(
    model_dir, tmp_path, monkeypatch, capfd
):
    diverging = arguments(
        model_dir, tmp_path / "diverged", "--learning_rate", "1e30", "--max_grad_norm", "0", "--save_steps", "100",
        "--logging_steps", "1",
    )  # fmt: skip
    with pytest.raises(run_clm_flax.UsageError) as error:
        run_main(monkeypatch, diverging)
    message = str(error.value)
    assert message.startswith("the loss or gradient norm is not finite at step") and "\n" not in message
    assert "no training checkpoint was saved yet" in message and "--resume_from_checkpoint" not in message
    # The progress bar's line is ended, so the error the script prints next starts a line of its own.
    assert capfd.readouterr().err.endswith("\n")


# ----------------------------------------------------------------------------------------------------
# run_mlm_flax.py shares the checkpoint code; its own part is the order of the steps in main()
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roberta_dir(run_tool, roberta_tokenizer_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("safety-roberta")
    shutil.copytree(roberta_tokenizer_dir, directory, dirs_exist_ok=True)
    result = run_tool(
        "create_config.py", "--preset", "roberta-tiny", "--tokenizer_dir", directory,
        "--set", "num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return str(directory)


def mlm_arguments(roberta_dir, output_dir, *extra) -> list[str]:
    return [
        "run_mlm_flax.py", "--output_dir", str(output_dir), "--config_name", roberta_dir,
        "--tokenizer_name", roberta_dir, "--train_file", str(CORPUS / "train.txt"), "--do_train",
        "--max_seq_length", "32", "--per_device_train_batch_size", "4", "--max_steps", "4", "--save_steps", "2",
        "--logging_steps", "2", "--fill_mask_top_k", "0", *extra,
    ]  # fmt: skip


def test_masked_lm_runs_one_at_a_time_resume_past_damage_and_stop_when_complete(
    roberta_dir, tmp_path, monkeypatch, capfd
):
    output_dir = tmp_path / "mlm"

    def run(*extra):
        monkeypatch.setattr(sys, "argv", mlm_arguments(roberta_dir, output_dir, *extra))
        run_mlm_flax.main()
        return capfd.readouterr().err

    assert "No training checkpoint to resume from" in run("--resume_from_checkpoint")
    final_weights = load_file(str(output_dir / "model.safetensors"))
    assert "The run is complete (step 4 of 4)" in run("--resume_from_checkpoint")

    DAMAGE["corrupt progress JSON"](output_dir / "checkpoints" / "4")
    log = run("--resume_from_checkpoint")
    assert "skipping the training checkpoint" in log and "at step 2" in log
    assert "step 4: training checkpoint committed" in log
    resumed_weights = load_file(str(output_dir / "model.safetensors"))
    for name in final_weights:
        np.testing.assert_array_equal(resumed_weights[name], final_weights[name], err_msg=name)

    with open(output_dir / ".lock", "a+") as other_run:
        fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(run_mlm_flax.UsageError, match="is in use by another run"):
            run("--overwrite_output_dir")
    log = run("--overwrite_output_dir")
    assert "removed the previous run's checkpoints/, discarded-checkpoints/, tensorboard/" in log
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["2", "4"]


def test_a_masked_lm_in_a_causal_lm_run_is_told_whose_checkpoints_they_are_and_overwrites_all_of_it(
    roberta_dir, complete_run, tmp_path, monkeypatch
):
    output_dir = copy_of(complete_run, tmp_path)
    before = snapshot(output_dir)
    monkeypatch.setattr(sys, "argv", mlm_arguments(roberta_dir, output_dir, "--resume_from_checkpoint"))
    with pytest.raises(run_mlm_flax.UsageError) as error:
        run_mlm_flax.main()
    assert str(error.value) == (
        f"the training checkpoint {output_dir}/checkpoints/6 is of a causal language model, saved by run_clm_flax.py "
        "or a copy of it, not of this script's masked one: resume it with the script that saved it, or train into "
        "another --output_dir"
    )
    assert snapshot(output_dir) == before

    # A new run in its place leaves nothing of the causal LM's beside the RoBERTa that would claim to be part of it.
    monkeypatch.setattr(sys, "argv", mlm_arguments(roberta_dir, output_dir, "--overwrite_output_dir"))
    run_mlm_flax.main()
    assert json.loads((output_dir / "config.json").read_text())["architectures"] == ["RobertaForMaskedLM"]
    assert (output_dir / "run_mlm_flax.py").is_file()
    assert not (output_dir / "run_clm_flax.py").exists() and not (output_dir / "generation_config.json").exists()


def test_a_run_that_finds_the_directory_locked_names_the_run_holding_it(tmp_path):
    held = lock_output_dir(str(tmp_path))
    holder = rf"\(process {os.getpid()} on {re.escape(socket.gethostname())}\)"
    with pytest.raises(UsageError, match=rf"--output_dir {tmp_path} is in use by another run {holder}"):
        lock_output_dir(str(tmp_path))
    held.release()  # as when the holder ends: the lock is free again, and names its new holder
    lock_output_dir(str(tmp_path)).release()
    assert (tmp_path / OUTPUT_DIR_LOCK).read_text() == f"process {os.getpid()} on {socket.gethostname()}\n"


def test_a_compiled_program_swapped_with_another_in_the_cache_is_compiled_again(tmp_path, caplog):
    """JAX finds an entry by its file's name alone: another program's bytes there failed every run (an AssertionError
    on the count of outputs) until the cache was cleared."""
    settings = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    previous = {name: getattr(jax.config, name) for name in settings}
    try:
        flax_lm.training.compilation.use_compilation_cache(str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        compilation_cache.reset_cache()
        two_outputs, one_output = jax.jit(lambda x: (x + 1, x * 2)), jax.jit(lambda x: x - 1)
        two_outputs(np.ones(3)), one_output(np.ones(3))
        first, second = sorted(path for path in tmp_path.iterdir() if path.name.endswith("-cache"))
        first_bytes = first.read_bytes()
        first.write_bytes(second.read_bytes())
        second.write_bytes(first_bytes)
        jax.clear_caches()
        compilation_cache.reset_cache()
        with caplog.at_level(logging.WARNING, logger=flax_lm.training.compilation.logger.name):
            plus_one, times_two = two_outputs(np.ones(3))
            minus_one = one_output(np.ones(3))
        np.testing.assert_array_equal(np.stack([plus_one, times_two, minus_one]), [[2] * 3, [2] * 3, [0] * 3])
        assert caplog.text.count("holds the program of another entry; compiling its own again") == 2
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def test_checkpoints_are_set_aside_across_disks_where_checkpoints_is_a_link(tmp_path, monkeypatch):
    """A rename cannot cross from a checkpoints/ linked to another disk into OUTPUT_DIR: the checkpoint is copied."""
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in ("4", "6"):
        (checkpoints / step).mkdir(parents=True)
        (checkpoints / step / "state").write_text(step)

    def rename_within_one_disk_only(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(source))

    monkeypatch.setattr(os, "rename", rename_within_one_disk_only)
    flax_lm.run.output_dir.set_aside_checkpoints_after(str(tmp_path / "run"), 4)
    assert os.listdir(checkpoints) == ["4"]
    assert (tmp_path / "run" / "discarded-checkpoints" / "6" / "state").read_text() == "6"
