"""A training script copied and edited, as a researcher does: what the edit changes must never give a silently wrong
result or lose the run. The token cache follows the code that makes the rows; a checkpoint resumes in a copy that
sums another metric; checkpoints that exist but cannot be read stop the run and stay; a schedule added to the copy's
table is taken by its flag; and an experiment's own model file is kept with its run, needed to resume it, and
exported as a transformers architecture only where it computes one.

Each case runs a copy of run_clm_flax.py, edited by exact replacements, as a user runs it: in a fresh process where the
process matters (the first run of a shared fixture, a copy beside its own model file), else its main() in this process
as `python copy.py` would run it, to save a fresh import of JAX and the libraries."""

import importlib.util
import json
import linecache
import os
import shutil
import sqlite3
import subprocess
import sys
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import FIXTURES_DIR, REPO_DIR, script_environment, stock_code
from safetensors import safe_open
from safetensors.numpy import load_file
from test_clm import model_dir_with_config, run_clm_flax, tiny_config, tiny_llama_config
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
)

from flax_lm.command_line.arguments import parse_training_arguments
from flax_lm.data.cache_key import function_code_fingerprint
from flax_lm.data.packed import PackedBlocks, read_packed_index
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.models import import_model_file
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.huggingface import save_model
from flax_lm.models.llama import model as llama
from flax_lm.models.roberta import model as roberta
from flax_lm.training.train_state import abstract_model_params

CORPUS = FIXTURES_DIR / "en"


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("edited-copies-model"), n_layer=1)


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """Offline, with a datasets cache of its own and one compilation cache, so each program is compiled once; with
    PyTorch, which the probe of an edited model file compares it with."""
    return script_environment(
        torch=True,
        TOKENIZERS_PARALLELISM="false",
        HF_HOME=str(tmp_path_factory.mktemp("hf-home")),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("compilation-cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )


def edited_copy(source, target, replacements: dict[str, str] | None = None):
    """Copy `source` to `target`, replacing each key of `replacements` (which must occur exactly once) by its value."""
    text = open(source).read()
    for old, new in (replacements or {}).items():
        assert text.count(old) == 1, f"{os.path.basename(source)} no longer holds exactly one {old!r}"
        text = text.replace(old, new)
    with open(target, "w") as file:
        file.write(text)
    return str(target)


def run_copy(script, environment, *arguments):
    return subprocess.run(
        [sys.executable, script, *map(str, arguments)],
        env=environment,
        cwd=os.path.dirname(script),
        capture_output=True,
        text=True,
        timeout=300,
    )


def import_copy(script):
    specification = importlib.util.spec_from_file_location(os.path.basename(script)[:-3], script)
    copy = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(copy)
    return copy


def run_in_process(script, capfd, *arguments):
    """`script` run as run_copy runs it, but in this process and its environment (no fresh import of JAX and the
    libraries): its main() through flax_lm.errors.call_with_one_line_errors, as its `__main__` block calls it, from
    the script's directory.
    A CompletedProcess with the exit status and output a process would end with: 2 and one line for a user's
    mistake, 1 and the traceback for any other error. For runs that end by returning or refusing; a run whose
    outcome depends on how its process ends needs run_copy."""
    copy = import_copy(script)
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), *map(str, arguments)])
        patch.chdir(os.path.dirname(script))
        patch.setattr(
            sys, "unraisablehook", sys.unraisablehook
        )  # call_with_one_line_errors() wraps it: put back after
        try:
            call_with_one_line_errors(copy.main)
            returncode = 0
        except SystemExit as exit:
            returncode = exit.code
        except Exception:
            traceback.print_exc()
            returncode = 1
    output = capfd.readouterr()
    return subprocess.CompletedProcess([str(script), *map(str, arguments)], returncode, output.out, output.err)


def training_arguments(model_dir, output_dir, *extra):
    return [
        "--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", CORPUS / "train.txt", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--seed", "0", "--sample_tokens", "0", "--logging_steps", "1", *extra,
    ]  # fmt: skip


def progress_record(checkpoint) -> dict:
    return json.loads((checkpoint / "progress" / "metadata").read_text())


def snapshot(directory) -> dict:
    """Every file under `directory` with its size and modification time, but the lock (which names its holder)."""
    return {
        os.path.relpath(os.path.join(root, name), directory): (
            os.path.getsize(os.path.join(root, name)),
            os.path.getmtime(os.path.join(root, name)),
        )
        for root, _, names in os.walk(directory)
        for name in names
        if name != ".lock"
    }


# ----------------------------------------------------------------------------------------------------
# The token cache and --packed_data_dir follow the code that makes the rows
# ----------------------------------------------------------------------------------------------------

# An edit of the text pipeline that changes every block: its tokens in reverse order.
REVERSED_BLOCKS = {
    "            yield np.asarray(tokens[:usable], dtype=np.int32).reshape(-1, block_size)\n": (
        "            yield np.asarray(tokens[:usable], dtype=np.int32).reshape(-1, block_size)[:, ::-1]\n"
    )
}


