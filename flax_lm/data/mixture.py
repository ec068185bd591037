"""Several sources of training data mixed by weight (--data_mixture FILE): the file that names them, their rows, and
the order in which a run draws rows from them."""

import dataclasses
import itertools
import logging
import math
import os
import re

import numpy as np
import yaml

from flax_lm.data.data_files import data_file_paths, data_file_patterns
from flax_lm.data.source import TextSource
from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)


MIXTURE_KEYS = ("weight", "train_file", "validation_file")
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    weight: float | None  # None for a source that is only evaluated
    train_file: list[str]
    validation_file: list[str]


class MixtureLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but for two things a mixture file must not leave to chance: a key given twice in one
    mapping is refused (PyYAML keeps the last, so a source named twice would silently be one), and a number in
    exponent notation without a dot (1e-3, as JSON writes it) is read as the number it is, not as a string (YAML 1.1
    asks for 1.0e-3)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


MixtureLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


class DuplicateKey(Exception):
    def __init__(self, key, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


def read_mixture(path: str) -> list[Source]:
    """The sources of a mixture file (YAML, or JSON, which YAML reads too): a mapping from each source's name to its
    weight, train_file and validation_file. Files and globs are taken relative to the mixture file's directory."""
    flag = f"--data_mixture {path}"
    if not os.path.isfile(path):
        raise UsageError(f"{flag} does not exist or is not a file")
    try:
        with open(path, encoding="utf-8") as file:
            entries = yaml.load(file, Loader=MixtureLoader)
    except DuplicateKey as duplicate:
        raise UsageError(
            f"{flag}: line {duplicate.line} gives {duplicate.key!r} a second time in the same mapping; give each "
            "source, and each of its keys, once"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise UsageError(f"{flag} is not YAML or JSON: {' '.join(str(error).split())}") from None
    example = "e.g. 'web: {weight: 3, train_file: web/*.jsonl.gz}'"
    if not isinstance(entries, dict) or not entries:
        raise UsageError(f"{flag} must map each source's name to its weight and files, {example}")
    directory = os.path.dirname(os.path.abspath(path))
    sources = []
    for name, entry in entries.items():
        if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
            raise UsageError(f"{flag}: source name {name!r} must be letters, digits, '_', '.' or '-'")
        if not isinstance(entry, dict) or set(entry) - set(MIXTURE_KEYS):
            raise UsageError(f"{flag}: source '{name}' must be a mapping of {', '.join(MIXTURE_KEYS)}, {example}")
        files = {}
        for key in ("train_file", "validation_file"):
            value = entry.get(key)
            if value is not None and not (
                isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value))
            ):
                raise UsageError(f"{flag}: source '{name}' {key} must be a file, a glob or a list of them")
            files[key] = [os.path.join(directory, pattern) for pattern in data_file_patterns(value)]
        weight = entry.get("weight")
        if files["train_file"]:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
                raise UsageError(
                    f"{flag}: source '{name}' needs a positive weight (the weights are shares once divided by their "
                    f"sum), not {weight!r}"
                )
        elif weight is not None:
            raise UsageError(f"{flag}: source '{name}' has a weight but no train_file to draw training rows from")
        elif not files["validation_file"]:
            raise UsageError(f"{flag}: source '{name}' names no train_file or validation_file")
        sources.append(Source(name, None if weight is None else float(weight), **files))
    return sources


def warn_of_validation_files_trained_on(sources: list[Source], flag: str):
    """Warn where a source's validation file is a training file of its own or of another source (as
    warn_of_files_in_both_splits does for --train_file and --validation_file): its evaluation then measures how well
    the model remembers texts it trained on."""
    train_files = {source.name: data_file_paths(source.train_file) for source in sources}
    for source in sources:
        validation_files = data_file_paths(source.validation_file)
        for other, files in train_files.items():
            if shared := sorted(validation_files & files):
                whose = "its own train_file" if other == source.name else f"a train_file of source '{other}'"
                logger.warning(
                    "%s: the validation_file of source '%s' is %s (%s): its evaluation measures how well the model "
                    "remembers its training texts, not how it does on new text",
                    flag,
                    source.name,
                    whose,
                    ", ".join(shared),
                )


def source_texts(texts: TextSource, source: Source) -> TextSource:
    """Where one source's texts are: its files, read as --train_file and --validation_file would be."""
    return dataclasses.replace(
        texts, train_file=source.train_file or None, validation_file=source.validation_file or None
    )


# Row r of a run (counting the rows of every global batch in order) comes from the source whose share of [0, 1) holds
# the fractional part of (r + 1) times the golden ratio: a sequence that fills [0, 1) about as evenly as any, so the
# rows of every source match its weight to within a few rows at every step of the run, and every batch is mixed.
GOLDEN_FRACTION = (math.sqrt(5) - 1) / 2


