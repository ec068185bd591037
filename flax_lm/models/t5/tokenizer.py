"""T5's tokenizers: a unigram model over words split at whitespace and marked with ▁ (SentencePiece's way, which
T5Tokenizer reads), <pad>, </s> and <unk> first (ids 0, 1, 2), the sentinels <extra_id_0>, <extra_id_1>, ... last,
<extra_id_0> the very last id, as T5's vocabulary has them; </s> ends every text encoded. train_tokenizer.py
--model_type t5 makes one; sentinel_token_ids is what a T5 script asks of the tokenizer it is given."""

import json
import re

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flax_lm.errors import UsageError

SENTINEL = "<extra_id_{}>"
SENTINEL_PATTERN = re.compile(r"<extra_id_(\d+)>")


def sentinel_tokens(count: int) -> list[str]:
    """<extra_id_0>, ..., <extra_id_{count - 1}>."""
    return [SENTINEL.format(index) for index in range(count)]


def new_unigram() -> Tokenizer:
    """An untrained unigram tokenizer that splits and marks words as T5Tokenizer does (so that the pieces trained are
    those it encodes with)."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tokenizer


def unigram_trainer(vocab_size: int, special_tokens: list, unk_token: str, show_progress: bool):
    """A trainer of `vocab_size` pieces, the special tokens first in their order."""
    return trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, unk_token=unk_token, show_progress=show_progress
    )


def t5_tokenizer(trained: Tokenizer, roles: dict, extra_special_tokens: list, sentinels: int, model_max_length: int):
    """T5Tokenizer (what AutoTokenizer loads the saved files as) of the pieces of `trained` (new_unigram's, trained)
    and `sentinels` sentinel tokens after them, <extra_id_0> last."""
    pieces = [tuple(piece) for piece in model_pieces(trained)]
    sentinel_pieces = [(token, 0.0) for token in reversed(sentinel_tokens(sentinels))]
    return transformers.T5Tokenizer(
        vocab=pieces + sentinel_pieces,
        eos_token=roles["eos_token"],
        unk_token=roles["unk_token"],
        pad_token=roles["pad_token"],
        extra_ids=sentinels,
        additional_special_tokens=[*extra_special_tokens, *sentinel_tokens(sentinels)],
        model_max_length=model_max_length,
    )


def model_pieces(tokenizer: Tokenizer) -> list:
    """The (piece, log probability) pairs of a unigram tokenizer, in the order of their ids."""
    return json.loads(tokenizer.to_str())["model"]["vocab"]


def sentinel_token_ids(tokenizer, source: str) -> list[int]:
    """The ids of the tokenizer's sentinels, <extra_id_0> first, which T5's span corruption puts in place of the spans
    it drops; refused in one line where it has none, or lacks padding or end-of-text tokens (`source`: where the
    tokenizer came from, for the message)."""
    vocabulary = tokenizer.get_vocab()
    ids = []
    while (token := SENTINEL.format(len(ids))) in vocabulary:
        ids.append(vocabulary[token])
    if not ids:
        raise UsageError(
            f"the tokenizer in {source} has no sentinel tokens (<extra_id_0>, <extra_id_1>, ...), which T5's span "
            "corruption puts in place of the spans it drops; train one with train_tokenizer.py --model_type t5"
        )
    for role in ("pad", "eos"):
        if getattr(tokenizer, f"{role}_token_id") is None:
            raise UsageError(
                f"the tokenizer in {source} has no {role}_token, which T5 needs; train one with train_tokenizer.py "
                "--model_type t5"
            )
    return ids
