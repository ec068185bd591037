#!/usr/bin/env python3
"""Train a byte-level BPE tokenizer for GPT-2, Llama or RoBERTa, or a unigram one for T5 (with its sentinel tokens),
on your own text.

The text comes from local files (.txt, .json/.jsonl, .csv, .parquet; the first three also compressed, such as
corpus.jsonl.gz; several files and glob patterns), from a
local dataset directory, or from a dataset on the Hugging Face Hub. It is streamed in batches, so a corpus larger
than memory works. The result is an ordinary tokenizer directory:

    python train_tokenizer.py --train_file "data/*.txt" --model_type gpt2 --vocab_size 32000 --output_dir my-model

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained("my-model")

A single .json file holding the arguments works as well: `python train_tokenizer.py args.json`.
"""

import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import flax_lm  # noqa: F401  first: where PyTorch is missing, it keeps transformers from warning about it on import

# isort: split

import datasets
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flax_lm.command_line.tool_arguments import parse_arguments
from flax_lm.data.chat import CHAT_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE
from flax_lm.data.source import TextSource
from flax_lm.data.text_stream import ReadCounts, counted_text_batches, open_text_sources
from flax_lm.devices.processes import LOG_FORMAT
from flax_lm.errors import UsageError, call_with_one_line_errors, check_writable_directory
from flax_lm.models import tokenizer_conventions
from flax_lm.models.family import TokenizerConventions
from flax_lm.models.t5.tokenizer import new_unigram, t5_tokenizer, unigram_trainer
from flax_lm.models.tokenizer_files import save_tokenizer_files

logger = logging.getLogger(__name__)

# The --model_type values and the special tokens, default length and tokenizer class of each: the tokenizer
# conventions of the model families (flax_lm/models/NAME/__init__.py, where they are written).
CONVENTIONS = tokenizer_conventions()
# The longest input of each when --model_max_length is left out, e.g. "1024 (gpt2), 2048 (llama) or 512 (roberta)".
DEFAULT_LENGTHS = " or ".join(
    ", ".join(f"{rules.model_max_length} ({name})" for name, rules in CONVENTIONS.items()).rsplit(", ", 1)
)
SPECIAL_TOKEN_ROLES = ["bos_token", "pad_token", "eos_token", "unk_token", "mask_token"]

# Every byte is in the initial alphabet, so any text can be encoded without an unknown token.
BYTE_ALPHABET_SIZE = len(pre_tokenizers.ByteLevel.alphabet())

# Files the tokenizer writes, plus files older tokenizer formats wrote; replaced or removed with --overwrite.
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
]


@dataclass
class DataArguments:
    """Where the text comes from."""

    train_file: list[str] | None = field(
        default=None,
        metadata={
            "help": "Text files (.txt, .json/.jsonl, .csv, .parquet), separated by spaces or each after its own "
            "--train_file. Quoted glob patterns such as 'data/*.jsonl' are expanded; '**' matches subdirectories.",
            "action": "extend",
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A dataset on the Hugging Face Hub (needs network), or a local directory: one written by "
            "`save_to_disk`, or one holding data files."
        },
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "The configuration of --dataset_name, if it has several."}
    )
    dataset_split: str = field(default="train", metadata={"help": "The split of --dataset_name to read."})
    text_column_name: str = field(
        default="text",
        metadata={"help": "The column (JSON field) that holds the text. Text files always use their lines."},
    )
    keep_linebreaks: bool = field(
        default=False, metadata={"help": "Keep the line break at the end of each line of .txt files."}
    )
    skip_missing_texts: bool = field(
        default=False,
        metadata={
            "help": "Leave out rows whose text is missing or null (counted in the log) instead of stopping there."
        },
    )
    max_texts: int | None = field(
        default=None, metadata={"help": "Stop reading after this many texts (rows or lines); leave out to read all."}
    )
    max_characters: int | None = field(
        default=None, metadata={"help": "Stop reading after this many characters; leave out to read all."}
    )

    def text_source(self) -> TextSource:
        """Where the texts are and how they are read, as flax_lm.data.text_stream takes it: .txt files by line."""
        names = ("train_file", "dataset_name", "dataset_config_name", "text_column_name", "keep_linebreaks")
        names += ("skip_missing_texts",)
        return TextSource(**{name: getattr(self, name) for name in names}, text_sample_by="line")