class Mixture:
    """The training rows of several sources, indexed as one (rows, width) array-like (the sources one after the
    other; (rows, 2, width) for examples' token ids and loss weights), and the rows a run draws from them by weight.
    Each source is read pass after pass, every pass in an order of its own fixed by the seed, however often the other
    sources repeat. Which rows a global batch holds depends only on the step, the seed and the sources, so a resumed
    run and every process agree on them."""

    def __init__(self, names: list[str], weights: list[float], sources: list, rows_are_tokens: bool = True):
        self.names, self.sources, self.rows_are_tokens = names, sources, rows_are_tokens
        if len({rows.shape[1:] for rows in sources}) > 1:
            raise UsageError(
                "the sources of the mixture are of two kinds, plain text and examples (prompt/completion pairs or "
                "conversations); give a mixture sources of one kind"
            )
        scaled = np.asarray(weights, np.float64) / max(weights)  # weights near the largest float would sum to inf
        self.weights = scaled / scaled.sum()
        self.bounds = np.cumsum(self.weights)[:-1]
        self.offsets = np.concatenate([[0], np.cumsum([len(rows) for rows in sources])]).astype(np.int64)
        self.orders = {}  # (source, pass): the order of that pass, the few in use kept

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.sources[0].shape[1:])

    def __getitem__(self, index):
        """The rows at an integer index or an array of them, read from their sources."""
        positions = np.atleast_1d(np.asarray(index, np.int64))
        source_numbers = np.searchsorted(self.offsets, positions, side="right") - 1
        rows = np.empty((len(positions), *self.shape[1:]), np.int32)
        for source in np.unique(source_numbers):
            chosen = source_numbers == source
            rows[chosen] = np.asarray(self.sources[source][positions[chosen] - self.offsets[source]])
        return rows[0] if np.ndim(index) == 0 else rows

    def sources_of_draws(self, start: int, stop: int) -> np.ndarray:
        """The source of each of the run's rows start, ..., stop - 1."""
        draws = np.arange(start, stop, dtype=np.float64)
        return np.searchsorted(self.bounds, (draws + 1) * GOLDEN_FRACTION % 1.0, side="right")

    def draws_per_source(self, count: int) -> np.ndarray:
        """How many of the run's first `count` rows each source gives."""
        totals = np.zeros(len(self.sources), np.int64)
        chunk = 1 << 22
        for start in range(0, count, chunk):
            totals += np.bincount(self.sources_of_draws(start, min(start + chunk, count)), minlength=len(totals))
        return totals

    def order(self, source: int, pass_number: int, seed: int) -> np.ndarray:
        key = (source, pass_number)
        if key not in self.orders:
            if len(self.orders) >= 2 * len(self.sources):
                self.orders.pop(next(iter(self.orders)))
            rng = np.random.default_rng([seed, source, pass_number])
            self.orders[key] = rng.permutation(len(self.sources[source]))
        return self.orders[key]

    def source_rows(self, source: int, first_draw: int, count: int, seed: int) -> np.ndarray:
        """The indices (in the source) of the source's draws first_draw, ..., first_draw + count - 1."""
        passes, places = np.divmod(np.arange(first_draw, first_draw + count), len(self.sources[source]))
        rows = np.empty(count, np.int64)
        for pass_number in np.unique(passes):
            chosen = passes == pass_number
            rows[chosen] = self.order(source, int(pass_number), seed)[places[chosen]]
        return rows

    def global_batches(self, global_batch_size: int, seed: int, first_step: int):
        """The indices of the rows of each global batch from the one after step `first_step` on, without end;
        sorted, for reading memory-mapped rows in order."""
        drawn = self.draws_per_source(first_step * global_batch_size)
        for step in itertools.count(first_step):
            source_numbers = self.sources_of_draws(step * global_batch_size, (step + 1) * global_batch_size)
            indices = np.empty(global_batch_size, np.int64)
            for source in range(len(self.sources)):
                chosen = source_numbers == source
                count = int(np.count_nonzero(chosen))
                indices[chosen] = self.offsets[source] + self.source_rows(source, int(drawn[source]), count, seed)
                drawn[source] += count
            yield np.sort(indices)

    def describe(self, total_rows: int) -> str:
        """Each source's weight, rows and passes over them in a run of `total_rows` rows, for the log."""
        planned = self.draws_per_source(total_rows)
        return "; ".join(
            f"{name} weight {weight:.1%}, {len(rows)} rows, {count / len(rows):.2f} passes"
            for name, weight, rows, count in zip(self.names, self.weights, self.sources, planned)
        )

    def contributions(self, total_rows: int, first_row: int = 0) -> dict:
        """What each source gave the run's rows first_row, ..., total_rows - 1, logged and returned for
        train_results.json: its tokens where every row is tokens (blocks of packed text; run_mlm_flax.py frames each
        with <s> and </s>, not counted here), else (padded lines) its rows; and its share."""
        drawn = self.draws_per_source(total_rows) - self.draws_per_source(first_row)
        unit = "tokens" if self.rows_are_tokens else "rows"
        amounts = drawn * (self.shape[-1] if self.rows_are_tokens else 1)
        shares = drawn / max(total_rows - first_row, 1)
        logger.info(
            "The mixture's %s: %s",
            unit,
            "; ".join(
                f"{name} {amount:,} ({share:.2%}, weight {weight:.2%})"
                for name, amount, share, weight in zip(self.names, amounts, shares, self.weights)
            ),
        )
        results = {f"{unit}_{name}": int(amount) for name, amount in zip(self.names, amounts)}
        results.update({f"{unit[:-1]}_share_{name}": float(share) for name, share in zip(self.names, shares)})
        return results


def check_mixture(data_mixture: str, do_train: bool, other_data_flags: list[str]):
    """Refuse, before any work, a --data_mixture beside other data flags (`other_data_flags`: those given, by name),
    or one with nothing to train on where the run trains (--do_train)."""
    if other_data_flags:
        raise UsageError(
            f"--data_mixture names the data, so --{other_data_flags[0]} has no place beside it: put the files in the "
            "mixture file, or drop --data_mixture"
        )
    sources = read_mixture(data_mixture)
    if do_train and all(source.weight is None for source in sources):
        raise UsageError(f"--do_train needs training data: --data_mixture {data_mixture} gives no source a train_file")