def packed_corpora(cache_dir) -> set[str]:
    return {name for name in os.listdir(cache_dir) if name.startswith("packed-") and not name.endswith(".tmp")}


def train_blocks(directory) -> np.ndarray:
    index = read_packed_index(str(directory))
    return np.asarray(PackedBlocks(str(directory), index["splits"]["train"], (index["block_size"],)))


def test_token_cache_is_reused_by_the_same_code_and_packed_again_after_an_edit_of_pack_blocks(
    model_dir, tmp_path, capfd
):
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "run_clm_flax.py")
    cache_dir = tmp_path / "cache"
    run = [
        *training_arguments(model_dir, tmp_path / "first", "--do_train", "--max_steps", "1"),
        "--cache_dir",
        cache_dir,
    ]
    first = run_in_process(script, capfd, *run)
    assert first.returncode == 0, first.stderr[-3000:]
    (unedited_corpus,) = packed_corpora(cache_dir)

    run[run.index("--output_dir") + 1] = tmp_path / "second"
    second = run_in_process(script, capfd, *run)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Loading packed train blocks from cache" in second.stderr
    assert packed_corpora(cache_dir) == {unedited_corpus}

    edited_copy(script, script, REVERSED_BLOCKS)
    run[run.index("--output_dir") + 1] = tmp_path / "edited"
    third = run_in_process(script, capfd, *run)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Loading packed train blocks from cache" not in third.stderr
    (edited_corpus,) = packed_corpora(cache_dir) - {unedited_corpus}
    unedited_blocks = train_blocks(cache_dir / unedited_corpus)
    np.testing.assert_array_equal(train_blocks(cache_dir / edited_corpus), unedited_blocks[:, ::-1])


def test_a_copy_of_the_script_under_another_name_reuses_the_token_cache(model_dir, tmp_path, capfd):
    """The README's `cp run_clm_flax.py rotary.py`: the same code, so the same tokens, from the same cache."""
    cache_dir = tmp_path / "cache"
    for name in ("run_clm_flax.py", "rotary.py"):
        script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / name)
        arguments = training_arguments(model_dir, tmp_path / name[:-3], "--do_train", "--max_steps", "1")
        result = run_in_process(script, capfd, *arguments, "--cache_dir", cache_dir)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "Loading packed train blocks from cache" in result.stderr
    assert len(packed_corpora(cache_dir)) == 1


def test_the_script_reads_its_texts_in_one_place_a_sql_table_for_one(model_dir, tmp_path, capfd):
    """The documented SQLite source, in read_texts alone: every route then reads the table (here the token cache),
    keyed by the table's rows, so that the cache is reused until the table changes."""
    database = tmp_path / "corpus.db"
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE documents (text TEXT)")
        paragraphs = (CORPUS / "train.txt").read_text().split("\n\n")
        connection.executemany("INSERT INTO documents VALUES (?)", [(f"Zebra table {p}",) for p in paragraphs])
    sql_source = {
        "    return load_text_datasets(source, streaming, evaluation_only)\n": (
            "    connection = sqlite3.connect(source.dataset_name)\n"
            '    rows = connection.execute("SELECT text FROM documents ORDER BY rowid").fetchall()\n'
            "    connection.close()\n"
            '    texts = {"train": datasets.Dataset.from_dict({"text": [text for (text,) in rows]})}\n'
            "    return {split: dataset.to_iterable_dataset() for split, dataset in texts.items()} if streaming else "
            "texts\n"
        ),
        "import logging\n": "import logging\nimport sqlite3\n\nimport datasets\n",
    }
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "sql_source.py", sql_source)
    cache_dir = tmp_path / "cache"
    arguments = [*training_arguments(model_dir, tmp_path / "output", "--do_train", "--max_steps", "1"),
                 "--cache_dir", cache_dir]  # fmt: skip
    arguments.remove("--train_file")
    arguments.remove(CORPUS / "train.txt")
    arguments += ["--dataset_name", database]
    result = run_in_process(script, capfd, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    (corpus,) = packed_corpora(cache_dir)
    text = AutoTokenizer.from_pretrained(model_dir).decode(train_blocks(cache_dir / corpus).reshape(-1))
    assert text.count("Zebra table") >= len(paragraphs) // 2

    spec = importlib.util.spec_from_file_location("sql_source", script)
    sql_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sql_script)
    source = sql_script.TextSource(dataset_name=str(database))

    def table_fingerprint():
        return sql_script.read_texts(source)["train"]._fingerprint

    unchanged = table_fingerprint()
    assert table_fingerprint() == unchanged  # the next run finds the cache
    with sqlite3.connect(database) as connection:
        connection.execute("UPDATE documents SET text = 'Edited' WHERE rowid = 1")
    assert table_fingerprint() != unchanged  # an edited table is packed again


# A document filter in tokenized_rows, where "Where to edit" puts it: it must hold on every route, a stream's too.
DROPS_ZEBRA_DOCUMENTS = {
    "    tokens = token_arrays(dataset, tokenizer, column, num_workers, split, ids_around_documents(tokenizer))\n": (
        '    dataset = dataset.filter(lambda text: "Zebra" not in text, input_columns=column)\n'
        "    tokens = token_arrays(dataset, tokenizer, column, num_workers, split, ids_around_documents(tokenizer))\n"
    )
}


