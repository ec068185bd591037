"""run_mlm_flax.py: examples, batches and masking, the command line, the export, and devices.

The model itself (logits against transformers' PyTorch RoBERTa, conversion both ways, the masking
fractions) is tested in test_mlm_model.py.
"""

import functools
import json
import math
import os
import shlex
import shutil
import sys

import datasets
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import REPO_DIR, stock_code
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from safetensors.numpy import load_file
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    GPT2Config,
    RobertaConfig,
    RobertaForMaskedLM,
    pipeline,
)

REPO = str(REPO_DIR)
sys.path.insert(0, REPO)
import run_mlm_flax  # noqa: E402
from flax_lm.command_line.arguments import ModelArguments, parse_training_arguments  # noqa: E402
from flax_lm.data.packed import cached_blocks  # noqa: E402
from flax_lm.data.source import TextSource  # noqa: E402
from flax_lm.models.huggingface import read_safetensors_checkpoint  # noqa: E402
from flax_lm.models.roberta import model as roberta  # noqa: E402
from flax_lm.training.train_state import abstract_model_params  # noqa: E402

TRAIN_FILE = os.path.join(REPO, "tests", "fixtures", "en", "train.txt")
VALIDATION_FILE = os.path.join(REPO, "tests", "fixtures", "en", "validation.txt")
SEQUENCE_LENGTH = 64


