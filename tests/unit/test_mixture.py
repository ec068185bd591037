"""--data_mixture: several sources of training text drawn by weight, deterministically (so resume is exact and
processes agree), each source evaluated on its own; and the mixture file's mistakes, each refused in one line."""

import itertools
import json
import logging
import shutil
import sys

import numpy as np
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from test_clm import model_dir_with_config, run_clm_flax
from test_mlm import run_mlm_flax

import flax_lm.data.mixture
import flax_lm.devices.mesh
from flax_lm.data.mixture import Mixture, read_mixture, warn_of_validation_files_trained_on
from flax_lm.errors import UsageError

# The stated tolerance: at every step, each source has given within this many rows of its weight's share of all the
# rows drawn so far (measured: at most 4 rows over the first million rows, for 2 to 7 sources of any weights).
ROWS_OFF_WEIGHT = 5


def numbered_sources(sizes, width=4):
    """Sources whose rows say where they come from: row i of source s is filled with 1000 * s + i."""
    return [
        np.repeat(1000 * source + np.arange(size), width).reshape(size, width) for source, size in enumerate(sizes)
    ]


def drawn_rows(mixture, batch_size, steps, seed=0, first_step=0):
    return [
        mixture[indices][:, 0]
        for indices in itertools.islice(mixture.global_batches(batch_size, seed, first_step), steps)
    ]