def test_a_document_filter_in_tokenized_rows_holds_for_a_streamed_training_run(
    model_dir, tmp_path, monkeypatch, capfd
):
    """Every other document names a zebra, and the filter drops it: a --streaming run trains on the others only."""
    sentences = (CORPUS / "train.txt").read_text().split(". ")
    documents = [("Zebra " if number % 2 else "") + sentence for number, sentence in enumerate(sentences)]
    data_file = tmp_path / "documents.jsonl"
    data_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    copy = import_copy(edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "no_zebras.py", DROPS_ZEBRA_DOCUMENTS))
    trained_on, call_batches = [], copy.call_batches

    def recording_call_batches(batches_and_tokens, *arguments):
        def recorded():
            for batch, tokens in batches_and_tokens:
                trained_on.append(batch["input_ids"])
                yield batch, tokens

        return call_batches(recorded(), *arguments)

    monkeypatch.setattr(copy, "call_batches", recording_call_batches)
    arguments = training_arguments(model_dir, tmp_path / "run", "--do_train", "--max_steps", "3", "--streaming")
    arguments[arguments.index("--train_file") + 1] = data_file
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "no_zebras.py"), *map(str, arguments)])
    copy.main()
    assert "on blocks packed from a stream" in capfd.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trained_tokens = np.concatenate(trained_on).reshape(-1)
    assert len(trained_on) >= 3 and "Zebra" not in tokenizer.decode(trained_tokens)
    # Unfiltered, as many tokens of the stream hold a zebra in every other document.
    texts = copy.read_texts(copy.TextSource(train_file=str(data_file)), True)
    unfiltered = run_clm_flax.tokenized_rows(texts["train"], "train", tokenizer, 32, copy.TextSource())
    first_tokens = np.concatenate(list(unfiltered)).reshape(-1)[: len(trained_tokens)]
    assert tokenizer.decode(first_tokens).count("Zebra") > 3


def test_masking_that_chooses_more_than_the_room_for_predictions_is_refused_not_cut(monkeypatch):
    """Whole-word masking chooses every token of a word: more than mask_tokens' cap, in some rows. Cut to the room,
    the rest would be corrupted in the input and never predicted; the batch is refused instead."""
    import run_mlm_flax

    def whole_words(input_ids, special_tokens_mask, mask_token_id, *arguments, **keywords):
        chosen = ~special_tokens_mask
        chosen[:, ::2] = False  # half of every row: far more than 15% and its five standard deviations
        masked = np.where(chosen, mask_token_id, input_ids)
        return masked, input_ids.copy(), chosen.astype(np.float32)

    monkeypatch.setattr(run_mlm_flax, "mask_tokens", whole_words)
    make_batch = run_mlm_flax.BatchMaker(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, mask_token_id=4, special_token_ids=(0, 1, 2, 4),
        random_token_count=100, mlm_probability=0.15, max_seq_length=64,
    )  # fmt: skip
    rows = np.random.default_rng(0).integers(5, 100, size=(4, 62))
    with pytest.raises(UsageError, match=r"the masking chose 31 positions of a row of 64 tokens, more than the 24"):
        make_batch(rows, np.arange(4), 4, (0,))


def module_copy(module, name: str, replacements: dict):
    """A copy of the flax_lm `module` as the module flax_lm.NAME, its source edited by `replacements`."""
    text = open(module.__file__).read()
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = os.path.join(os.path.dirname(module.__file__), f"{name}.py")
    spec = importlib.util.spec_from_loader(f"flax_lm.{name}", loader=None, origin=path)
    copy = importlib.util.module_from_spec(spec)
    copy.__file__ = path
    linecache.cache[path] = (len(text), None, text.splitlines(keepends=True), path)  # what inspect reads
    exec(compile(text, path, "exec"), copy.__dict__)
    return copy


def test_the_token_cache_key_covers_the_package_code_that_makes_tokens_and_nothing_else(monkeypatch):
    import flax_lm.data.texts

    key = function_code_fingerprint(run_clm_flax.tokenized_rows)
    unedited = module_copy(flax_lm.data.texts, "texts_copy", {})
    monkeypatch.setattr(run_clm_flax, "token_arrays", unedited.token_arrays)
    assert function_code_fingerprint(run_clm_flax.tokenized_rows) == key
    # An edit of flax_lm.data.texts that changes the tokens changes the key; one of code that makes no tokens does not.
    edits = {
        "tokens": {"else []) + ids + (after": "else []) + ids[::-1] + (after"},
        "no tokens": {'raise UsageError(f"cannot load the dataset: {error}")': 'raise UsageError("no dataset")'},
    }
    for edit, replacements in edits.items():
        edited = module_copy(flax_lm.data.texts, f"texts_{edit.replace(' ', '_')}", replacements)
        monkeypatch.setattr(run_clm_flax, "token_arrays", edited.token_arrays)
        assert (function_code_fingerprint(run_clm_flax.tokenized_rows) != key) == (edit == "tokens"), edit