@pytest.fixture(scope="module")
def model_dir(run_tool, roberta_tokenizer_dir, tmp_path_factory):
    """A RoBERTa tokenizer of 1000 tokens (train_tokenizer.py) and a 2-layer, 64-wide config (create_config.py)."""
    directory = tmp_path_factory.mktemp("tiny-roberta")
    shutil.copytree(roberta_tokenizer_dir, directory, dirs_exist_ok=True)
    result = run_tool(
        "create_config.py", "--preset", "roberta-tiny", "--tokenizer_dir", directory,
        "--set", "num_hidden_layers=2", "hidden_size=64", "num_attention_heads=2", "intermediate_size=128",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def batch_maker(tokenizer, max_seq_length=SEQUENCE_LENGTH, **data_arguments):
    data_args = run_mlm_flax.DataTrainingArguments(**data_arguments)
    return run_mlm_flax.BatchMaker.from_tokenizer(tokenizer, max_seq_length, data_args)


def chosen_positions(batch):
    """(rows, length) bool: the positions a batch asks the model to predict."""
    chosen = np.zeros(batch["input_ids"].shape, bool)
    rows = np.arange(len(chosen))[:, None].repeat(batch["masked_positions"].shape[1], axis=1)
    chosen[rows[batch["masked_weights"] == 1], batch["masked_positions"][batch["masked_weights"] == 1]] = True
    return chosen


def line_rows(dataset, tokenizer, cache_dir, max_seq_length=SEQUENCE_LENGTH):
    """The --line_by_line rows of a dataset: a packed corpus cached in cache_dir."""
    rows = functools.partial(run_mlm_flax.tokenized_rows, line_by_line=True)
    return cached_blocks(
        dataset, "train", rows, tokenizer, max_seq_length - 2, str(cache_dir), TextSource(), framing="line_by_line"
    )


def text_dataset(path, cache_dir):
    return datasets.load_dataset(
        "text", data_files=str(path), cache_dir=str(cache_dir), split="train", keep_linebreaks=True
    )


# ----------------------------------------------------------------------------------------------------
# Examples, batches, masking
# ----------------------------------------------------------------------------------------------------


def test_grouped_blocks_are_the_texts_joined_with_separators_and_framed_as_s_to_slash_s(tokenizer, tmp_path):
    dataset = text_dataset(VALIDATION_FILE, tmp_path)
    rows, width = run_mlm_flax.tokenized_rows, SEQUENCE_LENGTH - 2
    blocks = cached_blocks(
        dataset, "validation", rows, tokenizer, width, str(tmp_path), TextSource(), framing="grouped"
    )
    joined = [
        token
        for text in dataset["text"]
        for token in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert len(blocks) == len(joined) // (SEQUENCE_LENGTH - 2)

    input_ids, attention_mask = batch_maker(tokenizer).token_ids(blocks, np.arange(len(blocks)), len(blocks))
    assert input_ids.shape == (len(blocks), SEQUENCE_LENGTH)
    assert (input_ids[:, 0] == tokenizer.bos_token_id).all() and (input_ids[:, -1] == tokenizer.eos_token_id).all()
    assert attention_mask.all()
    np.testing.assert_array_equal(input_ids[:, 1:-1].reshape(-1), joined[: len(blocks) * (SEQUENCE_LENGTH - 2)])


def test_with_document_attention_the_texts_of_a_grouped_block_are_scored_as_if_alone(model_dir, tokenizer, tmp_path):
    data_file = tmp_path / "texts.txt"
    data_file.write_text("The first text.\nA second text, a little longer than the first.\nThird.\n")
    dataset = text_dataset(data_file, tmp_path)  # a text per line
    token_lists = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in dataset["text"]]
    width = sum(len(tokens) + 1 for tokens in token_lists)  # one block holds the texts, each followed by </s>
    data_args = run_mlm_flax.DataTrainingArguments(document_attention=True)
    rows = run_mlm_flax.tokenized_rows
    blocks = cached_blocks(dataset, "train", rows, tokenizer, width, str(tmp_path), TextSource(), framing="grouped")
    input_ids, attention_mask = batch_maker(tokenizer, width + 2).token_ids(blocks, np.arange(1), 1)
    assert tokenizer.decode(input_ids[0]) == "<s>" + "</s>".join(dataset["text"]) + "</s></s>"

    config = RobertaConfig.from_pretrained(model_dir)
    model = run_mlm_flax.masked_lm_model(config, tokenizer, ModelArguments(), data_args, None, stock_code(config))
    params = nn.meta.unbox(model.init(jax.random.key(0), input_ids))["params"]
    packed = model.apply({"params": params}, input_ids, attention_mask)[0]
    # Each text alone, led by the </s> that joins it to the one before where a sequence of its own has <s> (the first
    # text by the block's <s>); then the </s> after the last text and the block's closing </s>, each alone.
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    pieces = [[bos, *token_lists[0]], *([eos, *tokens] for tokens in token_lists[1:]), [eos], [eos]]
    plain = roberta.FlaxRobertaForMaskedLM(config)
    alone = np.concatenate([plain.apply({"params": params}, jnp.array([piece]))[0] for piece in pieces])
    np.testing.assert_allclose(packed, alone, atol=1e-5)
    assert np.abs(plain.apply({"params": params}, input_ids, attention_mask)[0] - alone).max() > 1e-3


def test_line_by_line_keeps_every_non_empty_line_as_a_padded_row_and_caches_the_rows(
    tokenizer, tmp_path, monkeypatch, caplog
):
    lines = ["The first line.", "", "   ", "A second, longer line of the file.", "Third.", "word " * 40]
    data_file = tmp_path / "lines.txt"
    data_file.write_text("\n".join(lines) + "\n")
    dataset = text_dataset(data_file, tmp_path / "cache")

    with caplog.at_level("INFO", logger=run_mlm_flax.logger.name):
        rows = np.asarray(line_rows(dataset, tokenizer, tmp_path / "cache", max_seq_length=16))
    kept = [line for line in lines if line.strip()]
    token_lists = [tokenizer(line, add_special_tokens=False)["input_ids"] for line in kept]  # no line breaks
    assert rows.shape == (len(kept), 14)
    for row, tokens in zip(rows, token_lists):
        np.testing.assert_array_equal(row[: len(tokens)], tokens[:14])
        assert (row[len(tokens) :] == tokenizer.pad_token_id).all()
    longer = sum(len(tokens) > 14 for tokens in token_lists)
    assert 0 < longer < len(kept) and f"train: {longer} of 4 lines are longer than 14 tokens" in caplog.text

    def tokenizing(*arguments, **keywords):
        raise AssertionError("the lines were tokenized again")

    monkeypatch.setattr(run_mlm_flax, "map_in_workers", tokenizing)  # the second call reads the cache
    np.testing.assert_array_equal(np.asarray(line_rows(dataset, tokenizer, tmp_path / "cache", 16)), rows)


def test_line_batches_are_padded_with_an_attention_mask_and_padding_is_never_masked(tokenizer):
    lengths = [3, 20, 9, 62]  # the last one fills its row: a line truncated to max_seq_length - 2
    examples = np.full((len(lengths), SEQUENCE_LENGTH - 2), tokenizer.pad_token_id, np.int32)
    for row, length in enumerate(lengths):
        examples[row, :length] = 500 + row
    make_batch = batch_maker(tokenizer, mlm_probability=0.5, line_by_line=True)

    input_ids, attention_mask = make_batch.token_ids(examples, np.arange(3), num_rows=4)
    assert input_ids.shape == (4, 32)  # longest row 20 + 2, padded to the next power of two
    for row, length in enumerate(lengths[:3]):
        np.testing.assert_array_equal(input_ids[row, : length + 2], [0] + [500 + row] * length + [2])
        assert (input_ids[row, length + 2 :] == tokenizer.pad_token_id).all()
        np.testing.assert_array_equal(attention_mask[row], np.arange(32) < length + 2)
    np.testing.assert_array_equal(input_ids[3, :2], [0, 2])  # a row that fills up a partial batch: empty
    assert attention_mask[3].sum() == 2

    truncated, _ = make_batch.token_ids(examples, np.array([3]), num_rows=1)
    assert truncated.shape == (1, SEQUENCE_LENGTH) and truncated[0, -1] == tokenizer.eos_token_id
    padded_to_max, _ = batch_maker(tokenizer, pad_to_max_length=True, line_by_line=True).token_ids(
        examples, np.array([0]), 1
    )
    assert padded_to_max.shape == (1, SEQUENCE_LENGTH)

    for seed in range(20):
        batch = make_batch(examples, np.arange(3), 4, (seed,))
        assert set(batch) == {"input_ids", "attention_mask", "masked_positions", "masked_labels", "masked_weights"}
        chosen = chosen_positions(batch)
        assert chosen.sum() == batch["masked_weights"].sum() > 0
        assert not chosen[attention_mask == 0].any(), "padding was chosen for prediction"
        assert not np.isin(input_ids[chosen], tokenizer.all_special_ids).any(), "a special token was chosen"
        np.testing.assert_array_equal(
            batch["masked_labels"], np.take_along_axis(input_ids, batch["masked_positions"], axis=1)
        )
        np.testing.assert_array_equal(batch["input_ids"][~chosen], input_ids[~chosen])


def test_masking_of_real_batches_chooses_the_mlm_probability_and_no_special_token(tokenizer, tmp_path):
    examples = line_rows(text_dataset(TRAIN_FILE, tmp_path), tokenizer, tmp_path)
    make_batch = batch_maker(tokenizer, line_by_line=True)
    indices = np.arange(len(examples))
    original, attention_mask = make_batch.token_ids(examples, indices, len(examples))
    batch = make_batch(examples, indices, len(examples), (0,))
    special = np.isin(original, tokenizer.all_special_ids) | (attention_mask == 0)
    chosen = chosen_positions(batch)
    assert (~special).sum() > 15_000
    assert not chosen[special].any()
    assert abs(chosen.sum() / (~special).sum() - 0.15) < 0.01
    assert abs(np.mean(batch["input_ids"][chosen] == tokenizer.mask_token_id) - 0.8) < 0.03
    np.testing.assert_array_equal(batch["input_ids"][~chosen], original[~chosen])
    # Room for the predictions is much less than the sequence, so the LM head runs on few positions.
    assert batch["masked_positions"].shape == (len(examples), 24)


def test_evaluation_covers_every_example_once_with_the_same_masks_every_time(tokenizer):
    blocks = np.arange(7 * 6, dtype=np.int32).reshape(7, 6) + 100
    make_batch = batch_maker(tokenizer, max_seq_length=8)
    batches = list(run_mlm_flax.eval_batches(blocks, make_batch, global_batch_size=3, seed=0))
    assert len(batches) == 3 and all(batch["input_ids"].shape == (3, 8) for batch in batches)
    chosen = np.concatenate([chosen_positions(batch) for batch in batches])
    assert chosen[:7].sum() > 0 and not chosen[7:].any()  # the two rows that fill up the last batch: nothing
    unmasked = np.concatenate([batch["input_ids"] for batch in batches])
    np.testing.assert_array_equal(unmasked[:7, 1:-1][~chosen[:7, 1:-1]], blocks[~chosen[:7, 1:-1]])
    again = list(run_mlm_flax.eval_batches(blocks, make_batch, global_batch_size=3, seed=0))
    for first, second in zip(batches, again):
        for name in first:
            np.testing.assert_array_equal(first[name], second[name])


def test_training_batches_and_masks_follow_the_seed_and_differ_between_epochs(tokenizer):
    blocks = np.arange(10 * 30, dtype=np.int32).reshape(10, 30) + 100
    make_batch = batch_maker(tokenizer, max_seq_length=32)

    def epoch(seed, number):
        return [
            (batch["input_ids"], tokens)
            for batch, tokens in run_mlm_flax.train_batches(blocks, make_batch, 4, seed, number)
        ]

    first, again, next_epoch = epoch(3, 0), epoch(3, 0), epoch(3, 1)
    assert len(first) == 2 and first[0][1] == 4 * 32
    for (ids, _), (same_ids, _) in zip(first, again):
        np.testing.assert_array_equal(ids, same_ids)
    assert not np.array_equal(first[0][0], next_epoch[0][0])


# ----------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------


def run_mlm(run_tool, arguments, check=True):
    """run_mlm_flax.py in a fresh Python process, offline (conftest's run_tool)."""
    result = run_tool("run_mlm_flax.py", *arguments)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def scalars(output_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(str(output_dir), "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def hf_example_command_line(model_dir, output_dir):
    """The command line of the Hugging Face Flax MLM example, with local files and small numbers."""
    return [
        f"--output_dir={output_dir}",
        "--model_type=roberta",
        f"--config_name={model_dir}",
        f"--tokenizer_name={model_dir}",
        f"--train_file={TRAIN_FILE}",
        f"--validation_file={VALIDATION_FILE}",
        f"--max_seq_length={SEQUENCE_LENGTH}",
        "--weight_decay=0.01",
        "--per_device_train_batch_size=16",
        "--per_device_eval_batch_size=16",
        "--learning_rate=3e-3",
        "--warmup_steps=5",
        "--overwrite_output_dir",
        "--num_train_epochs=3",
        "--adam_beta1=0.9",
        "--adam_beta2=0.98",
        "--logging_steps=10",
        "--save_steps=1000",
        "--eval_steps=40",
        "--seed=0",
    ]


@pytest.fixture(scope="module")
def untrained_checkpoint_eval(run_tool, model_dir, tmp_path_factory):
    """Evaluation of an untrained PyTorch RobertaForMaskedLM checkpoint of the test config, loaded with
    --model_name_or_path: (the run, its eval_results). With the seed, sequence length and batch size of the
    training run below it sees the same masks, so it is the baseline that training must beat."""
    checkpoint = tmp_path_factory.mktemp("pytorch-checkpoint")
    torch.manual_seed(0)
    RobertaForMaskedLM(RobertaConfig.from_pretrained(model_dir)).save_pretrained(str(checkpoint))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(checkpoint))
    output_dir = tmp_path_factory.mktemp("untrained")
    result = run_mlm(
        run_tool,
        [
            "--output_dir",
            output_dir,
            "--model_name_or_path",
            checkpoint,
            "--do_eval",
            "--validation_file",
            VALIDATION_FILE,
            "--max_seq_length",
            SEQUENCE_LENGTH,
            "--per_device_eval_batch_size",
            16,
            "--seed",
            0,
        ],
    )
    return result, json.loads((output_dir / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def trained_run(run_tool, model_dir, tmp_path_factory):
    """The Hugging Face example's command line (no --do_train or --do_eval: it does both), with the export sharded as
    save_pretrained shards it (the 1000 x 64 float32 embeddings alone are 256 KB): (output dir, run)."""
    output_dir = tmp_path_factory.mktemp("trained")
    command_line = [*hf_example_command_line(model_dir, output_dir), "--max_shard_size=100KB"]
    return output_dir, run_mlm(run_tool, command_line)


def test_continues_from_a_pytorch_checkpoint(untrained_checkpoint_eval, model_dir):
    result, eval_results = untrained_checkpoint_eval
    assert "Loaded weights from" in result.stderr
    vocab_size = RobertaConfig.from_pretrained(model_dir).vocab_size
    assert eval_results["eval_loss"] == pytest.approx(math.log(vocab_size), abs=0.3)  # close to uniform
    assert eval_results["eval_accuracy"] < 0.02


def test_hf_example_command_line_writes_every_expected_file(trained_run):
    output_dir, result = trained_run
    assert len(list(output_dir.glob("model-*-of-*.safetensors"))) >= 2
    assert not (output_dir / "model.safetensors").exists()
    for name in (
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "eval_results.json",
        "train_results.json",
    ):
        assert (output_dir / name).is_file(), f"{name} was not written"
    assert os.listdir(output_dir / "tensorboard")
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    assert set(eval_results) == {
        "eval_loss",
        "eval_perplexity",
        "eval_accuracy",
        "eval_samples",
        "eval_masked_tokens",
        "step",
    }
    all_results = json.loads((output_dir / "all_results.json").read_text())
    assert all_results["perplexity"] == eval_results["eval_perplexity"]
    assert all_results["eval_accuracy"] == eval_results["eval_accuracy"]
    assert all_results["train_samples"] > all_results["eval_samples"] == eval_results["eval_samples"] > 0
    assert eval_results["eval_perplexity"] == pytest.approx(math.exp(eval_results["eval_loss"]), rel=1e-6)
    train_results = json.loads((output_dir / "train_results.json").read_text())
    steps_per_epoch = train_results["train_steps"] / train_results["epochs"]
    assert train_results["epochs"] == 3 and steps_per_epoch == int(steps_per_epoch) > 10
    assert train_results["train_tokens_per_second"] > 0
    assert json.loads((output_dir / "config.json").read_text())["architectures"] == ["RobertaForMaskedLM"]
    assert "eval: loss" in result.stdout and "tensorboard --logdir" in result.stdout
    assert "fill-mask with" in result.stdout


def test_training_lowers_eval_loss_and_raises_accuracy(trained_run, untrained_checkpoint_eval):
    output_dir, _ = trained_run
    _, untrained = untrained_checkpoint_eval
    trained = json.loads((output_dir / "eval_results.json").read_text())
    assert trained["eval_masked_tokens"] == untrained["eval_masked_tokens"] > 300  # the same masks
    assert trained["eval_loss"] < untrained["eval_loss"] - 1.0
    assert trained["eval_accuracy"] > untrained["eval_accuracy"] + 0.05


def test_tensorboard_has_the_training_and_evaluation_scalars(trained_run):
    output_dir, _ = trained_run
    for tag in (
        "train/loss",
        "train/accuracy",
        "train/learning_rate",
        "train/grad_norm",
        "train/tokens_per_second",
        "eval/loss",
        "eval/perplexity",
        "eval/accuracy",
    ):
        assert scalars(output_dir, tag), f"no {tag} in TensorBoard"
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    eval_steps = [step for step, _ in scalars(output_dir, "eval/loss")]
    assert eval_steps[:-1] == list(range(40, eval_results["step"], 40)) and eval_steps[-1] == eval_results["step"]
    assert scalars(output_dir, "eval/accuracy")[-1][1] == pytest.approx(eval_results["eval_accuracy"], rel=1e-5)


def test_export_loads_in_transformers_with_the_logits_of_the_flax_model(trained_run):
    output_dir, _ = trained_run
    torch_model, loading_info = AutoModelForMaskedLM.from_pretrained(str(output_dir), output_loading_info=True)
    assert type(torch_model) is RobertaForMaskedLM
    assert not any(loading_info.values()), loading_info
    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    inputs = tokenizer(
        ["The gardener counted to ten.", "A quiet tourist said nothing here is ever where you left it."],
        padding=True,
        return_tensors="np",
    )
    with torch.no_grad():
        expected = torch_model.eval()(
            **{name: torch.from_numpy(value) for name, value in inputs.items()}
        ).logits.numpy()

    config = RobertaConfig.from_pretrained(str(output_dir))
    model = roberta.FlaxRobertaForMaskedLM(config)
    abstract = abstract_model_params(model, jnp.zeros((1, 1), jnp.int32))
    params = roberta.from_hf_state_dict(read_safetensors_checkpoint(str(output_dir), None), abstract)
    logits = model.apply({"params": params}, jnp.asarray(inputs["input_ids"]), jnp.asarray(inputs["attention_mask"]))
    real = inputs["attention_mask"].astype(bool)  # PyTorch and Flax differ only at the padding
    np.testing.assert_allclose(np.asarray(logits)[real], expected[real], atol=1e-4, rtol=0)


def documented_upload_patterns() -> tuple[list[str], list[str]]:
    """The --include and --exclude patterns of the `hf upload` command docs/exporting.md gives."""
    with open(os.path.join(REPO, "docs", "exporting.md")) as file:
        (command,) = [line for line in file.read().splitlines() if line.startswith("hf upload ")]
    words = shlex.split(command)
    patterns = {"--include": [], "--exclude": []}
    for flag, value in zip(words, words[1:]):
        if flag in patterns:
            patterns[flag].append(value)
    return patterns["--include"], patterns["--exclude"]


def test_the_documented_upload_sends_the_model_alone_and_it_loads_from_those_files(trained_run, tmp_path):
    output_dir, _ = trained_run
    every_file = sorted(str(path.relative_to(output_dir)) for path in output_dir.glob("**/*") if path.is_file())
    assert {"run_mlm_flax.py", ".lock", "all_results.json"} <= set(every_file)
    assert {"checkpoints", "code", "tensorboard"} <= {name.split("/")[0] for name in every_file}
    include, exclude = documented_upload_patterns()
    # What `hf upload` (HfApi.upload_folder) sends: huggingface_hub's own filter, with the patterns it always ignores.
    uploaded = list(
        filter_repo_objects(every_file, allow_patterns=include, ignore_patterns=exclude + DEFAULT_IGNORE_PATTERNS)
    )
    shards = sorted(path.name for path in output_dir.glob("model-*-of-*.safetensors"))
    expected = ["config.json", *shards, "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(uploaded) == sorted(expected)
    model_only = tmp_path / "uploaded"
    model_only.mkdir()
    for name in uploaded:
        shutil.copyfile(output_dir / name, model_only / name)
    _, loading_info = AutoModelForMaskedLM.from_pretrained(str(model_only), output_loading_info=True)
    assert not any(loading_info.values()), loading_info
    assert AutoTokenizer.from_pretrained(str(model_only)).mask_token == "<mask>"


def test_export_works_in_the_fill_mask_pipeline(trained_run):
    output_dir, _ = trained_run
    fill_mask = pipeline("fill-mask", model=str(output_dir), device="cpu")
    predictions = fill_mask("The gardener counted to <mask> while everyone else was asleep.", top_k=5)
    assert len(predictions) == 5
    assert all(prediction["token_str"] and 0 < prediction["score"] <= 1 for prediction in predictions)
    assert [p["score"] for p in predictions] == sorted((p["score"] for p in predictions), reverse=True)


def line_by_line_arguments(model_dir) -> dict:
    """A short line_by_line run that trains and evaluates, logs every step and saves every other."""
    return dict(
        config_name=model_dir,
        tokenizer_name=model_dir,
        train_file=TRAIN_FILE,
        validation_file=VALIDATION_FILE,
        line_by_line=True,
        max_seq_length=SEQUENCE_LENGTH,
        do_train=True,
        do_eval=True,
        max_steps=4,
        logging_steps=1,
        eval_steps=2,
        save_steps=2,
        max_eval_samples=20,
        learning_rate=1e-3,
        fill_mask_top_k=0,
        seed=0,
    )


@pytest.fixture(scope="module")
def model_dir_without_dropout(model_dir, tmp_path_factory):
    """The test model without dropout, whose steps do not depend on how a batch is split into micro-batches."""
    directory = tmp_path_factory.mktemp("tiny-roberta-no-dropout")
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    config = RobertaConfig.from_pretrained(model_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def one_device_run(run_tool, model_dir_without_dropout, tmp_path_factory):
    """The line_by_line run on one device, 8 sequences per step in 2 micro-batches of 4, its arguments read
    from a .json file: (output dir, arguments)."""
    directory = tmp_path_factory.mktemp("one-device")
    values = dict(
        line_by_line_arguments(model_dir_without_dropout),
        output_dir=str(directory / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=8,
    )
    arguments_file = directory / "arguments.json"
    arguments_file.write_text(json.dumps(values))
    run_mlm(run_tool, [arguments_file])
    return directory / "out", values


def test_eight_devices_sharing_the_parameters_give_the_losses_of_one_device_accumulating(
    run_tool, model_dir_without_dropout, one_device_run, tmp_path, monkeypatch
):
    """Training and evaluation on 8 devices of 1 sequence each, with the parameters and optimizer state split
    over 4 of them (FSDP), equal 1 device summing the gradients of 2 micro-batches of 4 sequences."""
    one_device_dir, _ = one_device_run
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    result = run_mlm(
        run_tool,
        [
            *(f"--{name}={value}" for name, value in line_by_line_arguments(model_dir_without_dropout).items()),
            f"--output_dir={tmp_path / 'eight'}",
            "--per_device_train_batch_size=1",
            "--per_device_eval_batch_size=1",
            "--mesh_shape=data=2,fsdp=4",
        ],
    )
    assert "8 devices" in result.stderr and "'fsdp': 4" in result.stderr
    for tag in ("train/loss", "train/accuracy", "train/grad_norm", "eval/loss", "eval/accuracy"):
        one, eight = scalars(one_device_dir, tag), scalars(tmp_path / "eight", tag)
        assert [step for step, _ in one] == [step for step, _ in eight] and len(one) >= 2
        np.testing.assert_allclose([value for _, value in eight], [value for _, value in one], rtol=1e-5)


def test_resumed_run_continues_with_the_same_batches_masks_and_weights(run_tool, one_device_run, tmp_path):
    """Resuming the run from its step-2 checkpoint gives the losses and final weights of the uninterrupted run."""
    uninterrupted_dir, values = one_device_run
    output_dir = tmp_path / "resumed"
    shutil.copytree(uninterrupted_dir, output_dir)
    shutil.rmtree(output_dir / "checkpoints" / "4")
    shutil.rmtree(output_dir / "tensorboard")
    (output_dir / "model.safetensors").unlink()
    result = run_mlm(
        run_tool,
        [
            *(f"--{name}={value}" for name, value in dict(values, output_dir=output_dir).items()),
            "--resume_from_checkpoint",
        ],
    )
    assert "Resumed from" in result.stderr and "at step 2" in result.stderr
    assert scalars(output_dir, "train/loss") == scalars(uninterrupted_dir, "train/loss")[2:]
    final, expected = (
        load_file(str(output_dir / "model.safetensors")),
        load_file(str(uninterrupted_dir / "model.safetensors")),
    )
    assert final.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name], err_msg=name)


def test_document_attention_trains_and_evaluates(run_tool, model_dir, tmp_path):
    """Two steps and an evaluation on the lines of the files as texts, several to a block."""
    output_dir = tmp_path / "out"
    command_line = [
        f"--output_dir={output_dir}",
        f"--config_name={model_dir}",
        f"--tokenizer_name={model_dir}",
        f"--train_file={TRAIN_FILE}",
        f"--validation_file={VALIDATION_FILE}",
        "--text_sample_by=line",
        "--document_attention",
        f"--max_seq_length={SEQUENCE_LENGTH}",
        "--per_device_train_batch_size=4",
        "--per_device_eval_batch_size=16",
        "--max_steps=2",
        "--max_eval_samples=32",
        "--fill_mask_top_k=0",
        "--do_train",
        "--do_eval",
    ]
    run_mlm(run_tool, command_line)
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "train_results.json").is_file()
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    assert eval_results["step"] == 2 and eval_results["eval_masked_tokens"] > 100
    assert math.isfinite(eval_results["eval_loss"])


def test_json_arguments_file_gives_the_arguments_of_the_command_line(tmp_path, monkeypatch):
    values = {
        "output_dir": str(tmp_path / "out"),
        "train_file": TRAIN_FILE,
        "max_seq_length": 96,
        "line_by_line": True,
        "mlm_probability": 0.2,
        "do_train": True,
        "learning_rate": 1e-3,
    }
    arguments_file = tmp_path / "arguments.json"
    arguments_file.write_text(json.dumps(values))
    monkeypatch.setattr(sys, "argv", ["run_mlm_flax.py", str(arguments_file)])
    argument_classes = run_mlm_flax.ModelArguments, run_mlm_flax.DataTrainingArguments, run_mlm_flax.TrainingArguments
    from_file = parse_training_arguments(*argument_classes)
    monkeypatch.setattr(sys, "argv", ["run_mlm_flax.py", *(f"--{name}={value}" for name, value in values.items())])
    assert from_file == parse_training_arguments(*argument_classes)
    assert from_file[1].mlm_probability == 0.2 and from_file[1].line_by_line


def test_a_mistake_exits_with_one_clear_line_and_leaves_the_disk_alone(run_tool, model_dir, tmp_path):
    output_dir = tmp_path / "out"
    result = run_mlm(run_tool, [*hf_example_command_line(model_dir, output_dir), "--push_to_hub"], check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --push_to_hub is not supported: upload the model after training with `hf upload` as "
        "docs/exporting.md shows (its files alone)"
    ]
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def bad_inputs(model_dir, tmp_path_factory):
    """Directories and files for the usage-error tests."""
    directory = tmp_path_factory.mktemp("bad-inputs")
    GPT2Config(vocab_size=1000).save_pretrained(str(directory / "gpt2-config"))
    RobertaConfig.from_pretrained(model_dir, pad_token_id=3).save_pretrained(str(directory / "other-pad"))
    no_mask = AutoTokenizer.from_pretrained(model_dir)
    no_mask.mask_token = None
    no_mask.save_pretrained(str(directory / "no-mask-tokenizer"))
    (directory / "empty.txt").write_text("\n  \n\n")
    (directory / "output-with-files").mkdir()
    (directory / "output-with-files" / "notes.txt").write_text("keep me")
    return directory


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--max_seq_length", "300"], "--max_seq_length 300 does not fit the model's positions: .* leaves 256"),
        (["--config_name", "{bad}/gpt2-config"], "has no model of type 'gpt2': it runs roberta"),
        (["--tokenizer_name", "{bad}/no-mask-tokenizer"], "no mask token.*train_tokenizer.py --model_type roberta"),
        (["--config_name", "{bad}/other-pad"], "padding token has id 1 but the config's pad_token_id is 3"),
        (["--model_type", "bert"], "--model_type bert is not supported"),
        (["--mlm_probability", "1.5"], "--mlm_probability 1.5 must be between 0 and 1"),
        (["--max_seq_length", "2"], "--max_seq_length 2 must be at least 3"),
        (["--fill_mask_text", "no mask here"], "--fill_mask_text must contain the mask token <mask>"),
        (["--train_file", "missing.txt"], "--train_file: missing.txt does not exist"),
        (["--line_by_line", "--train_file", "{bad}/empty.txt"], "the train data has no non-empty lines"),
        (["--line_by_line", "--document_attention"], "--document_attention has no effect with --line_by_line"),
        (["--per_device_train_batch_size", "100000"], "lower --per_device_train_batch_size or --max_seq_length"),
        (["--output_dir", "{bad}/output-with-files"], "already holds files; pass --resume_from_checkpoint"),
        (
            ["--hub_model_id", "me/model"],
            "--hub_model_id is not supported: upload the model after training with `hf upload",
        ),
        (["--hub_modelid", "me/model"], "unknown argument --hub_modelid"),
        (
            ["--metric_for_best_model", "eval_bits_per_byte"],
            "--metric_for_best_model eval_bits_per_byte is not a metric of the evaluation; pass one of loss, "
            "perplexity, accuracy",
        ),
        (
            ["--load_best_model_at_end", "--eval_strategy", "epoch"],
            "--load_best_model_at_end needs .* --eval_strategy epoch and --save_strategy steps differ",
        ),
    ],
)
def test_bad_input_is_reported_as_a_usage_error(arguments, message, model_dir, bad_inputs, tmp_path, monkeypatch):
    train_file = [] if "--train_file" in arguments else ["--train_file", TRAIN_FILE]  # both would be read
    command_line = [
        "--output_dir",
        str(tmp_path / "out"),
        "--config_name",
        model_dir,
        "--tokenizer_name",
        model_dir,
        *train_file,
        "--validation_file",
        VALIDATION_FILE,
        "--do_train",
        "--do_eval",
        *(argument.format(bad=bad_inputs) for argument in arguments),
    ]
    monkeypatch.setattr(sys, "argv", ["run_mlm_flax.py", *command_line])
    with pytest.raises(run_mlm_flax.UsageError, match=message):
        run_mlm_flax.main()
    assert (bad_inputs / "output-with-files" / "notes.txt").read_text() == "keep me"
