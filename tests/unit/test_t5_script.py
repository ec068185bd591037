"""run_t5_mlm_flax.py in this process: its batches of plain text and of pairs, and its one-line refusals of a
tokenizer without sentinels, a --max_seq_length too short for one span and a pair without its target."""

import importlib.util
import json
import string
import sys
import warnings

import datasets
import numpy as np
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from transformers import AutoTokenizer, T5Config, T5Tokenizer

from flax_lm.data.source import ExampleSettings, TextSource
from flax_lm.errors import UsageError

TRAIN_FILE = FIXTURES_DIR / "en" / "train.txt"
SENTINELS = 10


def load_script():
    spec = importlib.util.spec_from_file_location("run_t5_mlm_flax", REPO_DIR / "run_t5_mlm_flax.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_t5_mlm_flax = load_script()


def t5_tokenizer(sentinels: int) -> T5Tokenizer:
    """A T5 tokenizer of single characters (and word starts), its sentinels numbered down from the top id."""
    characters = string.ascii_letters + string.digits + ".,;:!?'\"-()"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(character, -3.0) for character in characters]
    pieces += [("\u2581" + character, -3.5) for character in string.ascii_lowercase]
    pieces += [(f"<extra_id_{number}>", 0.0) for number in reversed(range(sentinels))]
    return T5Tokenizer(vocab=pieces, extra_ids=sentinels)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """{"t5": a tiny T5 config with a tokenizer of SENTINELS sentinels, "no_sentinels": the same without}."""
    dirs = {}
    for name, sentinels in (("t5", SENTINELS), ("no_sentinels", 0)):
        directory = tmp_path_factory.mktemp(name)
        tokenizer = t5_tokenizer(sentinels)
        tokenizer.save_pretrained(directory)
        config = T5Config(vocab_size=128, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        config.save_pretrained(directory)
        dirs[name] = directory
    return dirs


def refusal(monkeypatch, tmp_path, *arguments) -> str:
    """The one-line message main() refuses `arguments` with; nothing is written."""
    output_dir = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["run_t5_mlm_flax.py", "--output_dir", str(output_dir), *map(str, arguments)])
    with pytest.raises(UsageError) as refused:
        run_t5_mlm_flax.main()
    message = str(refused.value)
    assert "\n" not in message
    assert not output_dir.exists() or not list(output_dir.iterdir()), "it wrote output before refusing"
    return message


def test_a_tokenizer_without_sentinels_is_refused(model_dirs, monkeypatch, tmp_path):
    directory = model_dirs["no_sentinels"]
    message = refusal(
        monkeypatch, tmp_path, "--config_name", directory, "--tokenizer_name", directory, "--train_file", TRAIN_FILE
    )
    assert message.startswith(f"the tokenizer in {directory} has no sentinel tokens (<extra_id_0>, "), message
    assert "train_tokenizer.py --model_type t5" in message


def test_a_max_seq_length_too_short_for_one_span_is_refused(model_dirs, monkeypatch, tmp_path):
    directory = model_dirs["t5"]
    message = refusal(
        monkeypatch, tmp_path, "--config_name", directory, "--tokenizer_name", directory, "--train_file", TRAIN_FILE,
        "--max_seq_length", 6,
    )  # fmt: skip
    assert message.startswith("--max_seq_length 6 is too short for one span of noise"), message
    assert message.endswith("raise it to at least 10")


def test_rows_needing_more_sentinels_than_the_tokenizer_has_are_refused(model_dirs, monkeypatch, tmp_path):
    directory = model_dirs["t5"]
    # 568 tokens drop 85 in 28 spans, and the tokenizer has 10 sentinels.
    message = refusal(
        monkeypatch, tmp_path, "--config_name", directory, "--tokenizer_name", directory, "--train_file", TRAIN_FILE,
        "--max_seq_length", 512,
    )  # fmt: skip
    assert "dropping 28 spans, and the tokenizer" in message and "has 10 sentinels" in message, message


def test_a_pair_without_its_target_is_refused_naming_the_file_row_and_field(model_dirs, monkeypatch, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"in_text": f"question {number}", "out_text": f"answer {number}"} for number in range(5)]
    del rows[2]["out_text"]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    directory = model_dirs["t5"]
    message = refusal(
        monkeypatch, tmp_path, "--config_name", directory, "--tokenizer_name", directory, "--train_file", pairs,
        "--max_seq_length", 32, "--cache_dir", tmp_path / "cache",
    )  # fmt: skip
    assert message.startswith(f"row 3 of {pairs} has no completion (field 'completion' or 'out_text': missing"), (
        message
    )


