"""Training on examples rather than plain text: prompt/completion pairs and conversations, in the dataset formats of
Hugging Face TRL, told apart by the columns of the data:

    {"prompt": "The sky is", "completion": " blue."}                                  prompt/completion examples
    {"prompt": [{"role": "user", "content": "..."}],
     "completion": [{"role": "assistant", "content": "..."}]}                         prompt/completion conversations
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}     conversations

Data with the text column (--text_column_name) are plain text, trained on as before, unless --prompt_column or
--completion_column is given. Each example is encoded into its token ids, a prompt and its completion framed as a
document of plain text is (flax_lm.data.texts.ids_around_documents: a Llama tokenizer's BOS before it, the end-of-text
token after it), a conversation as the chat template renders it followed by the end-of-text token, with two masks:
the tokens of the completion, and those the assistant wrote (from the chat template's {% generation %} markers).
run_clm_flax.py's example_rows turns them into rows of token ids and loss weights. Rows that cannot be examples are
refused in one line naming the file and row; examples with nothing to learn from (an empty completion, a conversation
without an assistant turn) are left out and counted.
"""

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np

from flax_lm.data import chat
from flax_lm.data.chat import (
    chat_template_of,
    conversation_problem,
    fields_not_rendered,
    marks_assistant_tokens,
    render_conversation,
)
from flax_lm.data.source import ExampleSettings, TextSource
from flax_lm.data.texts import (
    DATA_READ_ERRORS,
    column_batches,
    columns_of,
    ids_around_documents,
    map_in_workers,
    text_source,
    unreadable_data_error,
)
from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)

PROMPT_COMPLETION = "prompt_completion"
CONVERSATIONAL_PROMPT_COMPLETION = "conversational_prompt_completion"
CONVERSATIONS = "conversations"
FORMAT_NAMES = {
    PROMPT_COMPLETION: "prompt/completion examples",
    CONVERSATIONAL_PROMPT_COMPLETION: "prompt/completion conversations",
    CONVERSATIONS: "conversations",
}
MESSAGES_COLUMN = "messages"  # TRL's name for a conversation
TOOLS_COLUMN = "tools"  # TRL's name for the tools a conversation may call

# The code that encodes examples, fingerprinted into their rows' framing: the token cache and --packed_data_dir are
# keyed by it as they are by the script's code.
ENCODING_FINGERPRINT = hashlib.sha256(Path(__file__).read_bytes() + Path(chat.__file__).read_bytes()).hexdigest()[:12]


@dataclass
class ExampleArguments:
    """The arguments of training on examples (run_clm_flax.py mixes them into its data arguments)."""

    prompt_column: str | None = field(
        default=None,
        metadata={
            "help": "The column of the prompts of prompt/completion data (default: prompt; JaxSeq's data: in_text). "
            "Given, the data are read as prompt/completion examples even where they have a text column."
        },
    )
    completion_column: str | None = field(
        default=None,
        metadata={"help": "The column of the completions of prompt/completion data (default: completion)."},
    )
    completion_only_loss: bool = field(
        default=True,
        metadata={
            "help": "For prompt/completion data: the loss covers the completion (and the end-of-text token after it) "
            "only; false trains on the prompt too."
        },
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={
            "help": "For conversations: the loss covers the assistant's turns only (the tokens the chat template "
            "marks with {%% generation %%}); false trains on every token of the conversation."
        },
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack several examples into each row of --block_size tokens, each its own document (a token "
            "attends only to its example, positions restart), instead of one example per row, padded: fewer rows for "
            "short examples. Not for plain text, which is always packed (see --document_attention)."
        },
    )

    def example_settings(self) -> ExampleSettings:
        """These flags as the data layer takes them."""
        return ExampleSettings(
            self.prompt_column,
            self.completion_column,
            self.completion_only_loss,
            self.assistant_only_loss,
            self.packing,
        )


def is_chat(example_format: str | None) -> bool:
    """Whether data of `example_format` are conversations (rendered by the chat template)."""
    return example_format in (CONVERSATIONS, CONVERSATIONAL_PROMPT_COMPLETION)


