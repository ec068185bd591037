"""run_mlm_flax.py at scale: several processes, --streaming and --packed_data_dir, as in run_clm_flax.py.

Two processes of four CPU devices each must train exactly as one process of eight, masks included: each
process reads and masks only its own rows of a global batch, every row from a generator of its own. The
two processes read a packed corpus, as hosts read one from a shared disk, and the single process reads the
files, so the same comparison shows that training from a packed corpus equals training from its files.
"""

import itertools
import json
import os
import shutil
import sys

import datasets
import numpy as np
import pytest
from conftest import FIXTURES_DIR
from safetensors.numpy import load_file
from test_distributed import Processes
from test_mlm import run_mlm_flax, scalars
from transformers import AutoTokenizer, RobertaConfig

from flax_lm.data.loading import load_data, streaming_train_batches
from flax_lm.data.packed import load_packed_corpus, open_packed_corpus
from flax_lm.data.source import TextSource
from flax_lm.errors import UsageError

CORPUS = FIXTURES_DIR / "en"
SEQUENCE_LENGTH = 32
MAX_STEPS = 10


@pytest.fixture(scope="module")
def model_dir(roberta_tokenizer_dir, tmp_path_factory):
    """The 1000-token RoBERTa test tokenizer and a one-layer RoBERTa for sequences of 32 tokens. Dropout stays
    on: the runs then agree only if the global batch is the same row for row."""
    directory = tmp_path_factory.mktemp("mlm-scale-model")
    shutil.copytree(roberta_tokenizer_dir, directory, dirs_exist_ok=True)
    RobertaConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQUENCE_LENGTH + 2, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    ).save_pretrained(directory)  # fmt: skip
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def batch_maker(tokenizer, max_seq_length=SEQUENCE_LENGTH, line_by_line=False):
    data_args = run_mlm_flax.DataTrainingArguments(line_by_line=line_by_line)
    return run_mlm_flax.BatchMaker.from_tokenizer(tokenizer, max_seq_length, data_args)


def training_arguments(model_dir, output_dir, *extra) -> list[str]:
    return [
        "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--max_seq_length", str(SEQUENCE_LENGTH), "--seed", "0", "--logging_steps", "1", "--eval_steps", "1000",
        "--save_steps", "1000", "--fill_mask_top_k", "0", "--do_train", "--do_eval", *extra,
    ]  # fmt: skip


def run_in_this_process(monkeypatch, arguments):
    monkeypatch.setattr(sys, "argv", ["run_mlm_flax.py", *arguments])
    run_mlm_flax.main()


# ----------------------------------------------------------------------------------------------------
# Runs: several processes, a stream, a packed corpus
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_dir(model_dir, tmp_path_factory):
    """The test corpus packed from a stream by a run with --packed_data_dir and neither --do_train nor --do_eval."""
    directory = tmp_path_factory.mktemp("packed") / "corpus"
    unused_output_dir = directory.parent / "unused"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(sys, "argv", [
            "run_mlm_flax.py", "--output_dir", str(unused_output_dir), "--config_name", model_dir, "--tokenizer_name",
            model_dir, "--max_seq_length", str(SEQUENCE_LENGTH), "--train_file", str(CORPUS / "train.txt"),
            "--validation_file", str(CORPUS / "validation.txt"), "--packed_data_dir", str(directory), "--streaming",
            "--packed_tokens_per_shard", "2000",
        ])  # fmt: skip
        run_mlm_flax.main()
    assert not unused_output_dir.exists(), "packing alone should not train"
    return directory