def test_conversations_are_refused(model_dirs, monkeypatch, tmp_path):
    conversations = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    conversations.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(4)))
    directory = model_dirs["t5"]
    message = refusal(
        monkeypatch, tmp_path, "--config_name", directory, "--tokenizer_name", directory, "--train_file",
        conversations, "--max_seq_length", 32, "--cache_dir", tmp_path / "cache",
    )  # fmt: skip
    assert "conversations" in message and "run_t5_mlm_flax.py trains on plain text or on input/target pairs" in message


def batch_maker(directory, max_seq_length: int):
    config, tokenizer = T5Config.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    data_args = run_t5_mlm_flax.DataTrainingArguments(max_seq_length=max_seq_length)
    return run_t5_mlm_flax.batch_maker(config, tokenizer, data_args), tokenizer


def test_a_batch_of_pairs_holds_them_as_the_tokenizer_encodes_them_for_a_seq2seq_model(model_dirs):
    make_batch, tokenizer = batch_maker(model_dirs["t5"], 24)
    pairs = {"prompt": ["translate: a cat", "b", "a long input that does not fit the row at all"], "completion": [
        "le chat", "c d e", "x"]}  # fmt: skip
    source = TextSource(examples=ExampleSettings())
    dataset = datasets.Dataset.from_dict(pairs)
    row_arrays = run_t5_mlm_flax.example_rows(dataset, "train", tokenizer, make_batch.row_length, source,
                                              "prompt_completion", max_seq_length=24)  # fmt: skip
    rows = np.concatenate(list(row_arrays))
    assert rows.shape == (2, 2, 24)  # the third pair is longer than a row: left out
    batch = make_batch(rows, np.arange(2), 3, (0,))  # and a third, empty row
    # As wide as the longest input and target, rounded up to a power of two from 16: not the row's 24.
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 16)
    for row, (prompt, completion) in enumerate(zip(pairs["prompt"][:2], pairs["completion"][:2])):
        input_ids, labels = tokenizer(prompt)["input_ids"], tokenizer(text_target=completion)["input_ids"]
        assert batch["input_ids"][row, : len(input_ids)].tolist() == input_ids and labels[-1] == tokenizer.eos_token_id
        assert batch["attention_mask"][row].sum() == len(input_ids)
        assert batch["labels"][row, : len(labels)].tolist() == labels
        assert batch["label_weights"][row].tolist() == [1.0] * len(labels) + [0.0] * (16 - len(labels))
        assert batch["decoder_input_ids"][row, : len(labels)].tolist() == [0] + labels[:-1]
    assert batch["label_weights"][2].sum() == 0 and batch["attention_mask"][2].all()  # nothing masked out entirely
    # A call runs its steps' batches as one array: each is padded to the widest of its call.
    narrow = make_batch(rows, np.arange(1), 3, (0,))
    wide = {name: np.pad(values, ((0, 0), (0, 16))) for name, values in batch.items()}
    (padded, _), (same, _) = run_t5_mlm_flax.as_wide_as_their_call(iter([(narrow, 1), (wide, 2)]), [2], 0)
    assert padded["labels"].shape == (3, 32) and (padded["label_weights"][:, 16:] == 0).all()
    assert (padded["input_ids"][:, :16] == narrow["input_ids"]).all() and (same["labels"] == wide["labels"]).all()


def test_a_batch_of_text_is_corrupted_into_inputs_of_max_seq_length(model_dirs):
    make_batch, tokenizer = batch_maker(model_dirs["t5"], 64)
    rows = np.random.default_rng(0).integers(3, 80, (4, make_batch.row_length)).astype(np.int32)
    batch = make_batch(rows, np.arange(4), 4, (1, 2))
    assert batch["input_ids"].shape == (4, 64) and batch["attention_mask"].all() and batch["label_weights"].all()
    assert batch["labels"].shape == (4, make_batch.target_length)
    assert (batch["labels"][:, 0] == tokenizer.convert_tokens_to_ids("<extra_id_0>")).all()
    assert (batch["decoder_input_ids"][:, 1:] == batch["labels"][:, :-1]).all()
    # Rows 2 and 3 are corrupted alike when they are a process's share of the batch.
    share = make_batch(rows, np.arange(4), 4, (1, 2), slice(2, 4))
    assert (share["input_ids"] == batch["input_ids"][2:]).all()


