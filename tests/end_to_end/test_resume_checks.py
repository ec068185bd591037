"""A resume compares the run it continues with its own: what changes the training (the data, the tokenizer, the
model, the loss-relevant flags, the optimizer and schedule) is refused in one line naming each difference, unless
--allow_resume_changes names it, which records it; what does not (a longer run, the intervals, the trackers) goes on
without a word. The run directory keeps every version of the code that trained it."""

import json
import shutil

import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from test_clm import OFFLINE_ENV, model_dir_with_config
from test_edited_copies import edited_copy, progress_record, run_copy, run_in_process, snapshot, training_arguments

from flax_lm.run.record import run_differences

CORPUS = FIXTURES_DIR / "en"


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("resume-checks-model"), n_layer=1)


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    return {
        **OFFLINE_ENV,
        "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("compilation-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path_factory.mktemp("script") / "run_clm_flax.py")


@pytest.fixture(scope="module")
def two_step_run(model_dir, environment, script, tmp_path_factory):
    """Two steps of the unedited script, checkpoints at 1 and 2."""
    output_dir = tmp_path_factory.mktemp("two-steps") / "run"
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "2", "--save_steps", "1")
    result = run_copy(script, environment, *arguments, "--learning_rate", "1e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def resume(two_step_run, tmp_path, model_dir, capfd, script, *extra, max_steps="3"):
    """The two-step run copied into tmp_path and resumed by `script` with `extra` arguments, in this process."""
    output_dir = tmp_path / "run"
    shutil.copytree(two_step_run, output_dir)
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", max_steps, "--save_steps", "1")
    arguments = [*arguments, "--learning_rate", "1e-3", "--resume_from_checkpoint", *extra]
    return output_dir, run_in_process(script, capfd, *arguments)


def other_tokenizer_dir(model_dir, directory):
    """The model directory with a tokenizer of the same vocabulary size whose ids differ: two merges swapped."""
    shutil.copytree(model_dir, directory)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


CHANGES = {
    "learning rate": (["--learning_rate", "5e-2"], "--learning_rate 0.001 there, 0.05 here"),
    "weight decay": (["--weight_decay", "0.1"], "--weight_decay 0.0 there, 0.1 here"),
    "document attention": (["--document_attention"], "--document_attention False there, True here"),
    "seed": (["--seed", "7"], "--seed 0 there, 7 here"),
    "FP8 products": (["--fp8"], "--fp8 False there, True here"),
}


def test_a_resume_that_changes_the_training_is_refused_naming_each_difference(
    two_step_run, model_dir, script, tmp_path, capfd
):
    extra = [argument for arguments, _ in CHANGES.values() for argument in arguments]
    before = snapshot(two_step_run)
    output_dir, result = resume(two_step_run, tmp_path, model_dir, capfd, script, *extra)
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: the resumed run differs from the checkpoint's in what it trains: ")
    for change, (_, difference) in CHANGES.items():
        assert difference in last_line, f"{change}: {last_line}"
    allowed = last_line.split("--allow_resume_changes ")[1].split()[0]  # one argument, ready to pass
    assert set(allowed.split(",")) == {"learning_rate", "weight_decay", "document_attention", "seed", "fp8"}, last_line
    assert "Traceback" not in result.stderr
    assert snapshot(output_dir) == before


def test_a_checkpoint_from_before_fp8_was_recorded_counts_as_trained_without_it():
    code = {"file": "flax_lm/models/gpt2.py", "fingerprint": "0123456789abcdef"}
    before_fp8 = {"arguments": {"seed": 0}, "model_code": code}
    assert run_differences(before_fp8, {"arguments": {"fp8": True, "seed": 0}, "model_code": code}) == {
        "fp8": (False, True)
    }
    assert run_differences(before_fp8, {"arguments": {"fp8": False, "seed": 0}, "model_code": code}) == {}


def test_a_tokenizer_of_the_same_size_with_other_ids_is_refused(two_step_run, model_dir, script, tmp_path, capfd):
    swapped = other_tokenizer_dir(model_dir, tmp_path / "swapped-tokenizer")
    output_dir, result = resume(two_step_run, tmp_path, model_dir, capfd, script, "--tokenizer_name", swapped)
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert "the tokenizer (--tokenizer_name): fingerprint" in last_line
    assert "the training data" in last_line  # its blocks are other ids too


def test_an_allowed_change_trains_on_and_is_recorded_with_its_step(two_step_run, model_dir, script, tmp_path, capfd):
    output_dir, result = resume(
        two_step_run, tmp_path, model_dir, capfd, script, "--learning_rate", "5e-2",
        "--allow_resume_changes", "learning_rate",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed with a change allowed from step 2: --learning_rate 0.001 there, 0.05 here" in result.stderr
    change = {"step": 2, "name": "learning_rate", "from": 0.001, "to": 0.05}
    assert progress_record(output_dir / "checkpoints" / "3")["resume_changes"] == [change]
    assert json.loads((output_dir / "train_results.json").read_text())["resume_changes"] == [change]


def test_another_optimizer_is_refused_naming_it_before_any_shape(two_step_run, model_dir, script, tmp_path, capfd):
    """Another --optim makes another optimizer state, which no flag carries over: the argument is named, not the
    first array whose shape differs, even with every change allowed."""
    extra = ["--optim", "lion", "--allow_resume_changes", "all"]
    before = snapshot(two_step_run)
    output_dir, result = resume(two_step_run, tmp_path, model_dir, capfd, script, *extra)
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert "error: the checkpoint holds the state of another optimizer (--optim adamw there, lion here)" in last_line
    assert "shape" not in last_line and "resume with --optim adamw" in last_line, last_line
    assert snapshot(output_dir) == before


def test_what_changes_nothing_of_the_training_needs_no_flag(two_step_run, model_dir, script, tmp_path, capfd):
    extra = ["--logging_steps", "2", "--save_total_limit", "5", "--report_to", "none", "--steps_per_call", "2"]
    output_dir, result = resume(two_step_run, tmp_path, model_dir, capfd, script, *extra, max_steps="4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert progress_record(output_dir / "checkpoints" / "4")["resume_changes"] == []

    # train_results.json's runtime and speed cover the whole run: the segment before the resume and this one.
    results = json.loads((output_dir / "train_results.json").read_text())
    segments = results["train_segments"]
    assert [(segment["from_step"], segment["to_step"]) for segment in segments] == [(0, 2), (2, 4)]
    assert all(segment["runtime_seconds"] > 0 and segment["tokens"] == 2 * 4 * 32 for segment in segments), segments
    runtime = sum(segment["runtime_seconds"] for segment in segments)
    assert results["train_runtime_seconds"] == pytest.approx(runtime) and results["train_runtime_from_step"] == 0
    assert results["train_tokens_per_second"] == pytest.approx(4 * 4 * 32 / runtime)


def test_the_run_directory_keeps_every_version_of_the_code_with_the_step_it_trained_from(
    two_step_run, model_dir, tmp_path, capfd
):
    (tmp_path / "edited").mkdir()
    edited = edited_copy(
        REPO_DIR / "run_clm_flax.py",
        tmp_path / "edited" / "run_clm_flax.py",
        {"logger = logging.getLogger(__name__)\n": "logger = logging.getLogger(__name__)  # edited\n"},
    )
    output_dir, result = resume(two_step_run, tmp_path, model_dir, capfd, edited)
    assert result.returncode == 0, result.stderr[-3000:]
    versions = json.loads((output_dir / "code" / "versions.json").read_text())
    assert [version["from_step"] for version in versions] == [0, 2]
    first, second = (version["files"]["run_clm_flax.py"] for version in versions)
    assert "# edited" not in (output_dir / "code" / first / "run_clm_flax.py").read_text()
    assert "# edited" in (output_dir / "code" / second / "run_clm_flax.py").read_text()
    assert (output_dir / "run_clm_flax.py").read_text() == open(edited).read()
    assert (
        f"Resumed at step 2 with other code than the checkpoint's: run_clm_flax.py {first} (from step 0), now "
        f"run_clm_flax.py {second}"
    ) in result.stderr

    # Branched into a new directory from step 3 of that run, the run keeps the history of the code it continues.
    branch = tmp_path / "branch"
    arguments = training_arguments(model_dir, branch, "--do_train", "--max_steps", "4", "--learning_rate", "1e-3")
    result = run_in_process(edited, capfd, *arguments, "--resume_from_checkpoint", output_dir / "checkpoints" / "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((branch / "code" / "versions.json").read_text()) == versions
    assert "# edited" not in (branch / "code" / first / "run_clm_flax.py").read_text()
    assert f"Branched at step 3 from the run in {output_dir}" in result.stderr


def test_a_checkpoint_of_other_frozen_parameters_is_refused_naming_is_trained():
    """A frozen parameter has no optimizer state: a checkpoint of a run that froze others is refused in one line that
    names is_trained, not as a shape of None."""
    import jax

    from flax_lm.errors import UsageError
    from flax_lm.run.checkpoints import check_checkpoint_fits

    array = jax.ShapeDtypeStruct((4, 2), "float32")
    frozen_wte = {"params": {"wte": array, "h": array}, "opt_state": {"mu": {"h": array}}}
    all_trained = {"params": {"wte": array, "h": array}, "opt_state": {"mu": {"h": array, "wte": array}}}
    with pytest.raises(UsageError) as refusal:
        check_checkpoint_fits("checkpoints/10", frozen_wte, all_trained)
    message = str(refusal.value)
    assert "opt_state/mu/wte is not there but here" in message and "is_trained" in message, message
    check_checkpoint_fits("checkpoints/10", all_trained, all_trained)