@dataclass
class TokenizerArguments:
    """What to train and where to save it."""

    output_dir: str = field(
        default="tokenizer",
        metadata={"help": "Directory to save the tokenizer in. Other files already there (config.json) are kept."},
    )
    model_type: str = field(
        default="gpt2",
        metadata={
            "help": "Special tokens preset: the tokens and ids the model type expects.",
            "choices": list(CONVENTIONS),
        },
    )
    vocab_size: int = field(
        default=32000,
        metadata={
            "help": f"Size of the vocabulary, special tokens included: {BYTE_ALPHABET_SIZE} + specials or more."
        },
    )
    min_frequency: int = field(default=2, metadata={"help": "Only merge pairs that occur at least this often."})
    model_max_length: int | None = field(
        default=None,
        metadata={"help": f"Longest input the model takes, in tokens; leave out for {DEFAULT_LENGTHS}."},
    )
    bos_token: str | None = field(default=None, metadata={"help": "Replace the preset's beginning-of-text token."})
    eos_token: str | None = field(default=None, metadata={"help": "Replace the preset's end-of-text token."})
    unk_token: str | None = field(default=None, metadata={"help": "Replace the preset's unknown token."})
    pad_token: str | None = field(
        default=None, metadata={"help": "Replace the preset's padding token, or give gpt2 one."}
    )
    mask_token: str | None = field(
        default=None, metadata={"help": "Replace the preset's mask token, or give gpt2 one."}
    )
    extra_special_tokens: list[str] | None = field(
        default=None, metadata={"help": "More special tokens, never split, with ids after the preset's."}
    )
    chat_template: bool = field(
        default=False,
        metadata={
            "help": "Give the tokenizer a chat template (ChatML's <|im_start|>ROLE ... <|im_end|>, its two special "
            "tokens added after the others), so that run_clm_flax.py trains on conversations (with the assistant's "
            "turns marked for the loss) and transformers, Jinja2 and minijinja engines render them (gpt2, llama)."
        },
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a tokenizer already saved in --output_dir."})


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


def special_tokens_by_role(tokenizer_args):
    """The preset's special tokens with the user's replacements, e.g. {"bos_token": "<s>", ...}."""
    roles = dict(CONVENTIONS[tokenizer_args.model_type].special_tokens)
    for role in SPECIAL_TOKEN_ROLES:
        replacement = getattr(tokenizer_args, role)
        if replacement is not None:
            if not replacement:
                raise UsageError(f"--{role} must not be empty")
            roles[role] = replacement
    return {role: roles[role] for role in SPECIAL_TOKEN_ROLES if role in roles}


def check_distinct_roles(roles: dict[str, str], model_type: str):
    """Refuse a token given two roles where a model reads one of them from the id alone (the distinct_roles of its
    tokenizer conventions): the masked LM predicts where it finds the mask's id, and RoBERTa numbers positions and
    attends from the padding id. The beginning, end and unknown tokens may share one (GPT-2's <|endoftext|> is all
    three); RoBERTa's classifier token is its beginning one."""
    for role in CONVENTIONS[model_type].distinct_roles:
        shared = [other for other, token in roles.items() if other != role and token == roles.get(role)]
        if shared:
            raise UsageError(
                f"--{role} {roles[role]!r} is the {shared[0].removesuffix('_token')} token too, one id for both, so "
                f"the model would take every {shared[0].removesuffix('_token')} token for a "
                f"{role.removesuffix('_token')} token; give --{role} a token of its own"
            )


def check_output_dir(output_dir, overwrite):
    existing = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(output_dir, name))]
    if existing and not overwrite:
        raise UsageError(
            f"--output_dir {output_dir} already holds a tokenizer ({existing[0]}); pass --overwrite to replace it "
            "or choose another directory"
        )
    check_writable_directory(output_dir, "output_dir")


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def special_token(token, takes_space_before=False):
    """Special tokens are never split or normalized. The mask token also takes the space before it, as in RoBERTa:
    in "the <mask> sat" it stands for " cat", the word with its leading space, as the tokenizer would encode it."""
    return AddedToken(token, special=True, normalized=False, lstrip=takes_space_before)


