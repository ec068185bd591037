"""What run_clm_flax.py trains on: .txt files as written (one document each, unless --text_sample_by says
otherwise), each split read with its own format, the model's own end-of-text token (the documented tokenizer
recipe), and bits per byte; checked against the exported model scored in PyTorch on the raw validation text."""

import shutil

import numpy as np
import pyarrow
import pytest
from conftest import FIXTURES_DIR, TOKENIZER_TRAINING_FILES
from test_clm import run_clm_flax, tiny_config
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer

import flax_lm.data.loading
import flax_lm.data.long_texts
import flax_lm.data.pieces
import flax_lm.data.texts
from flax_lm.data.long_texts import LongText, long_text_of
from flax_lm.data.source import TextSource
from flax_lm.data.texts import BYTE_ORDER_MARK, without_byte_order_marks

CORPUS = FIXTURES_DIR / "en"
BLOCK_SIZE = 64


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    return recipe_model_dir(tmp_path_factory.mktemp("recipe"))


def recipe_model_dir(directory) -> str:
    """`directory` holding the documented recipe: a ByteLevelBPETokenizer with <s> <pad> </s> <unk> <mask>, saved as
    tokenizer.json beside a GPT-2 config of the same vocab_size whose eos_token_id is 2 (</s>)."""
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train(
        [str(path) for path in TOKENIZER_TRAINING_FILES],
        vocab_size=1000,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    tiny_config(vocab_size=1000, n_positions=BLOCK_SIZE, bos_token_id=0, eos_token_id=2).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def recipe_tokenizer(recipe_dir):
    model_arguments = run_clm_flax.ModelArguments(tokenizer_name=recipe_dir, config_name=recipe_dir)
    return run_clm_flax.load_config_and_tokenizer(model_arguments, "gpt2")[1]


def load(tmp_path, **data_arguments):
    model_arguments = run_clm_flax.ModelArguments(cache_dir=str(tmp_path / "cache"))
    # A whole .txt file is one text unless --text_sample_by says otherwise, as check_arguments sets it.
    data_arguments = run_clm_flax.DataTrainingArguments(**{"text_sample_by": "document", **data_arguments})
    return flax_lm.data.texts.load_text_datasets(data_arguments.text_source(model_arguments))


def write_text_files(tmp_path):
    first = "A first file.\nIts second line,\n  indented.\n\nA paragraph after a blank line.\n"
    second = "The second file has no line break at its end"
    (tmp_path / "a.txt").write_text(first)
    (tmp_path / "b.txt").write_text(second)
    return first, second


@pytest.mark.parametrize("sample_by", ["document", "paragraph", "line"])
def test_txt_files_are_cut_into_documents_each_followed_by_eos(sample_by, recipe_tokenizer, tmp_path):
    first, second = write_text_files(tmp_path)
    expected_texts = {
        "document": [first, second],
        "paragraph": [*first.split("\n\n"), second],
        "line": [*first.splitlines(keepends=True), second],
    }[sample_by]
    dataset = load(tmp_path, train_file=str(tmp_path / "*.txt"), text_sample_by=sample_by)["train"]
    assert dataset["text"] == expected_texts
    if sample_by == "document":  # each document written to Arrow as it was read, not the corpus held to the end
        assert len(dataset.data.to_batches()) == len(expected_texts)

    eos = recipe_tokenizer.eos_token_id
    tokens = np.concatenate(list(run_clm_flax.token_arrays(dataset, recipe_tokenizer, "text")))
    expected = [token for text in expected_texts for token in recipe_tokenizer(text)["input_ids"] + [eos]]
    np.testing.assert_array_equal(tokens, expected)
    assert np.sum(tokens == eos) == len(expected_texts)


@pytest.mark.parametrize(
    "model_type, framed",
    [
        ("gpt2", "A first file.<|endoftext|>The second one<|endoftext|>"),
        ("llama", "<|begin_of_text|>A first file.<|end_of_text|><|begin_of_text|>The second one<|end_of_text|>"),
    ],
)
def test_the_blocks_frame_each_document_as_the_model_type_was_trained(
    model_type, framed, test_tokenizer_dirs, tmp_path
):
    """Read back from the packed blocks: GPT-2's documents each end with its end-of-text token (which also starts the
    next), Llama's begin with BOS (as a Llama tokenizer frames a text) and end with EOS."""
    (tmp_path / "a.txt").write_text("A first file.")
    (tmp_path / "b.txt").write_text("The second one")
    dataset = load(tmp_path, train_file=str(tmp_path / "*.txt"))["train"]
    tokenizer = AutoTokenizer.from_pretrained(test_tokenizer_dirs[model_type])
    # Blocks of one token, so that no tail is cut off.
    blocks = np.concatenate(list(run_clm_flax.tokenized_rows(dataset, "train", tokenizer, 1, TextSource())))
    assert tokenizer.decode(blocks.reshape(-1)) == framed


def test_text_files_of_prose_get_one_eos_per_file_not_per_line(recipe_tokenizer, tmp_path):
    shares = {}
    for sample_by in ("line", "document"):
        dataset = load(tmp_path, train_file=str(CORPUS / "train.txt"), text_sample_by=sample_by)["train"]
        tokens = np.concatenate(list(run_clm_flax.token_arrays(dataset, recipe_tokenizer, "text")))
        shares[sample_by] = np.mean(tokens == recipe_tokenizer.eos_token_id)
    lines = len((CORPUS / "train.txt").read_text().splitlines())
    assert shares["document"] < 1e-4 and shares["line"] > 100 * shares["document"] and lines > 100


def test_each_split_is_read_with_the_builder_of_its_own_format(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a json document"}\n{"text": "another one"}\n')
    (tmp_path / "validation.txt").write_text('{"text": "this is text, not json"}\nsecond line\n')
    splits = load(tmp_path, train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "validation.txt"))
    assert splits["train"]["text"] == ["a json document", "another one"]
    assert splits["validation"]["text"] == ['{"text": "this is text, not json"}\nsecond line\n']
    # A glob of several formats: each format read by its own builder, the texts joined format after format.
    (tmp_path / "more.txt").write_text("text")
    mixed = load(tmp_path, train_file=str(tmp_path / "*.*"))["train"]["text"]
    assert mixed == ["text", '{"text": "this is text, not json"}\nsecond line\n', "a json document", "another one"]


def test_dropping_line_breaks_is_refused_unless_reading_lines(tmp_path):
    write_text_files(tmp_path)
    model_args = run_clm_flax.ModelArguments(tokenizer_name="unused")
    data_args = run_clm_flax.DataTrainingArguments(train_file=str(tmp_path / "a.txt"), keep_linebreaks=False)
    training_args = run_clm_flax.TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True)
    with pytest.raises(run_clm_flax.UsageError, match="--keep_linebreaks False applies to --text_sample_by line only"):
        run_clm_flax.check_arguments(model_args, data_args, training_args)
    data_args = run_clm_flax.DataTrainingArguments(train_file=str(tmp_path / "a.txt"), text_sample_by="sentence")
    with pytest.raises(run_clm_flax.UsageError, match="--text_sample_by sentence is not one of document, paragraph"):
        run_clm_flax.check_arguments(model_args, data_args, training_args)  # as a JSON file of arguments may say
    lines = load(tmp_path, train_file=str(tmp_path / "a.txt"), keep_linebreaks=False, text_sample_by="line")["train"]
    assert lines[0] == {"text": "A first file."}


