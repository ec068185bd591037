"""Preference pairs (TRL's preference formats) as the token rows run_dpo_flax.py trains on.

A pair is a prompt with a chosen and a rejected completion: strings ({"prompt": "...", "chosen": "...", "rejected":
"..."}), or conversations, lists of {"role", "content"} messages that the chat template renders ({"prompt": [user
turns], "chosen": [the assistant's turn], "rejected": [another]}); a conversational pair may leave the prompt out,
which is then the messages chosen and rejected begin with alike (TRL's implicit prompt). They are read from JSON or
JSON lines files, or from a directory that Dataset.save_to_disk (or DatasetDict.save_to_disk) wrote.

Tokenized as TRL 1.16's DPOTrainer does, so that the same pairs give the same tokens: the prompt alone and the prompt
followed by each completion are encoded (text: the tokenizer's framing, a Llama's BOS first, with the end-of-text
token appended to each completion; conversations: apply_chat_template, the prompt with the generation prompt), and
the completion is what follows the longest start the three encodings share. A pair is one row of shape (2, 2,
length): chosen then rejected, each its token ids then its completion mask (1 on the completion's tokens), padded on
the right, cut to --max_length as --truncation_mode says (keep_start drops a pair whose prompt alone fills it, as
TRL does).
"""

import json
import os
from collections.abc import Iterable

import numpy as np

from flax_lm.data.chat import conversation_problem, render_conversation
from flax_lm.errors import UsageError

FIELDS = ("prompt", "chosen", "rejected")
TRUNCATION_MODES = ("keep_start", "keep_end")


def read_pairs(path: str, split: str = "train") -> list[dict]:
    """The preference pairs of a .json/.jsonl file (a JSON array of objects, or one object a line) or of a directory
    written by save_to_disk (its `split` where it holds several), each checked (check_pair): one line names the file,
    the row and what is wrong."""
    if os.path.isdir(path):
        import datasets

        try:
            dataset = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError) as error:
            raise UsageError(f"{path} is not a dataset directory written by save_to_disk ({error})") from None
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise UsageError(f"{path} holds the splits {', '.join(dataset)}, not {split}")
            dataset = dataset[split]
        rows = list(dataset)
    elif path.endswith((".json", ".jsonl")):
        rows = json_rows(path)
    else:
        raise UsageError(f"{path}: preference pairs are read from .json or .jsonl files or a save_to_disk directory")
    if not rows:
        raise UsageError(f"{path} holds no preference pairs")
    return [check_pair(row, f"{path}, row {number}") for number, row in enumerate(rows, 1)]