def new_byte_level_bpe():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def wrap_for_transformers(tokenizer, model_type, roles, extra_special_tokens, model_max_length):
    """The `transformers` tokenizer class of the model type (its tokenizer conventions), around the trained
    `tokenizers` object.

    Saved, it loads with AutoTokenizer.from_pretrained as GPT2Tokenizer or RobertaTokenizer, the fast tokenizer
    classes of transformers 5, or for Llama as the plain fast tokenizer, as Llama 3's does (transformers'
    LlamaTokenizer is the SentencePiece-style one of Llama 2).
    """
    tokens = {role: special_token(token, takes_space_before=role == "mask_token") for role, token in roles.items()}
    options = dict(
        tokenizer_object=tokenizer,
        model_max_length=model_max_length,
        extra_special_tokens=[special_token(token) for token in extra_special_tokens],
        **tokens,
    )
    conventions = CONVENTIONS[model_type]
    if conventions.sentinel_tokens:
        return t5_tokenizer(tokenizer, roles, extra_special_tokens, conventions.sentinel_tokens, model_max_length)
    tokenizer_class = conventions.tokenizer_class
    if tokenizer_class == "RobertaTokenizer":
        # RoBERTa starts a sequence with its classifier token and ends it with the separator: <s> A </s></s> B </s>.
        options.update(cls_token=tokens["bos_token"], sep_token=tokens["eos_token"])
    return getattr(transformers, tokenizer_class)(**options)