def test_long_texts_encoded_in_pieces_give_the_tokens_of_the_whole_text(recipe_tokenizer, monkeypatch):
    backend = recipe_tokenizer.backend_tokenizer
    assert flax_lm.data.texts.cuts_at_line_starts_keep_the_tokens(backend)
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", 300)
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECES_AT_ONCE", 3)
    paths = [*TOKENIZER_TRAINING_FILES, CORPUS / "validation.txt"]
    texts = [path.read_text() for path in paths if path.suffix == ".txt"]
    texts.append("code:\n    indented line\n\n\nend\n" * 200)  # line starts after blank and indented lines
    whole = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    assert flax_lm.data.texts.encode_texts(backend, texts, cut_long_texts=True) == whole
    assert len(flax_lm.data.texts.LINE_START.findall(texts[-1])) > 100


def test_a_text_of_one_long_line_is_encoded_in_bounded_pieces_with_the_tokens_of_the_whole(
    recipe_tokenizer, monkeypatch
):
    backend = recipe_tokenizer.backend_tokenizer
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", 300)
    words = (CORPUS / "train.txt").read_text().split()
    # One line, no line break: words after one space, after several, after punctuation and tabs.
    line = " ".join(words[:3000]) + "  double  spaced,\tand tabbed. " + "x" * 1000 + " end"
    pieces = []
    encode_batch_fast = backend.encode_batch_fast

    class Recording:  # the backend, its pieces written down
        def encode_batch_fast(self, texts, add_special_tokens):
            pieces.extend(texts)
            return encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    [ids] = flax_lm.data.texts.encode_texts(Recording(), [line], cut_long_texts=True)
    assert ids == backend.encode(line, add_special_tokens=False).ids
    assert "".join(pieces) == line and len(pieces) > 40
    # Each piece at most two lengths, but where no space comes for that long (the 1000 x's): up to the next word.
    assert sorted(len(piece) for piece in pieces)[-2] <= 600 and max(len(piece) for piece in pieces) < 1400