def data_format(texts: dict, source: TextSource, streaming_alone: bool) -> str | None:
    """The format of the data just read ({split: dataset or stream}), told apart by their columns where `source`
    reads examples (None for plain text); refuses splits of different formats, or options that do not apply.
    `streaming_alone`: the data are read as a stream to be tokenized while training (--streaming alone)."""
    if source.examples is None:
        return None
    formats = {}
    for split, dataset in texts.items():
        try:  # a stream's first rows are read here
            formats[split] = format_of(dataset, split, source)
        except DATA_READ_ERRORS as error:
            raise unreadable_data_error(error, split, source) from None
    if len(set(formats.values())) > 1:
        described = " but ".join(
            f"the {split} data are {FORMAT_NAMES.get(kind, 'plain text')}" for split, kind in formats.items()
        )
        raise UsageError(f"{described}; give every split in one format")
    found = next(iter(formats.values()), None)
    if found is None and source.examples.packing:
        raise UsageError(
            "--packing packs prompt/completion examples and conversations, and the data are plain text, which is "
            "always packed into blocks (--document_attention keeps its documents apart); drop --packing"
        )
    if found is not None and streaming_alone:
        raise UsageError(
            f"the data are {FORMAT_NAMES[found]}, which --streaming alone does not read; add "
            "--packed_data_dir to pack the stream's examples once and train on them"
        )
    if found is not None:
        logger.info("The data are %s", example_framing(found, source.examples))
    return found


def recorded_example_format(recorded: str, settings: ExampleSettings | None) -> str | None:
    """The format of the examples whose rows a packed corpus records as made with the framing `recorded` (None: plain
    text), for a corpus used without reading its data; refuses --packing for plain text."""
    if settings is None:
        return None
    found = next((kind for kind, name in FORMAT_NAMES.items() if recorded.startswith(f"{name} (")), None)
    if found is None and settings.packing:
        raise UsageError(
            "--packing packs prompt/completion examples and conversations, and --packed_data_dir holds plain "
            "text, which is always packed into blocks; drop --packing"
        )
    return found


def example_framing(example_format: str | None, settings: ExampleSettings) -> str:
    """The framing of the rows of `example_format` data (None: plain text) made with these settings."""
    if example_format is None:
        return "grouped"
    parts = []
    if example_format != CONVERSATIONS:
        parts.append(f"columns {settings.prompt_column or 'prompt'}, {settings.completion_column or 'completion'}")
    on_completions = example_format != CONVERSATIONS and settings.completion_only_loss
    on_assistant = example_format != PROMPT_COMPLETION and settings.assistant_only_loss
    covered = {
        (True, True): "the completions' assistant tokens",
        (True, False): "the completions",
        (False, True): "the assistant's turns",
        (False, False): "every token",
    }[on_completions, on_assistant]
    parts.append(f"loss on {covered}")
    parts.append("packed, each its own document" if settings.packing else "one per row")
    return f"{FORMAT_NAMES[example_format]} ({'; '.join(parts)}; encoding {ENCODING_FINGERPRINT})"


def first_value(dataset, column: str):
    """The value of `column` in the first row of a dataset or stream (None for no rows)."""
    if isinstance(dataset, datasets.Dataset):
        return dataset[0][column] if len(dataset) else None
    return next(iter(dataset), {}).get(column)