@pytest.fixture(scope="module")
def packed_data_dir(model_dir, environment, tmp_path_factory):
    """The test corpus packed into a --packed_data_dir by the unedited script (neither --do_train nor --do_eval)."""
    directory = tmp_path_factory.mktemp("packed-by-script")
    script = edited_copy(REPO_DIR / "run_clm_flax.py", directory / "run_clm_flax.py")
    arguments = training_arguments(model_dir, directory / "unused", "--packed_data_dir", directory / "packed")
    result = run_copy(script, environment, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "packed", arguments


def test_packed_data_dir_of_other_code_is_used_with_a_warning_naming_overwrite_cache(packed_data_dir, tmp_path, capfd):
    packed_dir, arguments = packed_data_dir
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "run_clm_flax.py")
    (tmp_path / "edited").mkdir()  # the same file name: it is part of the code's fingerprint
    edited = edited_copy(script, tmp_path / "edited" / "run_clm_flax.py", REVERSED_BLOCKS)
    index_time = os.path.getmtime(packed_dir / "index.json")

    unedited = run_in_process(script, capfd, *arguments)
    assert unedited.returncode == 0, unedited.stderr[-3000:]
    assert "packed by other code" not in unedited.stderr
    result = run_in_process(edited, capfd, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"--packed_data_dir {packed_dir} was packed by other code than this script's tokenized_rows" in result.stderr
    )
    assert "add --overwrite_cache to pack it again" in result.stderr
    assert os.path.getmtime(packed_dir / "index.json") == index_time