def test_a_long_text_read_a_stretch_at_a_time_is_cut_as_the_whole_string_is(monkeypatch):
    """A text longer than a piece (a .txt file read as one document) is read from its Arrow bytes a stretch at a
    time, never far beyond the piece being cut: the same pieces as the whole string gives."""
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", 300)
    monkeypatch.setattr(flax_lm.data.long_texts, "STRETCH_BYTES", 101)  # cuts characters of several bytes too
    prose = (CORPUS / "train.txt").read_text()
    texts = [
        BYTE_ORDER_MARK + prose,
        prose.replace("\n", " ")[:20_000],  # one line: cut at words
        "é" * 50 + prose[:5000].replace(" ", "") + " ü ß" * 2000,  # no cut for thousands of characters, then words
    ]
    read = []
    with flax_lm.data.pieces.pieces_of(2**11 / 2**20):
        for text in texts:
            whole = list(flax_lm.data.texts.document_pieces([without_byte_order_marks([text], "t")], True))
            long_text = long_text_of(pyarrow.array([text]))
            stretches = long_text.after(BYTE_ORDER_MARK) if long_text.startswith(BYTE_ORDER_MARK) else long_text
            assert isinstance(without_byte_order_marks([long_text], "t")[0], LongText)

            def counted(stretches):
                for stretch in stretches:
                    read.append(len(stretch))
                    yield stretch

            pieces, ahead = [], []
            for text_piece, started, goes_on in flax_lm.data.long_texts.long_text_pieces(
                counted(stretches.stretches()), 2**11, 300, flax_lm.data.texts.next_cut
            ):
                pieces.append(([text_piece], started, goes_on))
                ahead.append(sum(read) - sum(len(piece) for [piece], _, _ in pieces))
            assert pieces == whole and len(whole) > 4
            read.clear()
            if text is texts[0]:  # text read beyond the pieces handed on: at most the next cut's search and a stretch
                assert max(ahead) <= 2 * 300 + 101 + 2**11