@pytest.mark.parametrize("weights", [(5, 3, 2), (0.9, 0.1), (1, 1, 1, 1, 1, 1, 1)])
def test_each_source_gives_its_weight_of_the_rows_at_every_step(weights):
    sizes = [37 + 11 * source for source in range(len(weights))]
    mixture = Mixture([f"s{index}" for index in range(len(weights))], list(weights), numbered_sources(sizes))
    shares = np.asarray(weights) / sum(weights)
    counts = np.zeros(len(weights))
    for step, rows in enumerate(drawn_rows(mixture, 16, 500), start=1):
        counts += np.bincount(rows // 1000, minlength=len(weights))
        assert np.all(np.abs(counts - shares * 16 * step) <= ROWS_OFF_WEIGHT), (step, counts)
    np.testing.assert_array_equal(counts, mixture.draws_per_source(500 * 16))


def test_each_source_is_read_pass_after_pass_in_a_new_order_each_time():
    sizes = (23, 5)
    mixture = Mixture(["big", "small"], [1, 1], numbered_sources(sizes))
    rows = np.concatenate(drawn_rows(mixture, 8, 40))
    for source, size in enumerate(sizes):
        drawn = rows[rows // 1000 == source] % 1000
        draws = mixture.source_rows(source, 0, len(drawn), seed=0)
        np.testing.assert_array_equal(np.sort(drawn), np.sort(draws))  # the batches hold the source's draws
        passes = draws[: len(draws) // size * size].reshape(-1, size)
        assert len(passes) >= 5
        for one_pass in passes:  # every row once in each pass, whatever the other source does
            np.testing.assert_array_equal(np.sort(one_pass), np.arange(size))
        assert len({tuple(one_pass) for one_pass in passes}) > len(passes) // 2  # (5 rows have only 120 orders)


def test_batches_follow_the_seed_and_a_resumed_run_draws_the_very_same_rows():
    mixture = Mixture(["a", "b", "c"], [2, 1, 1], numbered_sources((19, 7, 40)))
    uninterrupted = drawn_rows(mixture, 12, 60)
    resumed = drawn_rows(Mixture(["a", "b", "c"], [2, 1, 1], numbered_sources((19, 7, 40))), 12, 20, first_step=40)
    np.testing.assert_array_equal(np.stack(resumed), np.stack(uninterrupted[40:]))
    assert not np.array_equal(np.stack(drawn_rows(mixture, 12, 60, seed=1)), np.stack(uninterrupted))


def test_processes_each_take_their_rows_of_the_same_global_batch(monkeypatch):
    """run_mlm_flax.py's masked mixture batches: the rows of 2 processes together are the batch of 1, masks and all."""
    tokenizer_ids = dict(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, mask_token_id=4, special_token_ids=(0, 1, 2, 4)
    )
    make_batch = run_mlm_flax.BatchMaker(**tokenizer_ids, random_token_count=50, mlm_probability=0.3, max_seq_length=6)
    mixture = Mixture(["a", "b"], [3, 1], [np.arange(5, 45).reshape(10, 4), np.arange(45, 85).reshape(10, 4)])

    def batches(process_index, process_count):
        monkeypatch.setattr(flax_lm.devices.mesh.jax, "process_index", lambda: process_index)
        monkeypatch.setattr(flax_lm.devices.mesh.jax, "process_count", lambda: process_count)
        generator = run_mlm_flax.mixture_train_batches(mixture, make_batch, 8, 0, 3)
        return [batch for batch, _ in itertools.islice(generator, 4)]

    alone, first, second = batches(0, 1), batches(0, 2), batches(1, 2)
    for whole, part_0, part_1 in zip(alone, first, second):
        for name, values in whole.items():
            np.testing.assert_array_equal(values, np.concatenate([part_0[name], part_1[name]]))


# ----------------------------------------------------------------------------------------------------
# Runs of the training scripts
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("mixture-model"))


def write_mixture(directory, **sources):
    """A mixture file in `directory`, its paths relative to it, the data files copied beside it."""
    data = directory / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(FIXTURES_DIR / "en" / "train.txt", data / "en-train.txt")
    shutil.copy(FIXTURES_DIR / "en" / "validation.txt", data / "en-validation.txt")
    shutil.copy(FIXTURES_DIR / "corpus" / "norwegian.txt", data / "norwegian.txt")
    shutil.copy(FIXTURES_DIR / "corpus" / "turkish.txt", data / "turkish.txt")
    lines = []
    for name, fields in sources.items():
        lines.append(f"{name}:")
        lines.extend(f"  {key}: {json.dumps(value)}" for key, value in fields.items())
    path = directory / "mixture.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


SOURCES = {
    "english": {"weight": 3, "train_file": "data/en-train.txt", "validation_file": "data/en-validation.txt"},
    "nordic": {"weight": 1, "train_file": ["data/norwegian.txt", "data/turkish.txt"]},
}


def clm_arguments(model_dir, output_dir, mixture, *extra):
    return [
        "run_clm_flax.py", "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--data_mixture", mixture, "--block_size", "32", "--per_device_train_batch_size", "8", "--seed", "0",
        "--learning_rate", "3e-3", "--sample_tokens", "0", "--max_steps", "12", "--logging_steps", "4",
        "--save_steps", "6", "--eval_steps", "6", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "content, message",
    [
        ("english: [1, 2]", "source 'english' must be a mapping of weight, train_file, validation_file"),
        ("english: {weight: 0, train_file: a.txt}", "source 'english' needs a positive weight"),
        ("english: {weight: two, train_file: a.txt}", "source 'english' needs a positive weight"),
        ("english: {weight: 1, train_files: a.txt}", "source 'english' must be a mapping of weight"),
        ("english: {weight: 1}", "source 'english' has a weight but no train_file"),
        ("'english words': {weight: 1, train_file: a.txt}", "source name 'english words' must be letters"),
        ("english: {weight: 1, train_file: a.txt", "is not YAML or JSON"),
        ("[]", "must map each source's name to its weight and files"),
        # PyYAML keeps the last of two equal keys: the run would train on one source, or with one of two weights
        ("web: {weight: 1, train_file: a.txt}\nweb: {weight: 1, train_file: b.txt}", "line 2 gives 'web' a second"),
        ('{"web": {"weight": 1, "train_file": "a.txt"}, "web": {"weight": 2}}', "line 1 gives 'web' a second time"),
        ("web:\n  weight: 1\n  train_file: a.txt\n  weight: 3", "line 4 gives 'weight' a second time"),
        ("english: {weight: .inf, train_file: a.txt}", "source 'english' needs a positive weight"),
        ("english: {weight: .nan, train_file: a.txt}", "source 'english' needs a positive weight"),
        ("english: {weight: '3', train_file: a.txt}", "source 'english' needs a positive weight"),
    ],
)
def test_mistakes_in_the_mixture_file_are_one_line(content, message, tmp_path):
    path = tmp_path / "mixture.yaml"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        read_mixture(str(path))


@pytest.mark.parametrize(
    "content", ["a: {weight: 1e-3, train_file: a.txt}", '{"a": {"weight": 1e-3, "train_file": "a.txt"}}']
)
def test_a_weight_in_exponent_notation_is_the_number_it_spells_in_yaml_and_json(content, tmp_path):
    path = tmp_path / "mixture.yaml"
    path.write_text(content)
    (source,) = read_mixture(str(path))
    assert source.weight == 0.001


def test_weights_near_the_largest_float_are_shares_that_sum_to_one(tmp_path):
    path = tmp_path / "mixture.yaml"
    path.write_text("a: {weight: 1.0e+308, train_file: a.txt}\nb: {weight: 1.0e+308, train_file: b.txt}\n")
    weights = [source.weight for source in read_mixture(str(path))]
    mixture = Mixture(["a", "b"], weights, numbered_sources([10, 10]))
    np.testing.assert_array_equal(mixture.weights, [0.5, 0.5])
    assert np.bincount(mixture.sources_of_draws(0, 1000)).tolist() == [500, 500]


def test_a_validation_file_trained_on_by_another_source_is_warned_of_naming_both(tmp_path, caplog):
    path = write_mixture(
        tmp_path, english=SOURCES["english"], copy={"weight": 1, "train_file": "data/en-validation.txt"}
    )
    with caplog.at_level(logging.WARNING, logger=flax_lm.data.mixture.logger.name):
        warn_of_validation_files_trained_on(read_mixture(path), "--data_mixture mixture.yaml")
    (warning,) = caplog.messages
    assert warning.startswith(
        "--data_mixture mixture.yaml: the validation_file of source 'english' is a train_file of source 'copy' ("
    )


@pytest.mark.parametrize(
    "extra, other_source, fragments",
    [
        (["--train_file", "x.txt"], None, ["--data_mixture names the data, so --train_file has no place beside it"]),
        (["--streaming"], None, ["so --streaming has no place beside it"]),
        ([], "data/missing.txt", ["source 'other': --train_file: /", "data/missing.txt does not exist"]),
        ([], "data/blank.txt", ["the training data of source 'other' makes 0 examples, fewer than 2"]),
    ],
)
def test_mixture_misuse_is_refused_in_one_line(
    extra, other_source, fragments, model_dir, tmp_path, monkeypatch, capfd
):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "blank.txt").write_text("\n\n \n\n")
    sources = {**SOURCES, "other": {"weight": 1, "train_file": other_source}} if other_source else SOURCES
    mixture = write_mixture(tmp_path, **sources)
    monkeypatch.setattr(sys, "argv", clm_arguments(model_dir, tmp_path / "run", mixture, *extra))
    with pytest.raises(SystemExit) as stopped:
        run_clm_flax.call_with_one_line_errors(run_clm_flax.main)
    assert stopped.value.code != 0
    error = capfd.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and all(fragment in error for fragment in fragments), error


def test_the_documented_mixture_file_reads_as_it_says(tmp_path):
    page = (REPO_DIR / "docs" / "pretraining-clm.md").read_text()
    example = next(block for block in page.split("```yaml\n")[1:] if block.startswith("# mixture.yaml"))
    example = example.split("```")[0]
    path = tmp_path / "mixture.yaml"
    path.write_text(example)
    prose, code, wiki = read_mixture(str(path))
    assert (prose.name, prose.weight, code.weight, wiki.weight) == ("prose", 3, 1, None)
    assert prose.train_file == [str(tmp_path / "prose/*.jsonl.gz"), str(tmp_path / "books.txt")]
    assert wiki.validation_file == [str(tmp_path / "wiki-valid.txt")] and not wiki.train_file