def test_packed_data_dir_that_records_no_code_fingerprint_loads_without_a_warning(packed_data_dir, tmp_path, capfd):
    packed, arguments = packed_data_dir
    packed_dir = tmp_path / "packed"
    shutil.copytree(packed, packed_dir)
    index = json.loads((packed_dir / "index.json").read_text())
    del index["code_fingerprint"]  # as written before the code was fingerprinted
    (packed_dir / "index.json").write_text(json.dumps(index))
    edited = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "edited.py", REVERSED_BLOCKS)

    arguments = [*arguments[: arguments.index("--packed_data_dir")], "--packed_data_dir", packed_dir]
    result = run_in_process(edited, capfd, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "packed by other code" not in result.stderr
    assert f"packed data: {packed_dir}" in result.stdout


# ----------------------------------------------------------------------------------------------------
# Checkpoints: a metric sum added or dropped since they were written, and checkpoints none of which can be read
# ----------------------------------------------------------------------------------------------------

# One more sum of the train step, the sequences trained on, and a metric of the log line and train_results.json that
# divides another sum by it: the tokens predicted per sequence (block_size - 1, whatever the steps its sums cover, as
# long as both cover the same).
SEQUENCE_COUNT = {
    'TRAIN_METRIC_SUMS = ("loss_sum", "token_count")': (
        'TRAIN_METRIC_SUMS = ("loss_sum", "token_count", "sequence_count")'
    ),
    '        return sums["loss_sum"] + auxiliary + sums.get("router_z_loss_sum", 0.0), sums\n': (
        "        sums = sums | {'sequence_count': jnp.float32(input_ids.shape[0])}\n"
        "        return sums['loss_sum'] + auxiliary + sums.get('router_z_loss_sum', 0.0), sums\n"
    ),
    '    metrics = {"loss": sums["loss_sum"] / token_count}\n': (
        '    metrics = {"loss": sums["loss_sum"] / token_count}\n'
        '    metrics["tokens_per_sequence"] = sums["token_count"] / max(sums["sequence_count"], 1.0)\n'
    ),
}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The unedited script and a copy that sums SEQUENCE_COUNT too."""
    directory = tmp_path_factory.mktemp("scripts")
    unedited = edited_copy(REPO_DIR / "run_clm_flax.py", directory / "run_clm_flax.py")
    return unedited, edited_copy(unedited, directory / "with_sequence_count.py", SEQUENCE_COUNT)


@pytest.fixture(scope="module")
def two_step_run(model_dir, environment, scripts, tmp_path_factory):
    """A run of the unedited script: 2 steps, checkpoints at 1 and 2."""
    output_dir = tmp_path_factory.mktemp("two-steps")
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "2", "--save_steps", "1")
    result = run_copy(scripts[0], environment, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["1", "2"]
    return output_dir


def tokens_per_step(record) -> int:
    """The tokens a step predicts: every one of a block but the last."""
    return record["global_batch_size"] * (record["block_size"] - 1)


@pytest.fixture(scope="module")
def resumed_with_sequence_count(model_dir, environment, scripts, two_step_run, tmp_path_factory):
    """The two-step run, resumed to step 4 by the copy that sums one more metric."""
    output_dir = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(two_step_run, output_dir)
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "4", "--save_steps", "1")
    result = run_copy(scripts[1], environment, *arguments, "--resume_from_checkpoint")
    return output_dir, result


def test_a_metric_added_since_the_checkpoint_is_a_ratio_of_sums_over_the_same_steps(resumed_with_sequence_count):
    output_dir, result = resumed_with_sequence_count
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {output_dir}/checkpoints/2 at step 2" in result.stderr
    assert "The checkpoint records no training sum of sequence_count: every training metric counts from step 2" in (
        result.stderr
    )
    assert not (output_dir / "discarded-checkpoints").exists()
    record = progress_record(output_dir / "checkpoints" / "4")
    # The sums the checkpoint had go on from the first step; every sum counts again from the resume beside them.
    whole_run, since_resume = record["metric_windows"]
    assert whole_run["from_step"] == 0 and whole_run["sums"]["token_count"] == 4 * tokens_per_step(record)
    assert since_resume["from_step"] == 2 and since_resume["sums"]["token_count"] == 2 * tokens_per_step(record)
    assert since_resume["sums"]["sequence_count"] == 2 * record["global_batch_size"]
    train_results = json.loads((output_dir / "train_results.json").read_text())
    # Counted over steps 3 and 4 both: not twice the value, as tokens over four steps by sequences over two would be.
    assert train_results["train_tokens_per_sequence"] == record["block_size"] - 1
    assert train_results["train_metrics_from_step"] == 2


def test_a_checkpoint_with_a_metric_sum_dropped_since_resumes_from_its_step(
    model_dir, scripts, resumed_with_sequence_count, tmp_path, capfd
):
    output_dir = tmp_path / "run"
    shutil.copytree(resumed_with_sequence_count[0], output_dir)
    assert "sequence_count" in progress_record(output_dir / "checkpoints" / "4")["metric_windows"][1]["sums"]
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "6", "--save_steps", "1")
    result = run_in_process(scripts[0], capfd, *arguments, "--resume_from_checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {output_dir}/checkpoints/4 at step 4" in result.stderr
    assert "The checkpoint's training sums of sequence_count are no longer summed; left out" in result.stderr
    assert not (output_dir / "discarded-checkpoints").exists()
    record = progress_record(output_dir / "checkpoints" / "6")
    assert all("sequence_count" not in window["sums"] for window in record["metric_windows"])
    assert record["metric_windows"][0]["sums"]["token_count"] == 6 * tokens_per_step(record)
    train_results = json.loads((output_dir / "train_results.json").read_text())
    assert train_results["train_metrics_from_step"] == 0


def test_checkpoints_none_of_which_can_be_read_stop_the_resume_and_stay_as_they_are(
    model_dir, scripts, two_step_run, tmp_path, capfd
):
    output_dir = tmp_path / "run"
    shutil.copytree(two_step_run, output_dir)
    (output_dir / "checkpoints" / "2" / "progress" / "metadata").write_text('{"step": 2, "tr')
    (output_dir / "checkpoints" / "1" / "state" / "_METADATA").write_text('{"tree_metadata": {')
    before = snapshot(output_dir)

    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "4", "--save_steps", "1")
    result = run_in_process(scripts[0], capfd, *arguments, "--resume_from_checkpoint")
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        f"error: --resume_from_checkpoint: every training checkpoint in {output_dir}/checkpoints is unreadable "
        "(steps 2, 1; step 2: "
    )
    assert last_line.endswith(
        "they are left as they are: restore them from a copy to resume, or pass --overwrite_output_dir without "
        "--resume_from_checkpoint to start a new run"
    )
    assert "Traceback" not in result.stderr
    assert snapshot(output_dir) == before


# ----------------------------------------------------------------------------------------------------
# The schedules (and optimizers) a copy adds to its own table
# ----------------------------------------------------------------------------------------------------


def test_a_schedule_added_to_a_copy_s_table_is_taken_by_its_flag(model_dir, tmp_path, monkeypatch):
    """LEARNING_RATE_SCHEDULES is the script's, and --lr_scheduler_type takes what it names: no edit of flax_lm."""
    table_end = '    "warmup_stable_decay": optimizers.warmup_stable_decay,\n}\n'
    added = '    "inverse_sqrt": lambda args, *_: lambda step: args.learning_rate / jnp.sqrt(step + 1.0),\n'
    script = edited_copy(
        REPO_DIR / "run_clm_flax.py", tmp_path / "inverse_sqrt.py", {table_end: table_end[:-2] + added + "}\n"}
    )
    copy = import_copy(script)
    arguments = training_arguments(model_dir, tmp_path / "run", "--lr_scheduler_type", "inverse_sqrt")
    monkeypatch.setattr(sys, "argv", [script, *map(str, arguments), "--learning_rate", "1e-2"])
    model_args, data_args, training_args, _ = parse_training_arguments(
        copy.ModelArguments, copy.DataTrainingArguments, copy.TrainingArguments, copy.FLAG_TABLES
    )
    copy.check_arguments(model_args, data_args, training_args)
    schedule = copy.learning_rate_schedule(training_args.optimizer_settings(), total_steps=4)
    np.testing.assert_allclose([schedule(step) for step in range(4)], 1e-2 / np.sqrt([1, 2, 3, 4]), rtol=1e-6)


OPTIMIZERS_END = "schedule, decay_mask),\n}\n\n\n# The tables the flags name"
ADEMAMIX_ADDED = {
    OPTIMIZERS_END: OPTIMIZERS_END.replace(
        "\n}", '\n    "ademamix": lambda settings, schedule: optax.contrib.ademamix(schedule),\n}', 1
    )
}


def test_an_optimizer_added_to_a_copy_s_table_is_listed_by_help_and_named_when_a_resume_changes_it(
    model_dir, tmp_path, monkeypatch, capsys
):
    """--optim's help lists the copy's OPTIMIZERS; resumed with another --optim, the optimizer state has other arrays
    (AdEMAMix's second momentum): the refusal names the flag, from the run record, before any array's shape."""
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "ademamix.py", ADEMAMIX_ADDED)
    copy = import_copy(script)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit):
        copy.main()
    assert "adamw, muon, lion, adafactor, ademamix" in " ".join(capsys.readouterr().out.split())

    arguments = [*map(str, training_arguments(model_dir, tmp_path / "run", "--do_train")), "--save_steps", "2"]
    monkeypatch.setattr(sys, "argv", [script, *arguments, "--optim", "ademamix", "--max_steps", "2"])
    copy.main()
    resumed = [*arguments, "--optim", "adamw", "--max_steps", "4", "--resume_from_checkpoint"]
    monkeypatch.setattr(sys, "argv", [script, *resumed])
    with pytest.raises(UsageError, match="--optim ademamix there, adamw here") as refusal:
        copy.main()
    assert "shape" not in str(refusal.value)