def format_of(dataset, split: str, source: TextSource) -> str | None:
    """The example format of one split's data, from its columns (None: plain text)."""
    columns, settings = columns_of(dataset), source.examples
    prompt, completion = settings.prompt_column or "prompt", settings.completion_column or "completion"
    chosen = settings.prompt_column is not None or settings.completion_column is not None
    if not chosen and source.text_column_name in columns:
        return None
    if prompt in columns and completion in columns and MESSAGES_COLUMN in columns:
        # JSON Lines rows of both kinds read as one table: each row lacks the other kind's columns.
        raise UsageError(
            f"the {split} data mixes prompt/completion examples ('{prompt}', '{completion}') with conversations "
            f"('{MESSAGES_COLUMN}'); give each kind in a file of its own and train on one at a time, or write the "
            f"examples as conversations ('{MESSAGES_COLUMN}': a user turn, then an assistant turn)"
        )
    if prompt in columns and completion in columns:
        is_conversation = isinstance(first_value(dataset, prompt), list)
        return CONVERSATIONAL_PROMPT_COMPLETION if is_conversation else PROMPT_COMPLETION
    has = ", ".join(columns)
    if chosen:
        missing = prompt if prompt not in columns else completion
        raise UsageError(
            f"the {split} data has no column '{missing}' (it has: {has}); pass the columns of its prompts and "
            "completions with --prompt_column and --completion_column"
        )
    if MESSAGES_COLUMN in columns:
        if TOOLS_COLUMN in columns:
            # TRL hands a row's tools to the chat template; read as a conversation alone, they would be dropped.
            raise UsageError(
                f"the {split} data has a '{TOOLS_COLUMN}' column of tool definitions, which training does not hand "
                "to the chat template, so the model would learn tool calls without the tools; remove the column, "
                "or write the tools into the conversation (a system message)"
            )
        return CONVERSATIONS
    raise UsageError(
        f"the {split} data has no column '{source.text_column_name}' of plain text, no 'prompt' and 'completion' "
        f"and no '{MESSAGES_COLUMN}' of conversations (it has: {has}); pass --text_column_name, or "
        "--prompt_column and --completion_column"
    )