def test_the_token_cache_key_of_the_scripts_row_functions_is_read_without_numpys_future_warnings():
    """The rows' code reads `.str` and `.object` of other things beside `np.`; the key asks numpy for those names
    without its FutureWarning about removed aliases, which a run printed before."""
    from flax_lm.data.cache_key import function_code_fingerprint

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        keys = {
            function_code_fingerprint(rows) for rows in (run_t5_mlm_flax.tokenized_rows, run_t5_mlm_flax.example_rows)
        }
    assert len(keys) == 2


def test_the_token_cache_of_pairs_is_keyed_by_max_seq_length_not_by_the_row_length_of_text(model_dirs, tmp_path):
    """Pairs are padded to --max_seq_length whatever the noise flags, which set the length of the rows of text: other
    noise flags find the pairs' cache, another --max_seq_length packs them anew in rows of its length."""
    from flax_lm.data.loading import DataRoute, cached_rows

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"in_text": f"question {n}", "out_text": f"answer {n}"}) + "\n" for n in range(4))
    )
    config, tokenizer = T5Config.from_pretrained(model_dirs["t5"]), AutoTokenizer.from_pretrained(model_dirs["t5"])
    source = TextSource(train_file=str(pairs), examples=ExampleSettings(), cache_dir=str(tmp_path / "texts"))
    caches = []
    for max_seq_length, noise_density in ((24, 0.15), (24, 0.3), (32, 0.15)):
        data_args = run_t5_mlm_flax.DataTrainingArguments(max_seq_length=max_seq_length, noise_density=noise_density)
        texts_to_rows = run_t5_mlm_flax.script_texts_to_rows(
            data_args, tokenizer, run_t5_mlm_flax.batch_maker(config, tokenizer, data_args)
        )
        rows, _ = cached_rows(DataRoute(source, do_eval=False), texts_to_rows)
        assert np.asarray(rows["train"]).shape == (4, 2, max_seq_length)
        caches.append(rows["train"].directory)
    assert caches[0] == caches[1] != caches[2]


def test_pairs_packed_in_a_packed_data_dir_record_max_seq_length_and_are_read_again_with_other_noise_flags(
    model_dirs, tmp_path
):
    """--packed_data_dir records the length of the pairs' rows, --max_seq_length, not that of rows of text (which the
    noise flags change): a run with other noise flags reads the corpus; one of another --max_seq_length is refused."""
    from flax_lm.data.loading import DataRoute, load_data

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"question {n}", "completion": f"answer {n}"}) + "\n" for n in range(4))
    )
    config, tokenizer = T5Config.from_pretrained(model_dirs["t5"]), AutoTokenizer.from_pretrained(model_dirs["t5"])
    source = TextSource(train_file=str(pairs), examples=ExampleSettings(), cache_dir=str(tmp_path / "texts"))
    packed_dir = tmp_path / "packed"

    def load(max_seq_length: int, noise_density: float) -> dict:
        data_args = run_t5_mlm_flax.DataTrainingArguments(max_seq_length=max_seq_length, noise_density=noise_density)
        texts_to_rows = run_t5_mlm_flax.script_texts_to_rows(
            data_args, tokenizer, run_t5_mlm_flax.batch_maker(config, tokenizer, data_args)
        )
        return load_data(DataRoute(source, do_eval=False, packed_data_dir=str(packed_dir)), texts_to_rows).rows

    packed = np.asarray(load(24, 0.15)["train"])
    assert packed.shape == (4, 2, 24)
    assert json.loads((packed_dir / "index.json").read_text())["block_size"] == 24
    written = (packed_dir / "train-00000.npy").stat().st_mtime_ns
    np.testing.assert_array_equal(np.asarray(load(24, 0.3)["train"]), packed)  # rows of text of 29 tokens, not 26
    assert (packed_dir / "train-00000.npy").stat().st_mtime_ns == written
    with pytest.raises(UsageError, match="holds blocks of 24 tokens, not the 32 that --max_seq_length sets"):
        load(32, 0.15)
