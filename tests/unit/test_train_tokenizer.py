"""Behaviour of train_tokenizer.py: what it saves, what it reads, and how it refuses bad input."""

import importlib.util
import json
import subprocess
import sys

import datasets
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from tokenizers import trainers
from transformers import AutoTokenizer, T5Tokenizer

import flax_lm.data.texts
from flax_lm.data import text_stream
from flax_lm.errors import UsageError
from flax_lm.models.t5.tokenizer import sentinel_token_ids

CORPUS_DIR = FIXTURES_DIR / "corpus"

MULTILINGUAL_TEXTS = {
    "norwegian": "Blåbærsyltetøy og rømmegrøt på Ærøy; Ødegården ligger ved Åsen.",
    "turkish": "Işığı söndür, İğneada'ya gidiyoruz: çay, şeker ve üzüm aldık.",
    "korean": "한국어 문장도 손실 없이 복원되어야 합니다. 띄어쓰기와 문장부호까지!",
}


def load_train_tokenizer_module():
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO_DIR / "train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------------
# What is saved
# ---------------------------------------------------------------------------------------------------------------------


def test_gpt2_tokenizer_loads_as_fast_tokenizer_with_gpt2_special_tokens(gpt2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)

    assert tokenizer.is_fast
    assert type(tokenizer).__name__ == "GPT2Tokenizer"
    assert len(tokenizer) == 1000
    assert tokenizer.bos_token == tokenizer.eos_token == tokenizer.unk_token == "<|endoftext|>"
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.unk_token_id == 0
    assert tokenizer.pad_token is None
    assert tokenizer.model_max_length == 256


def test_gpt2_tokenizer_adds_no_special_tokens_and_keeps_end_of_text_whole(gpt2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)

    ids = tokenizer("The harbour was quiet.")["input_ids"]
    assert 0 not in ids
    assert tokenizer("one<|endoftext|>two")["input_ids"].count(0) == 1