# ----------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One example: its token ids, framed as a document is (int32), and for each token whether it is part of the
    completion (prompt/completion formats, the end-of-text token after it included; None for conversations) and
    whether the assistant wrote it (conversations, from the chat template's generation markers; None where not asked
    for). `row`: the row of the data it came from, counted from 1."""

    ids: np.ndarray
    completion: np.ndarray | None
    assistant: np.ndarray | None
    row: int


@dataclass(frozen=True)
class LeftOut:
    """A row that makes no example, and why, in words that follow "examples": e.g. "with an empty completion"."""

    reason: str
    row: int


def framed(ids: list[int], masks: list[list[bool] | None], around: tuple[list[int], list[int]], in_after: list[bool]):
    """`ids` between the ids `around` them (before, after), each side left out where the ids already have it, with
    each mask extended over them: False before, and after as `in_after` (one value per mask) says."""
    before, after = around
    before = [] if ids[: len(before)] == before else before
    after = [] if after and ids[-len(after) :] == after else after
    framed_ids = np.asarray(before + list(ids) + after, np.int32)
    framed_masks = [
        None if mask is None else np.asarray([False] * len(before) + list(map(bool, mask)) + [tail] * len(after))
        for mask, tail in zip(masks, in_after)
    ]
    return framed_ids, framed_masks


@dataclass(frozen=True)
class ExampleEncoder:
    """Encodes the rows of one split (values of `columns`, a batch at a time), in this process or in workers."""

    tokenizer: object
    example_format: str
    columns: tuple[str, ...]
    around: tuple[list[int], list[int]]
    assistant_mask: bool  # whether to ask the chat template which tokens the assistant wrote
    skip_missing: bool
    where: str  # the data's source, for the messages

    def encode_batch(self, numbered_batch: tuple[int, list[tuple]]) -> list[Example | LeftOut]:
        first_row, rows = numbered_batch
        return [self.encode(values, row) for row, values in enumerate(rows, first_row)]

    def refuse(self, row: int, problem: str) -> UsageError:
        return UsageError(f"row {row} of {self.where} {problem}")

    def encode(self, values: tuple, row: int) -> Example | LeftOut:
        for column, value in zip(self.columns, values):
            if value is None:
                if self.skip_missing:
                    return LeftOut(f"without a '{column}'", row)
                raise self.refuse(
                    row,
                    f"has no '{column}' (it is missing or null); fix the data, or pass --skip_missing_texts to leave "
                    "such rows out",
                )
        if self.example_format == PROMPT_COMPLETION:
            return self.prompt_completion(*values, row)
        if self.example_format == CONVERSATIONAL_PROMPT_COMPLETION:
            return self.conversational_prompt_completion(*values, row)
        return self.conversation(values[0], row)

    @property
    def after_conversations(self) -> tuple[list[int], list[int]]:
        """A conversation is framed as the chat template renders it, which is what the model is given when it
        replies (a template without the beginning-of-text token gets none), followed by the end-of-text token."""
        return [], self.around[1]

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_completion(self, prompt, completion, row: int) -> Example | LeftOut:
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise self.refuse(
                row,
                f"has a {type(prompt).__name__} prompt and a {type(completion).__name__} completion; give both as "
                "text, as the first row does",
            )
        if not completion:
            return LeftOut("with an empty completion", row)
        # Each encoded alone, as a prompt is when the model continues it.
        prompt_ids, completion_ids = self.text_ids(prompt), self.text_ids(completion)
        in_completion = [False] * len(prompt_ids) + [True] * len(completion_ids)
        ids, (completion_mask,) = framed(prompt_ids + completion_ids, [in_completion], self.around, [True])
        return Example(ids, completion_mask, None, row)

    def rendered(self, messages: list, row: int, add_generation_prompt: bool = False, assistant_mask: bool = False):
        if dropped := fields_not_rendered(self.tokenizer, messages):
            raise self.refuse(
                row,
                f"has a conversation whose {dropped}, which the chat template does not render, so training would "
                "drop it without a word; remove it, or train with a template that renders it (--chat_template_path)",
            )
        try:
            return render_conversation(self.tokenizer, messages, add_generation_prompt, assistant_mask)
        except ValueError as error:
            raise self.refuse(row, f"has a conversation that {error}") from None

    def conversational_prompt_completion(self, prompt, completion, row: int) -> Example | LeftOut:
        if isinstance(completion, list) and not any(
            isinstance(message, dict) and message.get("content") for message in completion
        ):
            return LeftOut("with an empty completion", row)
        for part, messages in (("prompt", prompt), ("completion", completion)):
            if problem := conversation_problem(messages):
                raise self.refuse(
                    row, f"has a {part} that {problem}; give both as conversations, as the first row does"
                )
        prompt_ids = self.rendered(prompt, row, add_generation_prompt=True)["input_ids"]
        whole = self.rendered(prompt + completion, row, assistant_mask=self.assistant_mask)
        if whole["input_ids"][: len(prompt_ids)] != prompt_ids:
            raise self.refuse(
                row,
                "is rendered by the chat template with its prompt's tokens (and the generation prompt) not at the "
                "start of the whole conversation's, so the completion's tokens cannot be told apart; fix the template",
            )
        in_completion = [position >= len(prompt_ids) for position in range(len(whole["input_ids"]))]
        masks = [in_completion, whole.get("assistant_masks")]
        ids, (completion_mask, assistant) = framed(whole["input_ids"], masks, self.after_conversations, [True, False])
        return Example(ids, completion_mask, assistant, row)

    def conversation(self, messages, row: int) -> Example | LeftOut:
        if problem := conversation_problem(messages):
            raise self.refuse(row, f"has a conversation that {problem}")
        if self.assistant_mask and not any(message["role"] == "assistant" for message in messages):
            return LeftOut("without an assistant turn", row)
        rendered = self.rendered(messages, row, assistant_mask=self.assistant_mask)
        masks = [rendered.get("assistant_masks")]
        ids, (assistant,) = framed(rendered["input_ids"], masks, self.after_conversations, [False])
        return Example(ids, None, assistant, row)


def numbered_batches(dataset, columns: tuple[str, ...], split: str):
    """(the row number of its first row, counted from 1; its rows as tuples of the columns' values), a batch of
    TEXTS_PER_BATCH rows at a time."""
    first_row = 1
    for batch in column_batches(dataset, columns, split):
        rows = list(zip(*(batch[column] for column in columns)))
        yield first_row, rows
        first_row += len(rows)


def assistant_mask_wanted(tokenizer, example_format: str, settings: ExampleSettings, split: str) -> bool:
    """Whether the chat template is asked which tokens the assistant wrote: for --assistant_only_loss, where the
    template marks them. Refuses conversations without a chat template, and --assistant_only_loss where it is the only
    way to tell the tokens trained on and the template cannot."""
    if example_format == PROMPT_COMPLETION:
        return False
    name = tokenizer.name_or_path
    template = chat_template_of(tokenizer)
    if template is None:
        raise UsageError(
            f"the {split} data are {FORMAT_NAMES[example_format]}, and the tokenizer {name} has no chat template to "
            "render them with; give it one (train_tokenizer.py --chat_template writes ChatML's into a new tokenizer), "
            "or give the data as plain prompt/completion text"
        )
    if not settings.assistant_only_loss:
        return False
    if marks_assistant_tokens(template):
        return True
    if example_format == CONVERSATIONAL_PROMPT_COMPLETION and settings.completion_only_loss:
        logger.info("The chat template does not mark the assistant's tokens: the loss covers the completions")
        return False
    raise UsageError(
        f"the chat template of {name} does not mark the assistant's tokens with {{% generation %}}, so "
        "--assistant_only_loss cannot tell them apart; pass --assistant_only_loss false to train on every token, or "
        "give the tokenizer a template with the markers (train_tokenizer.py --chat_template writes one)"
    )


def encoded_examples(dataset, split: str, tokenizer, example_format: str, source: TextSource, num_workers=None):
    """The examples of one split of data in `example_format`, in order (see ExampleEncoder), encoded in `num_workers`
    processes (--preprocessing_num_workers); the rows left out are counted in the log, with the first of each kind."""
    settings = source.examples
    if example_format == CONVERSATIONS:
        columns = (MESSAGES_COLUMN,)
    else:
        columns = (settings.prompt_column or "prompt", settings.completion_column or "completion")
    encoder = ExampleEncoder(
        tokenizer=tokenizer,
        example_format=example_format,
        columns=columns,
        around=ids_around_documents(tokenizer),
        assistant_mask=assistant_mask_wanted(tokenizer, example_format, settings, split),
        skip_missing=source.skip_missing_texts,
        where=text_source(split, source),
    )
    left_out = {}  # reason -> [count, first row]
    batches = numbered_batches(dataset, columns, split)
    for results in map_in_workers(encoder.encode_batch, batches, num_workers):
        for result in results:
            if isinstance(result, LeftOut):
                left_out.setdefault(result.reason, [0, result.row])[0] += 1
            else:
                yield result
    for reason, (count, first_row) in left_out.items():
        logger.warning(
            "%s: left out %d examples %s, the first at row %d of %s", split, count, reason, first_row, encoder.where
        )


@dataclass
class RowCounts:
    """What the rows of one split hold, for the log: the examples in them, their tokens and the tokens trained on,
    and (length, row of the data) of each example left out as longer than a row."""

    examples: int = 0
    rows: int = 0
    tokens: int = 0
    trained: int = 0
    too_long: list = field(default_factory=list)

    def add(self, ids: np.ndarray, weights: np.ndarray):
        self.examples, self.tokens, self.trained = (
            self.examples + 1,
            self.tokens + len(ids),
            self.trained + int(weights.sum()),
        )

    def log(self, split: str, block_size: int, packing: bool):
        if self.too_long:
            logger.warning(
                "%s: left out %d examples longer than --block_size %d (the longest %d tokens, the first at row %d); "
                "raise --block_size to keep them",
                split,
                len(self.too_long),
                block_size,
                max(self.too_long)[0],
                min(row for _, row in self.too_long),
            )
        if self.rows:
            logger.info(
                "%s: %d examples in %d rows of %d tokens (%.0f%% of the positions filled), %d tokens trained on%s",
                split,
                self.examples,
                self.rows,
                block_size,
                100 * self.tokens / (self.rows * block_size),
                self.trained,
                "" if packing else "; --packing would put several examples in a row",
            )