# ----------------------------------------------------------------------------------------------------
# The export names an architecture: the parameters must map onto it
# ----------------------------------------------------------------------------------------------------

GPT2_CONFIGS = {
    "tied": {},
    "untied": dict(tie_word_embeddings=False),
    "n_inner": dict(n_inner=48, n_layer=3),
}
ROBERTA_CONFIGS = {
    "one layer": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
    "three layers": dict(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=80, type_vocab_size=2
    ),
}


def roberta_config(**overrides) -> RobertaConfig:
    settings = dict(vocab_size=300, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return RobertaConfig(**{**settings, **overrides})


def saved_shapes(torch_model, directory) -> dict[str, tuple]:
    torch_model.save_pretrained(directory)
    with safe_open(os.path.join(directory, "model.safetensors"), "np") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}


@pytest.mark.parametrize("variant", GPT2_CONFIGS)
def test_gpt2_architecture_shapes_are_those_transformers_saves(variant, tmp_path):
    config = tiny_config(**GPT2_CONFIGS[variant])
    assert gpt2.hf_architecture_shapes(config) == saved_shapes(GPT2LMHeadModel(config), tmp_path)


LLAMA_CONFIGS = {
    "grouped-query tied": {},
    "multi-head untied biases": dict(
        num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
    ),
    "head_dim of its own": dict(head_dim=8, num_hidden_layers=3),
}


@pytest.mark.parametrize("variant", LLAMA_CONFIGS)
def test_llama_architecture_shapes_are_those_transformers_saves(variant, tmp_path):
    config = tiny_llama_config(**LLAMA_CONFIGS[variant])
    assert llama.hf_architecture_shapes(config) == saved_shapes(LlamaForCausalLM(config), tmp_path)


@pytest.mark.parametrize("variant", ROBERTA_CONFIGS)
def test_roberta_architecture_shapes_are_those_transformers_saves(variant, tmp_path):
    config = roberta_config(**ROBERTA_CONFIGS[variant])
    assert roberta.hf_architecture_shapes(config) == saved_shapes(RobertaForMaskedLM(config), tmp_path)


@pytest.mark.parametrize(
    "model, config",
    [
        (gpt2, tiny_config()),
        (gpt2, tiny_config(tie_word_embeddings=False, n_inner=48)),
        (llama, tiny_llama_config(**LLAMA_CONFIGS["multi-head untied biases"])),
        (roberta, roberta_config(**ROBERTA_CONFIGS["one layer"])),
    ],
    ids=["gpt2 tied", "gpt2 untied", "llama", "roberta"],
)
def test_hf_shapes_of_abstract_parameters_are_those_of_to_hf_state_dict(model, config):
    flax_model = model.MODEL_CLASS(config)
    dummy_input = jnp.zeros((1, 8), jnp.int32)
    params = nn.meta.unbox(flax_model.init(jax.random.key(0), dummy_input)["params"])
    written = {name: tensor.shape for name, tensor in model.to_hf_state_dict(params).items()}
    assert model.hf_shapes(abstract_model_params(flax_model, dummy_input)) == written
    assert written == model.hf_architecture_shapes(config)