def json_rows(path: str) -> list:
    """The objects of a JSON file: a JSON array, or JSON lines (blank lines skipped)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}, line {number} is not a JSON object: {error.msg}") from None
    return rows


def is_conversational(pair: dict) -> bool:
    return isinstance(pair.get("chosen"), list)


def check_pair(row, where: str) -> dict:
    """The pair of `row` as {"prompt", "chosen", "rejected"}, all strings or all lists of messages; a conversational
    row without a prompt has it taken from the messages its completions begin with alike (TRL's implicit prompt).
    UsageError naming `where` (file and row) and the field that is missing or of the wrong kind."""
    if not isinstance(row, dict):
        raise UsageError(f"{where} is not an object with the fields prompt, chosen and rejected")
    for name in ("chosen", "rejected"):
        if row.get(name) is None:
            raise UsageError(
                f"{where} has no '{name}' field; each pair needs chosen and rejected (and a prompt, unless "
                "they are conversations that share their start)"
            )
    if isinstance(row["chosen"], list) and row.get("prompt") is None:
        row = implicit_prompt(row["chosen"], row["rejected"], where)
    if row.get("prompt") is None:
        raise UsageError(f"{where} has no 'prompt' field; each pair needs prompt, chosen and rejected")
    pair = {name: row[name] for name in FIELDS}
    if all(isinstance(value, str) for value in pair.values()):
        return pair
    for name, value in pair.items():
        if problem := conversation_problem(value):
            raise UsageError(
                f"{where}: '{name}' {problem} (the three fields are all strings, or all lists of messages)"
            )
    return pair


def implicit_prompt(chosen: list, rejected: list, where: str) -> dict:
    """The pair of conversations `chosen` and `rejected` split into the messages both begin with (the prompt) and
    what each goes on with."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 or shared == len(chosen) or shared == len(rejected):
        raise UsageError(
            f"{where} has no 'prompt' field, and its chosen and rejected conversations do not begin with the same "
            "prompt and go on differently; add the prompt"
        )
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def common_start(ids: list[int], other: list[int]) -> int:
    """How many leading tokens `ids` and `other` have in common."""
    length = 0
    while length < min(len(ids), len(other)) and ids[length] == other[length]:
        length += 1
    return length


def encode_pair(tokenizer, pair: dict) -> tuple[list[int], list[int], list[int]]:
    """The token ids of the prompt, the chosen and the rejected completion, as TRL 1.16 encodes a pair (the module's
    docstring). The completion starts where the prompt's encoding and the encodings of prompt and completion part,
    which is after the whole prompt unless a token spans the boundary or the template renders the prompt alone
    otherwise."""
    if is_conversational(pair):
        try:
            prompt = render_conversation(tokenizer, pair["prompt"], True, False)["input_ids"]
            chosen = render_conversation(tokenizer, pair["prompt"] + pair["chosen"], False, False)["input_ids"]
            rejected = render_conversation(tokenizer, pair["prompt"] + pair["rejected"], False, False)["input_ids"]
        except ValueError as error:
            raise UsageError(f"a conversation {error}") from None
    else:
        eos = tokenizer.eos_token
        ends = [text if text.endswith(eos) else text + eos for text in (pair["chosen"], pair["rejected"])]
        prompt = tokenizer(pair["prompt"])["input_ids"]
        chosen, rejected = (tokenizer(pair["prompt"] + end)["input_ids"] for end in ends)
    prompt_length = min(common_start(prompt, chosen), common_start(prompt, rejected))
    return prompt[:prompt_length], chosen[prompt_length:], rejected[prompt_length:]


def truncated(ids: list[int], mask: list[int], max_length: int | None, truncation_mode: str) -> tuple[list, list]:
    """A sequence and its completion mask cut to `max_length` tokens: its first (keep_start) or last (keep_end)."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask
    cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
    return ids[cut], mask[cut]


def pair_rows(
    encoded: Iterable[tuple[list, list, list]], max_length: int | None, truncation_mode: str, pad_id: int
) -> tuple[np.ndarray, int]:
    """The rows of encoded pairs (int32, (pairs, 2, 2, length): chosen and rejected, ids and completion mask), padded
    on the right with `pad_id` to the longest sequence; and how many pairs were dropped because the prompt alone
    fills `max_length` with keep_start (nothing of the completions would be left)."""
    sequences, dropped = [], 0
    for prompt, chosen, rejected in encoded:
        if max_length is not None and truncation_mode == "keep_start" and len(prompt) >= max_length:
            dropped += 1
            continue
        both = []
        for completion in (chosen, rejected):
            mask = [0] * len(prompt) + [1] * len(completion)
            both.append(truncated(prompt + completion, mask, max_length, truncation_mode))
        sequences.append(both)
    length = max((len(ids) for pair in sequences for ids, _ in pair), default=1)
    rows = np.zeros((len(sequences), 2, 2, length), np.int32)
    rows[:, :, 0] = pad_id
    for number, pair in enumerate(sequences):
        for side, (ids, mask) in enumerate(pair):
            rows[number, side, 0, : len(ids)], rows[number, side, 1, : len(ids)] = ids, mask
    return rows, dropped


def padded_to(rows: np.ndarray, length: int, pad_id: int) -> np.ndarray:
    """`rows` padded on the right to `length` positions (the train and validation rows share one length)."""
    padding = length - rows.shape[-1]
    if padding <= 0:
        return rows
    padded = np.pad(rows, ((0, 0), (0, 0), (0, 0), (0, padding)))
    padded[:, :, 0, rows.shape[-1] :] = pad_id
    return padded