def run_arguments(model_dir, output_dir, *extra):
    # A global batch of 16 (2 per device on 8 devices); 37 evaluation blocks leave the last batch filled up with
    # empty rows. The learning rate is high enough for 10 steps to lower the loss.
    return training_arguments(
        model_dir, output_dir, "--train_file", CORPUS / "train.txt", "--validation_file", CORPUS / "validation.txt",
        "--max_eval_samples", "37", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--learning_rate", "1e-2", "--max_steps", str(MAX_STEPS), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(model_dir, packed_dir, tmp_path_factory):
    """Runs of the same arguments, at the same time where they can be: one process of 8 devices reading the
    files and two processes of 4 reading the packed corpus; then one process of 8 devices reading the files as
    a stream, which finds its steps in the first run's compilation cache (the same programs)."""
    names = ("single", "two", "streamed")
    outputs = {name: tmp_path_factory.mktemp(f"{name}-output") for name in names}
    logs = {name: tmp_path_factory.mktemp(f"{name}-logs") for name in names}
    caches = {name: tmp_path_factory.mktemp(f"{name}-caches") for name in ("single", "two")}
    packed_index_time = os.path.getmtime(packed_dir / "index.json")

    def start(name, num_processes, *extra, cache="single"):
        arguments = run_arguments(model_dir, outputs[name], *extra)
        return Processes(arguments, num_processes, 8 // num_processes, logs[name], caches[cache], "run_mlm_flax.py")

    started = {"single": start("single", 1)}
    try:
        started["two"] = start("two", 2, "--packed_data_dir", packed_dir, cache="two")
        started["single"].wait()
        started["streamed"] = start(
            "streamed", 1, "--streaming", "--shuffle_buffer_size", "100", "--fill_mask_top_k", "3"
        )
        for processes in started.values():
            processes.wait()
    finally:
        for processes in started.values():
            processes.kill()
    return {
        **started, **{f"{name}_dir": directory for name, directory in outputs.items()},
        "packed_index_reused": os.path.getmtime(packed_dir / "index.json") == packed_index_time,
    }  # fmt: skip


def eval_results(output_dir) -> dict:
    return json.loads((output_dir / "eval_results.json").read_text())


def assert_same_weights(output_dir, expected_dir, **tolerances):
    weights, expected = (load_file(str(directory / "model.safetensors")) for directory in (output_dir, expected_dir))
    assert weights.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(weights[name], expected[name], **tolerances, err_msg=name)


def test_two_processes_reading_the_packed_corpus_log_the_losses_of_one_reading_the_files(runs):
    for tag in ("train/loss", "train/accuracy"):
        single, two = scalars(runs["single_dir"], tag), scalars(runs["two_dir"], tag)
        assert [step for step, _ in single] == [step for step, _ in two] == list(range(1, MAX_STEPS + 1))
        np.testing.assert_allclose([value for _, value in two], [value for _, value in single], rtol=1e-5, err_msg=tag)


def test_two_processes_reading_the_packed_corpus_export_the_weights_of_one_reading_the_files(runs):
    assert_same_weights(runs["two_dir"], runs["single_dir"], rtol=1e-4, atol=1e-5)


def test_two_processes_reading_the_packed_corpus_evaluate_as_one_reading_the_files(runs):
    single, two = eval_results(runs["single_dir"]), eval_results(runs["two_dir"])
    assert two["eval_masked_tokens"] == single["eval_masked_tokens"] > 37 * 30 * 0.1
    assert two["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert two["eval_accuracy"] == pytest.approx(single["eval_accuracy"], abs=1e-6)


def test_only_process_0_prints_and_writes_logs_but_every_process_checkpoints(runs):
    two_dir, two = runs["two_dir"], runs["two"]
    assert os.listdir(two_dir / "checkpoints") == [str(MAX_STEPS)]
    assert len(os.listdir(two_dir / "tensorboard")) == 1
    assert "eval: loss" in two.stdout(0) and "tensorboard --logdir" in two.stdout(0)
    assert "eval: loss" not in two.stdout(1) and "tensorboard" not in two.stdout(1), "process 1 printed"
    assert "INFO" not in two.stderr(1), "process 1 logs only errors"


def test_a_packed_corpus_is_reused_by_later_runs_on_every_process(runs, packed_dir):
    assert runs["packed_index_reused"]
    for process_id in (0, 1):
        log = runs["two"].stderr(process_id)
        assert "Packing" not in log and "Tokenizing" not in log
    num_blocks = json.loads((packed_dir / "index.json").read_text())["splits"]["train"]["num_blocks"]
    assert f"train: {num_blocks} packed blocks of {SEQUENCE_LENGTH - 2} tokens in {packed_dir}" in runs["two"].stderr(
        0
    )


def test_streaming_run_trains_with_max_steps_and_lowers_the_loss(runs):
    output_dir, streamed = runs["streamed_dir"], runs["streamed"]
    assert "on blocks grouped from a stream" in streamed.stderr(0)
    losses = [loss for _, loss in scalars(output_dir, "train/loss")]
    assert len(losses) == MAX_STEPS and np.mean(losses[-3:]) < losses[0] - 0.5
    results = eval_results(output_dir)
    assert results["eval_loss"] < np.log(1000) - 0.5
    # The validation stream's first 37 blocks, masked by their batch's index: the files' evaluation set.
    assert results["eval_masked_tokens"] == eval_results(runs["single_dir"])["eval_masked_tokens"]
    train_results = json.loads((output_dir / "train_results.json").read_text())
    assert train_results["train_steps"] == MAX_STEPS and train_results["epochs"] is None
    assert "fill-mask with" in streamed.stdout(0), "the demo text comes from the validation stream"


# ----------------------------------------------------------------------------------------------------
# In this process: which rows each process makes, reads and masks
# ----------------------------------------------------------------------------------------------------


class RecordingBlocks:
    """Grouped blocks that record which of them were read."""

    def __init__(self, blocks):
        self.blocks, self.read = blocks, []
        self.shape = blocks.shape

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, indices):
        self.read.extend(np.asarray(indices).tolist())
        return self.blocks[indices]


def random_blocks(num_blocks):
    return np.random.default_rng(0).integers(5, 1000, (num_blocks, SEQUENCE_LENGTH - 2)).astype(np.int32)


def line_rows(num_lines):  # lines of 1 to SEQUENCE_LENGTH - 2 tokens, padded to SEQUENCE_LENGTH - 2
    rows = random_blocks(num_lines)
    lengths = np.random.default_rng(1).integers(1, SEQUENCE_LENGTH - 1, num_lines)
    rows[np.arange(SEQUENCE_LENGTH - 2) >= lengths[:, None]] = 1  # <pad>
    return rows


def batches_per_process(monkeypatch, num_processes, make_batches):
    monkeypatch.setattr(run_mlm_flax.jax, "process_count", lambda: num_processes)
    per_process = []
    for process_index in range(num_processes):
        monkeypatch.setattr(run_mlm_flax.jax, "process_index", lambda index=process_index: index)
        per_process.append(list(make_batches()))
    return per_process


@pytest.mark.parametrize("mode", ["grouped", "line_by_line"])
def test_the_rows_each_process_masks_make_up_the_single_process_batch(mode, tokenizer, monkeypatch):
    make_batch = batch_maker(tokenizer, line_by_line=mode == "line_by_line")
    examples = random_blocks(40) if mode == "grouped" else line_rows(40)

    def training():
        return (batch for batch, _ in run_mlm_flax.train_batches(examples, make_batch, 8, seed=1, epoch=2))

    def evaluation():  # 40 examples in batches of 12: the last one is filled up with empty rows
        return run_mlm_flax.eval_batches(examples, make_batch, 12, seed=1)

    for make_batches in (training, evaluation):
        single = batches_per_process(monkeypatch, 1, make_batches)[0]
        two = batches_per_process(monkeypatch, 2, make_batches)
        assert len(single) == len(two[0]) == len(two[1]) > 2
        for step, batch in enumerate(single):
            assert batch["masked_weights"].sum() > 0
            for name in batch:
                np.testing.assert_array_equal(np.concatenate([two[0][step][name], two[1][step][name]]), batch[name])


def test_each_process_reads_only_the_examples_of_its_rows(tokenizer, monkeypatch):
    blocks, make_batch, read = random_blocks(40), batch_maker(tokenizer), []
    monkeypatch.setattr(run_mlm_flax.jax, "process_count", lambda: 2)
    for process_index in range(2):
        monkeypatch.setattr(run_mlm_flax.jax, "process_index", lambda index=process_index: index)
        examples = RecordingBlocks(blocks)
        list(run_mlm_flax.train_batches(examples, make_batch, 8, seed=1, epoch=0))
        read.append(examples.read)
    assert len(read[0]) == len(read[1]) == 5 * 4, "each process reads its 4 rows of each of the 5 batches"
    assert sorted(read[0] + read[1]) == list(range(40)), "between them, the processes read every example once"


# ----------------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------------


def text_stream(path):
    return datasets.load_dataset("text", data_files=str(path), split="train", streaming=True, keep_linebreaks=True)


def test_streamed_batches_resume_with_the_same_blocks_and_masks(tokenizer, monkeypatch):
    stream = text_stream(CORPUS / "train.txt")
    make_batch = batch_maker(tokenizer)
    monkeypatch.setattr(run_mlm_flax.jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_mlm_flax.jax, "process_index", lambda: 1)

    def batches(first_step=0):
        def rows_of_texts(texts):
            return run_mlm_flax.tokenized_rows(texts, "train", tokenizer, SEQUENCE_LENGTH - 2, TextSource())

        block_batches = streaming_train_batches(stream, rows_of_texts, 16, 0, 100, first_step)
        return [batch for batch, _ in itertools.islice(
            run_mlm_flax.masked_stream_batches(block_batches, make_batch, 16, seed=0, first_step=first_step),
            8 - first_step,
        )]  # fmt: skip

    uninterrupted, resumed = batches(), batches(first_step=5)
    assert all(batch["input_ids"].shape == (8, SEQUENCE_LENGTH) for batch in uninterrupted)
    for expected, batch in zip(uninterrupted[5:], resumed, strict=True):
        for name in expected:
            np.testing.assert_array_equal(batch[name], expected[name])
    assert not np.array_equal(uninterrupted[0]["masked_positions"], uninterrupted[1]["masked_positions"])


# ----------------------------------------------------------------------------------------------------
# Packed corpora
# ----------------------------------------------------------------------------------------------------


def test_packed_data_dir_holds_the_grouped_blocks_of_the_files_in_shards(packed_dir, tokenizer):
    index = json.loads((packed_dir / "index.json").read_text())
    assert index["block_size"] == SEQUENCE_LENGTH - 2 and len(index["splits"]["train"]["shards"]) > 10
    blocks = open_packed_corpus(str(packed_dir), index)
    for split in ("train", "validation"):
        # Every text (a .txt file: one, as written) followed by </s>, joined and cut: the grouping written out
        # the slow, obvious way.
        texts = [(CORPUS / f"{split}.txt").read_text()]
        tokens = [token for text in texts for token in tokenizer(text, add_special_tokens=False)["input_ids"] + [2]]
        expected = np.array(tokens[: len(tokens) // 30 * 30]).reshape(-1, 30)
        np.testing.assert_array_equal(np.asarray(blocks[split]), expected, err_msg=split)


def test_line_by_line_rows_of_the_token_cache_and_of_a_packed_data_dir_are_the_same(tokenizer, tmp_path):
    model_args = run_mlm_flax.ModelArguments(cache_dir=str(tmp_path / "cache"), tokenizer_name="unused")
    training_args = run_mlm_flax.TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True, do_eval=True)
    examples = {}
    for route, packed_data_dir, streaming in (
        ("cache", None, False),
        ("packed", str(tmp_path / "packed"), False),
        ("packed from a stream", str(tmp_path / "packed-stream"), True),
    ):
        data_args = run_mlm_flax.DataTrainingArguments(
            train_file=str(CORPUS / "validation.txt"),
            line_by_line=True,
            packed_data_dir=packed_data_dir,
            streaming=streaming,
        )
        run_mlm_flax.check_arguments(model_args, data_args, training_args)
        texts_to_rows = run_mlm_flax.script_texts_to_rows(data_args, tokenizer, SEQUENCE_LENGTH - 2)
        examples[route] = load_data(data_args.data_route(model_args, training_args), texts_to_rows).rows
    for split in ("train", "validation"):
        for route in ("packed", "packed from a stream"):
            np.testing.assert_array_equal(np.asarray(examples[route][split]), np.asarray(examples["cache"][split]))
    first_line = next(line for line in (CORPUS / "validation.txt").read_text().splitlines() if line.strip())
    tokens = tokenizer(first_line, add_special_tokens=False)["input_ids"][: SEQUENCE_LENGTH - 2]
    held_out = np.asarray(examples["packed"]["validation"][0])  # the first line, padded with <pad>
    np.testing.assert_array_equal(held_out[: len(tokens)], tokens)
    assert (held_out[len(tokens) :] == tokenizer.pad_token_id).all()


def load_packed(data_args, tokenizer, row_length: int) -> dict:
    """The rows of --packed_data_dir as run_mlm_flax.py reads (or packs) them, rows of `row_length` tokens."""
    texts_to_rows = run_mlm_flax.script_texts_to_rows(data_args, tokenizer, row_length)
    source = data_args.text_source(run_mlm_flax.ModelArguments())
    return load_packed_corpus(data_args.packed_data_dir, source, texts_to_rows)[0]


@pytest.mark.parametrize("line_by_line", [True, False], ids=["grouped-read-as-lines", "lines-read-as-grouped"])
def test_a_packed_data_dir_of_the_other_framing_is_refused(line_by_line, packed_dir, tokenizer, tmp_path):
    if not line_by_line:  # a corpus of lines, packed by a run with --line_by_line
        packed_dir = tmp_path / "lines"
        lines_args = run_mlm_flax.DataTrainingArguments(
            packed_data_dir=str(packed_dir),
            train_file=str(CORPUS / "validation.txt"),
            line_by_line=True,
            text_sample_by="line",
        )
        load_packed(lines_args, tokenizer, SEQUENCE_LENGTH - 2)
    data_args = run_mlm_flax.DataTrainingArguments(packed_data_dir=str(packed_dir), line_by_line=line_by_line)
    recorded, expected = ("grouped", "line_by_line") if line_by_line else ("line_by_line", "grouped")
    with pytest.raises(UsageError, match=rf"holds {recorded} rows, not {expected} ones; use another"):
        load_packed(data_args, tokenizer, SEQUENCE_LENGTH - 2)


def test_packed_data_dir_of_another_max_seq_length_is_refused(packed_dir, tokenizer):
    data_args = run_mlm_flax.DataTrainingArguments(packed_data_dir=str(packed_dir))
    with pytest.raises(
        UsageError,
        match=r"holds blocks of 30 tokens, not the 62 that --max_seq_length sets; use another --packed_data_dir",
    ):
        load_packed(data_args, tokenizer, 62)


# ----------------------------------------------------------------------------------------------------
# Usage errors
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra_arguments, message",
    [
        (
            ["--line_by_line", "--streaming", "--max_steps", "5"],
            "--line_by_line cannot be combined with --streaming alone, .* add --packed_data_dir",
        ),
        (["--streaming"], "--streaming needs --max_steps"),
        (
            ["--streaming", "--max_steps", "5", "--max_train_samples", "10"],
            "--max_train_samples does not apply to --streaming",
        ),
    ],
)
def test_streaming_and_packing_misuse_is_refused(extra_arguments, message, model_dir, tmp_path, monkeypatch):
    arguments = training_arguments(
        model_dir, tmp_path / "out", "--train_file", str(CORPUS / "train.txt"),
        *(argument.format(tmp=tmp_path) for argument in extra_arguments),
    )  # fmt: skip
    with pytest.raises(UsageError, match=message) as error:
        run_in_this_process(monkeypatch, arguments)
    assert "\n" not in str(error.value), "the error should be one line"
    assert not (tmp_path / "out").exists() and not (tmp_path / "packed").exists()