def test_a_step_that_saves_and_evaluates_saves_first_so_an_evaluation_that_fails_loses_nothing(
    model_dir, environment, tmp_path
):
    """In a process of its own: the failed evaluation ends it, as it would end a user's run, so that a checkpoint
    still being written when it fails is found only if the run waited for it."""
    broken_evaluation = {
        "    def eval_step(params, batch):\n": (
            "    def eval_step(params, batch):\n        raise RuntimeError('an edited evaluation that fails')\n"
        )
    }
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "run_clm_flax.py", broken_evaluation)
    output_dir = tmp_path / "output"
    arguments = training_arguments(
        model_dir, output_dir, "--do_train", "--do_eval", "--max_steps", "4", "--save_steps", "2", "--eval_steps", "2"
    )
    result = run_copy(script, environment, *arguments)
    assert result.returncode != 0 and "an edited evaluation that fails" in result.stderr
    assert (output_dir / "checkpoints" / "2").is_dir()
    assert progress_record(output_dir / "checkpoints" / "2")["step"] == 2


# ----------------------------------------------------------------------------------------------------
# An experiment's own model file: kept with the run, resumed only with it, and exported as what it computes
# ----------------------------------------------------------------------------------------------------

# Edits of a copy of flax_lm/models/gpt2/model.py. Without the position table, the model computes something
# GPT2LMHeadModel does not (and has one tensor fewer); the attention's scale written another way, it computes what
# GPT-2 does.
MODEL_EDITS = {
    "position table removed": {
        '        self.wpe = embed(config.n_positions, ("positions", "embed"))\n': "",
        'self.look_up(self.wte, "vocab", input_ids) + self.look_up(self.wpe, "positions", positions)': (
            'self.look_up(self.wte, "vocab", input_ids)'
        ),
    },
    "scale written another way": {
        "scale = 1 / math.sqrt(head_dim) if config.scale_attn_weights else 1.0": (
            "scale = head_dim**-0.5 if config.scale_attn_weights else 1.0"
        )
    },
}


@pytest.fixture(scope="module", params=MODEL_EDITS)
def experiment(request, model_dir, environment, tmp_path_factory):
    """run_clm_flax.py copied, unedited, into a directory of its own beside an edited copy of gpt2.py, and trained
    there for 2 steps with --model_file: (the edit, the directory, the output directory, the completed process)."""
    directory = tmp_path_factory.mktemp("experiment")
    edited_copy(
        REPO_DIR / "flax_lm" / "models" / "gpt2" / "model.py", directory / "my_gpt2.py", MODEL_EDITS[request.param]
    )
    script = edited_copy(REPO_DIR / "run_clm_flax.py", directory / "run_clm_flax.py")
    output_dir = directory / "output"
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "2", "--save_steps", "2")
    result = run_copy(script, environment, *arguments, "--model_file", "my_gpt2.py")
    assert result.returncode == 0, result.stderr[-3000:]
    return request.param, directory, output_dir, result


def test_the_run_directory_keeps_the_model_file_beside_the_script(experiment):
    _, directory, output_dir, _ = experiment
    for name in ("my_gpt2.py", "run_clm_flax.py"):
        assert (output_dir / name).read_text() == (directory / name).read_text()