def test_roberta_tokenizer_has_roberta_special_tokens_and_ids(roberta_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(roberta_tokenizer_dir)

    assert tokenizer.is_fast
    assert type(tokenizer).__name__ == "RobertaTokenizer"
    special_tokens = [tokenizer.bos_token, tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token]
    assert special_tokens + [tokenizer.mask_token] == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    assert tokenizer.bos_token_id == tokenizer.cls_token_id == 0
    assert tokenizer.pad_token_id == 1
    assert tokenizer.eos_token_id == tokenizer.sep_token_id == 2
    assert tokenizer.unk_token_id == 3
    assert tokenizer.mask_token_id == 4
    assert tokenizer.model_max_length == 256


def test_roberta_tokenizer_wraps_sentences_and_pairs_like_roberta(roberta_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(roberta_tokenizer_dir)
    first = tokenizer("hello", add_special_tokens=False)["input_ids"]
    second = tokenizer("world", add_special_tokens=False)["input_ids"]

    assert tokenizer("hello")["input_ids"] == [0, *first, 2]
    assert tokenizer("hello", "world")["input_ids"] == [0, *first, 2, 2, *second, 2]


def test_roberta_mask_token_takes_the_space_before_it(roberta_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(roberta_tokenizer_dir)

    tokens = tokenizer.tokenize("The cat sat on the <mask>.")
    assert "<mask>" in [token.strip() for token in tokens]
    assert "Ġ" not in tokens  # the space before <mask> is part of the mask, not a token of its own
    words = tokenizer("on the", add_special_tokens=False)["input_ids"]
    period = tokenizer(".", add_special_tokens=False)["input_ids"]
    assert tokenizer("on the <mask>.")["input_ids"] == [0, *words, 4, *period, 2]


@pytest.mark.parametrize("language", sorted(MULTILINGUAL_TEXTS))
@pytest.mark.parametrize("tokenizer_fixture", ["gpt2_tokenizer_dir", "roberta_tokenizer_dir"])
def test_text_in_any_script_decodes_to_exactly_the_input(language, tokenizer_fixture, request):
    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(tokenizer_fixture))
    text = MULTILINGUAL_TEXTS[language]

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_learns_words_of_the_corpus(gpt2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)

    # Frequent words of the English prose become single tokens; a made-up word does not.
    assert len(tokenizer.tokenize(" the")) == 1
    assert len(tokenizer.tokenize(" harbour")) == 1
    assert len(tokenizer.tokenize(" zqxjkvw")) > 1


# ---------------------------------------------------------------------------------------------------------------------
# What is read
# ---------------------------------------------------------------------------------------------------------------------


def test_text_is_streamed_in_batches_not_read_whole(tmp_path):
    train_tokenizer = load_train_tokenizer_module()
    with open(tmp_path / "rows.jsonl", "w", encoding="utf-8") as jsonl_file:
        for number in range(2500):
            jsonl_file.write(json.dumps({"text": f"row {number}"}) + "\n")
    sources = text_stream.open_text_sources(
        train_tokenizer.DataArguments(train_file=[str(tmp_path / "rows.jsonl")]).text_source()
    )
    counts = text_stream.ReadCounts()

    batches = list(text_stream.counted_text_batches(sources, counts))

    assert isinstance(sources[0][1], datasets.IterableDataset)
    assert [len(batch) for batch in batches] == [1000, 1000, 500]
    assert batches[2][-1] == "row 2499"
    assert counts.texts == 2500


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------------------


def test_derived_corpus_files_match_their_generator(tmp_path):
    subprocess.run([sys.executable, FIXTURES_DIR / "make_corpus.py", tmp_path], check=True)

    for relative_path in ["corpus/mixed.jsonl", "corpus/mixed.csv", "en/train.txt", "en/validation.txt"]:
        assert (tmp_path / relative_path).read_bytes() == (FIXTURES_DIR / relative_path).read_bytes(), relative_path
    assert len((FIXTURES_DIR / "en" / "train.txt").read_bytes()) >= 100_000


def test_a_text_of_one_long_line_is_read_in_pieces_that_train_the_same_tokenizer(tmp_path, monkeypatch):
    """Memory stays bounded on a text with no line breaks (a 51 MB one-line file took 5.4 GB read whole, 1.5 GB in
    pieces): it reaches the trainer in pieces cut where a word starts, which give the words of the whole text."""
    train_tokenizer = load_train_tokenizer_module()
    words = (CORPUS_DIR / "english.txt").read_text().split()
    (tmp_path / "one_line.txt").write_text(" ".join(words * 12))  # about 50,000 characters, no line break
    sources = text_stream.open_text_sources(
        train_tokenizer.DataArguments(train_file=[str(tmp_path / "one_line.txt")]).text_source()
    )

    def trained(piece_characters):
        monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", piece_characters)
        counts = text_stream.ReadCounts()
        batches = list(text_stream.counted_text_batches(sources, counts))
        tokenizer = train_tokenizer.new_byte_level_bpe()
        tokenizer.train_from_iterator(batches, trainer=trainers.BpeTrainer(vocab_size=400, show_progress=False))
        return batches, counts, json.loads(tokenizer.to_str())["model"]

    (whole,), whole_counts, whole_model = trained(10**9)
    (pieces,), piece_counts, piece_model = trained(2**12)
    assert len(whole) == 1 and len(pieces) > 10 and max(map(len, pieces)) < 2 * 2**12 + 100
    assert "".join(pieces) == whole[0] and piece_counts.texts == whole_counts.texts == 1
    assert piece_model["vocab"] == whole_model["vocab"] and piece_model["merges"] == whole_model["merges"]


def test_t5_tokenizer_has_t5_s_ids_sentinels_last_and_ends_each_text_with_eos(tmp_path, monkeypatch):
    train_tokenizer = load_train_tokenizer_module()
    arguments = ["--train_file", CORPUS_DIR / "english.txt", "--model_type", "t5", "--vocab_size", 600]
    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py", *map(str, arguments), "--output_dir", str(tmp_path)])
    train_tokenizer.main()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)

    assert type(tokenizer).__name__ == "T5Tokenizer" and tokenizer.model_max_length == 512
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    sentinels = sentinel_token_ids(tokenizer, str(tmp_path))
    assert sentinels == list(range(len(tokenizer) - 1, len(tokenizer) - 101, -1))  # <extra_id_0> the last id
    ids = tokenizer("The harbour <extra_id_3> quiet.")["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id and ids.count(sentinels[3]) == 1 and 2 not in ids
    with pytest.raises(UsageError, match="no sentinel tokens") as refusal:
        sentinel_token_ids(T5Tokenizer(extra_ids=0), "my-tokenizer")
    assert "my-tokenizer" in str(refusal.value) and "\n" not in str(refusal.value)