def test_a_txt_document_longer_than_a_piece_gives_the_tokens_of_the_whole_text(
    recipe_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", 300)
    cut = []
    monkeypatch.setattr(flax_lm.data.texts, "long_text_pieces", spy(flax_lm.data.texts.long_text_pieces, cut))
    text = BYTE_ORDER_MARK + (CORPUS / "train.txt").read_text()
    (tmp_path / "long.txt").write_text(text)
    dataset = load(tmp_path, train_file=str(tmp_path / "long.txt"))["train"]
    with flax_lm.data.pieces.pieces_of(2**13 / 2**20):
        tokens = np.concatenate(list(run_clm_flax.token_arrays(dataset, recipe_tokenizer, "text")))
    whole = recipe_tokenizer.backend_tokenizer.encode(text[1:], add_special_tokens=False).ids
    np.testing.assert_array_equal(tokens, [*whole, recipe_tokenizer.eos_token_id])
    assert cut  # read as a LongText, never one string
    assert not dataset.cache_files  # the file itself, mapped: no conversion by datasets
    # Carriage returns, which datasets' text reader turns into line feeds: that reader reads the file then.
    (tmp_path / "windows.txt").write_bytes(b"one\r\ntwo\r\n")
    converted = load(tmp_path, train_file=str(tmp_path / "windows.txt"))["train"]
    assert converted["text"] == ["one\ntwo\n"] and converted.cache_files


def spy(function, calls: list):
    def recorded(*arguments):
        calls.append(arguments)
        return function(*arguments)

    return recorded


def test_the_recipe_tokenizer_ends_documents_with_the_models_eos(recipe_tokenizer, caplog):
    assert len(recipe_tokenizer) == 1001  # AutoTokenizer added GPT-2's <|endoftext|> beyond the vocabulary
    assert (recipe_tokenizer.eos_token, recipe_tokenizer.eos_token_id) == ("</s>", 2)
    ids = recipe_tokenizer("a text that says <|endoftext|> and </s>", add_special_tokens=False)["input_ids"]
    assert max(ids) < 1000 and 2 not in ids, "special tokens written in a text are encoded as text"


def test_a_tokenizer_whose_text_ids_exceed_the_vocabulary_is_still_refused(recipe_dir, tmp_path):
    directory = tmp_path / "small"
    shutil.copytree(recipe_dir, directory)
    tiny_config(vocab_size=900, eos_token_id=2).save_pretrained(directory)
    model_arguments = run_clm_flax.ModelArguments(tokenizer_name=str(directory), config_name=str(directory))
    with pytest.raises(run_clm_flax.UsageError, match="tokenizer has 1001 tokens but the config's vocab_size is 900"):
        run_clm_flax.load_config_and_tokenizer(model_arguments, "gpt2")


# ----------------------------------------------------------------------------------------------------
# The masked LM's texts (a short run on .txt files, its export scored in PyTorch: test_document_runs.py)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line_by_line, sample_by, num_texts", [(True, "line", 5), (False, "document", 1)])
def test_masked_lm_reads_lines_with_line_by_line_and_whole_files_otherwise(
    line_by_line, sample_by, num_texts, tmp_path
):
    import run_mlm_flax

    write_text_files(tmp_path)
    model_args = run_mlm_flax.ModelArguments(cache_dir=str(tmp_path / "cache"), tokenizer_name="unused")
    data_args = run_mlm_flax.DataTrainingArguments(train_file=str(tmp_path / "a.txt"), line_by_line=line_by_line)
    training_args = run_mlm_flax.TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True)
    run_mlm_flax.check_arguments(model_args, data_args, training_args)
    assert data_args.text_sample_by == sample_by
    assert len(flax_lm.data.texts.load_text_datasets(data_args.text_source(model_args))["train"]) == num_texts


@pytest.mark.parametrize("line_by_line", [True, False], ids=["lines", "blocks"])
def test_masked_lm_holds_out_the_first_examples_lines_or_blocks(line_by_line, recipe_dir, tmp_path):
    import run_mlm_flax

    recipe_tokenizer = AutoTokenizer.from_pretrained(recipe_dir, pad_token="<pad>")  # lines are padded with it

    lines = [f"Line {number} of a file of forty lines, each its own example.\n" for number in range(40)]
    (tmp_path / "lines.txt").write_text("".join(lines))
    model_args = run_mlm_flax.ModelArguments(cache_dir=str(tmp_path / "cache"), tokenizer_name="unused")
    data_args = run_mlm_flax.DataTrainingArguments(train_file=str(tmp_path / "lines.txt"), line_by_line=line_by_line)
    training_args = run_mlm_flax.TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True, do_eval=True)
    run_mlm_flax.check_arguments(model_args, data_args, training_args)
    texts_to_rows = run_mlm_flax.script_texts_to_rows(data_args, recipe_tokenizer, 16)
    route = data_args.data_route(model_args, training_args)
    examples = flax_lm.data.loading.load_data(route, texts_to_rows).rows
    if line_by_line:  # 2 of 40 lines, the first ones, each a row of 16 tokens: cut short, or padded
        assert (len(examples["validation"]), len(examples["train"])) == (2, 38)
        for row, line in ((examples["validation"][0], lines[0]), (examples["train"][0], lines[2])):
            tokens = recipe_tokenizer(line.rstrip("\n"), add_special_tokens=False)["input_ids"]
            np.testing.assert_array_equal(row, (tokens + [recipe_tokenizer.pad_token_id] * 16)[:16])
    else:  # one document, cut into blocks of 16 tokens: 5% of them held out, the first ones
        tokens = recipe_tokenizer("".join(lines), add_special_tokens=False)["input_ids"] + [2]
        blocks = np.array(tokens[: len(tokens) // 16 * 16]).reshape(-1, 16)
        held_out = len(blocks) * 5 // 100
        np.testing.assert_array_equal(np.asarray(examples["validation"]), blocks[:held_out])
        np.testing.assert_array_equal(np.asarray(examples["train"]), blocks[held_out:])