def test_a_resume_with_the_stock_module_is_refused_in_one_line(experiment, model_dir, capfd):
    _, directory, output_dir, _ = experiment
    before = snapshot(output_dir)
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "4", "--resume_from_checkpoint")
    result = run_in_process(str(directory / "run_clm_flax.py"), capfd, *arguments)
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: the checkpoint was trained with other model code (my_gpt2.py, fingerprint ")
    assert "than this run's (flax_lm/models/gpt2/model.py, fingerprint " in last_line, last_line
    assert "Traceback" not in result.stderr
    assert snapshot(output_dir) == before


def test_the_export_claims_gpt2_only_where_its_logits_equal_pytorchs(experiment):
    edit, _, output_dir, result = experiment
    config = json.loads((output_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    input_ids = tokenizer(["The garden was quiet.", "A road past the"], return_tensors="np", padding=False)
    if edit == "scale written another way":
        assert config["architectures"] == ["GPT2LMHeadModel"] and "flax_lm_model_file" not in config
        assert "read back as GPT2LMHeadModel, computes the trained model" in result.stderr  # the export check
        torch_model = GPT2LMHeadModel.from_pretrained(output_dir).eval()
        module = import_model_file(str(output_dir.parent / "my_gpt2.py"))
        model = module.MODEL_CLASS(AutoConfig.from_pretrained(output_dir))
        abstract = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32))
        params = module.from_hf_state_dict(load_file(str(output_dir / "model.safetensors")), abstract)
        ids = np.asarray(input_ids["input_ids"][0])[None]
        with torch.no_grad():
            expected = torch_model(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(np.asarray(model.apply({"params": params}, ids)), expected, atol=1e-4)
    else:
        assert "exports do not name GPT2LMHeadModel" in result.stderr
        assert config.get("architectures") is None and config["flax_lm_model_file"] == "my_gpt2.py"
        assert (output_dir / "flax_model.safetensors").is_file() and not (output_dir / "model.safetensors").exists()
        assert (output_dir / "my_gpt2.py").is_file()
        with pytest.raises(OSError):
            AutoModelForCausalLM.from_pretrained(output_dir)


def test_generate_flax_runs_an_export_of_own_code_only_with_its_model_file(experiment, capfd):
    edit, _, output_dir, _ = experiment
    script = REPO_DIR / "generate_flax.py"
    arguments = ["--model_name_or_path", str(output_dir), "--prompt", "The", "--max_new_tokens", "4"]
    if edit != "scale written another way":  # own code: its file must be named, as code that will run
        refused = run_in_process(script, capfd, *arguments)
        assert refused.returncode == 2
        assert (
            refused.stderr.strip()
            .splitlines()[-1]
            .startswith(f"error: {output_dir} holds a model of its own code (my_gpt2.py, fingerprint ")
        )
        arguments += ["--model_file", str(output_dir / "my_gpt2.py")]
    generated = run_in_process(script, capfd, *arguments)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith("The")


# A low-rank adapter of Llama's query projection (LoRA's), its second factor starting at zero and never merged into
# q_proj, left out of the export's layout so that the export still fits LlamaForCausalLM: on the probe's random weights
# it computes as the architecture, and once trained it does not.
ADAPTER_EDIT = {
    "        query, key, value = self.head_projections(x, projections_bias)\n": (
        "        query, key, value = self.head_projections(x, projections_bias)\n"
        '        adapter_in = self.param("lora_a", nn.initializers.normal(1.0), (config.hidden_size, 4))\n'
        '        adapter_out = self.param("lora_b", nn.initializers.zeros, (4, query.shape[-2] * query.shape[-1]))\n'
        "        query = query + (x @ adapter_in @ adapter_out).reshape(query.shape)\n"
    ),
    '__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]\n': (
        '__all__ = ["from_hf_state_dict"]\n\n\n'
        "def without_adapters(params):\n"
        "    return {name: without_adapters(value) if isinstance(value, dict) else value\n"
        '            for name, value in params.items() if not name.startswith("lora_")}\n\n\n'
        "def to_hf_state_dict(params):\n"
        "    return common.to_hf_state_dict(without_adapters(params))\n\n\n"
        "def hf_shapes(params):\n"
        "    return common.hf_shapes(without_adapters(params))\n"
    ),
    "from flax_lm.errors import UsageError\n": (
        "from flax_lm.errors import UsageError\nfrom flax_lm.models.shared import common\n"
    ),
    "    from_hf_state_dict,\n    head_dim_of,\n    hf_shapes,\n": "    from_hf_state_dict,\n    head_dim_of,\n",
    "    rotate,\n    to_hf_state_dict,\n)\n": "    rotate,\n)\n",
}


def test_an_export_that_leaves_out_trained_parameters_names_no_architecture(llama_tokenizer_dir, tmp_path, capfd):
    """The probe passes a zero-initialised adapter that the export leaves out; the export, read back as
    LlamaForCausalLM, is compared with the model that trained, and the claim is withdrawn: the weights, adapters
    included, go to flax_model.safetensors beside the model file."""
    model_dir = model_dir_with_config(llama_tokenizer_dir, tmp_path / "model", "llama", num_hidden_layers=1)
    edited_copy(REPO_DIR / "flax_lm" / "models" / "llama" / "model.py", tmp_path / "lora_llama.py", ADAPTER_EDIT)
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "run_clm_flax.py")
    output_dir = tmp_path / "output"
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "1", "--learning_rate", "0.01")
    result = run_in_process(script, capfd, *arguments, "--model_file", "lora_llama.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "its logits equal those of transformers' LlamaForCausalLM" in result.stderr  # the probe passed it
    [withdrawal] = [line for line in result.stderr.splitlines() if "is not the model that trained" in line]
    assert "exports do not name LlamaForCausalLM; they hold flax_model.safetensors and the model file" in withdrawal
    config = json.loads((output_dir / "config.json").read_text())
    assert config.get("architectures") is None and config["flax_lm_model_file"] == "lora_llama.py"
    assert not (output_dir / "model.safetensors").exists() and (output_dir / "lora_llama.py").is_file()
    trained_adapter = load_file(str(output_dir / "flax_model.safetensors"))["model/layers_0/self_attn/lora_b"]
    assert np.abs(trained_adapter).max() > 0


def test_save_model_refuses_a_parameter_off_the_architecture_and_writes_nothing(gpt2_tokenizer_dir, tmp_path):
    config = tiny_config()
    abstract = abstract_model_params(gpt2.FlaxGPT2LMHeadModel(config), jnp.zeros((1, 8), jnp.int32))
    params = jax.tree_util.tree_map(lambda leaf: np.zeros(leaf.shape, np.float32), abstract)
    params["transformer"]["ln_f"]["extra"] = np.zeros((2,), np.float32)
    output_dir = tmp_path / "export"
    with pytest.raises(UsageError, match=r"the parameter transformer\.ln_f\.extra \(2,\) is not part of GPT2LMH"):
        save_model(
            str(output_dir), params, config, AutoTokenizer.from_pretrained(gpt2_tokenizer_dir), stock_code(config)
        )
    assert not output_dir.exists()