def save_tokenizer(fast_tokenizer, output_dir):
    """Save into a temporary directory beside output_dir, then move the files in: an interrupted run leaves the
    directory as it was."""
    output_dir = os.path.abspath(output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    staging_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-", dir=parent)
    try:
        save_tokenizer_files(fast_tokenizer, staging_dir)
        os.makedirs(output_dir, exist_ok=True)
        written = sorted(os.listdir(staging_dir))
        for name in written:
            os.replace(os.path.join(staging_dir, name), os.path.join(output_dir, name))
        for name in TOKENIZER_FILES:
            stale = os.path.join(output_dir, name)
            if name not in written and os.path.exists(stale):
                os.remove(stale)
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    return written


def sample_sentence(text, max_characters=80):
    """The start of a text, cut at a word boundary: something short to show the tokenizer on."""
    text = " ".join(text.split())
    if len(text) <= max_characters:
        return text
    cut = text.rfind(" ", 0, max_characters)
    return text[: cut if cut > 0 else max_characters]


def set_up_logging():
    # The summary and the log both go to stdout, so that stderr holds only the error line of a mistake.
    logging.basicConfig(format=LOG_FORMAT, handlers=[logging.StreamHandler(sys.stdout)], level=logging.INFO)
    datasets.logging.set_verbosity_error()
    # The file readers log an error right before raising it; the raised error is reported instead.
    datasets.logging.disable_propagation()
    for reader in ["json", "csv", "parquet", "text"]:
        logging.getLogger(f"datasets.packaged_modules.{reader}.{reader}").setLevel(logging.CRITICAL)


@dataclass
class SpecialTokens:
    """The special tokens the arguments ask for: by role (bos_token, eos_token, ...), the extra ones, and all of them
    in order, each once."""

    roles: dict[str, str]
    extra: list[str]
    all: list[str]


def check_arguments(data_args, tokenizer_args) -> tuple[SpecialTokens, int]:
    """Refuse arguments that cannot make a tokenizer, before anything is read; the special tokens and the
    model_max_length they give."""
    roles = special_tokens_by_role(tokenizer_args)
    extra_special_tokens = tokenizer_args.extra_special_tokens or []
    if "" in extra_special_tokens:
        raise UsageError("--extra_special_tokens holds an empty token, which no text can contain; leave it out")
    check_distinct_roles(roles, tokenizer_args.model_type)
    if tokenizer_args.chat_template:
        if not CONVENTIONS[tokenizer_args.model_type].converses:
            conversing = ", ".join(name for name, rules in CONVENTIONS.items() if rules.converses)
            raise UsageError(
                f"--chat_template is for the causal LMs that converse ({conversing}), not {tokenizer_args.model_type}"
            )
        extra_special_tokens = list(dict.fromkeys(extra_special_tokens + CHAT_SPECIAL_TOKENS))
    special_tokens = list(dict.fromkeys(list(roles.values()) + extra_special_tokens))
    sentinels = CONVENTIONS[tokenizer_args.model_type].sentinel_tokens
    # A byte-level BPE holds every byte; T5's unigram model at least a piece of its own, beside its sentinels.
    pieces = f"{sentinels} sentinels + 1 piece" if sentinels else f"{BYTE_ALPHABET_SIZE} byte tokens"
    minimum_vocab_size = (sentinels + 1 if sentinels else BYTE_ALPHABET_SIZE) + len(special_tokens)
    if tokenizer_args.vocab_size < minimum_vocab_size:
        raise UsageError(
            f"--vocab_size {tokenizer_args.vocab_size} is too small: it must be at least {minimum_vocab_size} "
            f"({pieces} + {len(special_tokens)} special token{'' if len(special_tokens) == 1 else 's'})"
        )
    if tokenizer_args.min_frequency < 0:
        raise UsageError(f"--min_frequency must be 0 or more, not {tokenizer_args.min_frequency}")
    for flag in ["max_texts", "max_characters"]:
        limit = getattr(data_args, flag)
        if limit is not None and limit < 1:
            raise UsageError(f"--{flag} must be 1 or more, not {limit}; leave it out to read everything")
    model_max_length = tokenizer_args.model_max_length
    if model_max_length is None:
        model_max_length = CONVENTIONS[tokenizer_args.model_type].model_max_length
    if model_max_length < 1:
        raise UsageError(f"--model_max_length must be 1 or more, not {model_max_length}")
    check_output_dir(tokenizer_args.output_dir, tokenizer_args.overwrite)
    return SpecialTokens(roles, extra_special_tokens, special_tokens), model_max_length


def expected_text_count(sources, data_args) -> int | None:
    """How many texts the sources hold, for the progress bar: None where a stream's count is unknown."""
    known_rows = [rows for _, _, _, rows in sources]
    expected_texts = sum(known_rows) if None not in known_rows else None
    if data_args.max_texts is not None:
        expected_texts = min(expected_texts or data_args.max_texts, data_args.max_texts)
    return expected_texts


def train_tokenizer(sources, data_args, tokenizer_args, special: SpecialTokens) -> tuple[Tokenizer, ReadCounts]:
    """A byte-level BPE trained on the texts of `sources`, with the post-processor of --model_type; and the counts of
    what it read. Refuses sources without text before anything is saved, so a tokenizer in --output_dir stays."""
    sentinels = CONVENTIONS[tokenizer_args.model_type].sentinel_tokens
    if sentinels:  # T5's: unigram pieces, the sentinels added after them
        tokenizer = new_unigram()
        trainer = unigram_trainer(
            tokenizer_args.vocab_size - sentinels, special.all, special.roles["unk_token"], sys.stderr.isatty()
        )
    else:
        tokenizer = new_byte_level_bpe()
        trainer = trainers.BpeTrainer(
            vocab_size=tokenizer_args.vocab_size,
            min_frequency=tokenizer_args.min_frequency,
            special_tokens=[
                special_token(token, takes_space_before=token == special.roles.get("mask_token"))
                for token in special.all
            ],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=sys.stderr.isatty(),  # the bars are drawn on a terminal only
        )
    counts = ReadCounts()
    start_time = time.perf_counter()
    # The trainer's progress bar counts the texts as they are read, then shows the merges.
    tokenizer.train_from_iterator(
        counted_text_batches(
            sources, counts, data_args.max_texts, data_args.max_characters, data_args.skip_missing_texts
        ),
        trainer=trainer,
        length=expected_text_count(sources, data_args),
    )
    seconds = max(time.perf_counter() - start_time, 1e-6)
    where = ", ".join(description for description, _, _, _ in sources)
    if counts.texts == 0:
        raise UsageError(f"no text found in {where}; check the files and --text_column_name")
    if counts.first_text is None:
        raise UsageError(f"{where} holds only whitespace, nothing to learn tokens from; check the files")
    if counts.missing_texts:
        logger.warning("Left out %d rows of %s without text (--skip_missing_texts)", counts.missing_texts, where)
    logger.info(
        "Trained on %d texts (%d characters, %.2f MB) in %.1f s (%.2f MB/s)",
        counts.texts,
        counts.characters,
        counts.bytes / 1e6,
        seconds,
        counts.bytes / 1e6 / seconds,
    )
    if tokenizer.get_vocab_size() + sentinels < tokenizer_args.vocab_size:
        logger.warning(
            "The corpus only supports %d tokens, fewer than --vocab_size %d: %s.",
            tokenizer.get_vocab_size() + sentinels,
            tokenizer_args.vocab_size,
            "the unigram trainer found no more pieces"
            if sentinels
            else "every pair seen at least --min_frequency times has been merged",
        )
    add_post_processor(tokenizer, CONVENTIONS[tokenizer_args.model_type], special.roles)
    return tokenizer, counts


def add_post_processor(tokenizer: Tokenizer, conventions: TokenizerConventions, roles: dict[str, str]):
    """What the tokenizer adds around each text it encodes, as its conventions say."""
    if conventions.tokenizer_class == "RobertaTokenizer":
        tokenizer.post_processor = processors.RobertaProcessing(
            (roles["eos_token"], tokenizer.token_to_id(roles["eos_token"])),
            (roles["bos_token"], tokenizer.token_to_id(roles["bos_token"])),
            trim_offsets=True,
            add_prefix_space=False,
        )
    elif conventions.bos_before_each_text:
        # BOS before each text, as Llama's tokenizers put it: <|begin_of_text|> A, and before each of a pair.
        bos = roles["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )


def show_tokenizer(fast_tokenizer, first_text: str, special: SpecialTokens, tokenizer_args, model_max_length: int):
    """Print where the tokenizer went, its size and special tokens, and how it splits a sentence of the data."""
    sample = sample_sentence(first_text)
    encoding = fast_tokenizer(sample)
    special_ids = ", ".join(f"{token}={fast_tokenizer.convert_tokens_to_ids(token)}" for token in special.all)
    print(f"Saved the tokenizer to {os.path.abspath(tokenizer_args.output_dir)}")
    print(f"vocab size: {len(fast_tokenizer)} (special tokens: {special_ids}), model_max_length: {model_max_length}")
    print(f"sample: {sample!r}")
    print(f"tokens: {fast_tokenizer.convert_ids_to_tokens(encoding['input_ids'])}")
    print(f"ids: {encoding['input_ids']}")
    if tokenizer_args.chat_template:
        conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        print(f"chat template (ChatML): {fast_tokenizer.apply_chat_template(conversation, tokenize=False)!r}")


def main():
    # Arguments ------------------------------------------------------------------------------------------------------
    data_args, tokenizer_args = parse_arguments((DataArguments, TokenizerArguments))
    set_up_logging()
    special, model_max_length = check_arguments(data_args, tokenizer_args)

    # Data -----------------------------------------------------------------------------------------------------------
    sources = open_text_sources(data_args.text_source(), data_args.dataset_split)
    logger.info("Reading text from %s", ", ".join(description for description, _, _, _ in sources))

    # Training -------------------------------------------------------------------------------------------------------
    tokenizer, counts = train_tokenizer(sources, data_args, tokenizer_args, special)

    # Save -----------------------------------------------------------------------------------------------------------
    fast_tokenizer = wrap_for_transformers(
        tokenizer, tokenizer_args.model_type, special.roles, special.extra, model_max_length
    )
    if tokenizer_args.chat_template:
        fast_tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    written = save_tokenizer(fast_tokenizer, tokenizer_args.output_dir)
    logger.info("Wrote %s", ", ".join(written))
    show_tokenizer(fast_tokenizer, counts.first_text, special, tokenizer_args, model_max_length)


if __name__ == "__main__":
    call_with_one_line_errors(main)
