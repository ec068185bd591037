"""Log-probabilities of token sequences under a causal language model: of each token given those before it, whether it
is the model's most likely token there, and the most likely tokens with theirs. One compiled forward pass serves
lm-evaluation-harness's requests (flax_lm.evaluation.harness) and the server's logprobs (flax_lm.server.app).

The sequences of a call are sorted by length and padded into a few shapes (in positions, powers of two and halfway
between them), so that scoring a task compiles a handful of programs, not one per request. Rows are padded on the
right: positions stay those of the sequence alone, and what follows a token never changes its score in a causal
model. With several processes, every process scores the same sequences and gets every score.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from flax_lm.generation.sampling import on_host, shape_bucket

# The shortest padded length: shorter sequences share one program.
SHORTEST_LENGTH = 16


@dataclasses.dataclass(frozen=True)
class SequenceScores:
    """The scores of the tokens of a sequence after its first (which nothing predicts): row i is token i + 1's."""

    log_probs: np.ndarray  # (length - 1,) float32: log P(token | the tokens before it)
    is_greedy: np.ndarray  # (length - 1,) bool: the token is the model's most likely there
    top_ids: np.ndarray  # (length - 1, top_k) int32: the model's most likely tokens there, most likely first
    top_log_probs: np.ndarray  # (length - 1, top_k) float32: their log-probabilities


class Scorer:
    """Scores sequences of token ids with `model` (`model.apply({"params": params}, input_ids)` -> float32 logits
    (batch, length, vocab)), at most `tokens_per_batch` padded positions at a time. A sequence may hold up to the
    model's positions plus one tokens (the last is predicted, never read). With the model on a `mesh`, the rows of a
    batch are split over its data, fsdp and expert axes."""

    def __init__(self, model, tokens_per_batch: int, mesh: jax.sharding.Mesh | None = None):
        self.max_length = model.config.max_position_embeddings  # positions; GPT2Config maps it to n_positions
        self.tokens_per_batch = max(tokens_per_batch, self.max_length)
        rows_over = ("data", "fsdp", "expert")
        self.row_multiple = 1 if mesh is None else math.prod(mesh.shape[axis] for axis in rows_over)
        self.input_sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(rows_over))

        def scores(params, input_ids, target_ids, top_k: int):
            logits = model.apply({"params": params}, input_ids)  # (rows, length, vocab)
            normalizer = jax.nn.logsumexp(logits, axis=-1)
            target_logits = jnp.take_along_axis(logits, target_ids[..., None], axis=-1)[..., 0]
            is_greedy = jnp.argmax(logits, axis=-1) == target_ids
            top_logits, top_ids = jax.lax.top_k(logits, top_k)
            return target_logits - normalizer, is_greedy, top_ids, top_logits - normalizer[..., None]

        self.scores = jax.jit(scores, static_argnames="top_k")

    def score(
        self, params, sequences: list[list[int]], top_k: int = 0, progress: bool = False
    ) -> list[SequenceScores]:
        """The scores of each sequence (lists of at least one token id), with the `top_k` most likely tokens at each
        position, in the order given; with `progress`, a progress bar over the batches (on process 0)."""
        if too_long := [len(sequence) for sequence in sequences if len(sequence) > self.max_length + 1]:
            raise ValueError(
                f"a sequence of {too_long[0]} tokens is longer than the model's {self.max_length} positions plus one"
            )
        nothing = SequenceScores(
            np.zeros(0, np.float32),
            np.zeros(0, bool),
            np.zeros((0, top_k), np.int32),
            np.zeros((0, top_k), np.float32),
        )
        results = [nothing] * len(sequences)
        batches = self.batches([len(sequence) for sequence in sequences])
        for indices, rows, length in tqdm(
            batches, "Scoring", leave=False, disable=not progress or jax.process_index()
        ):
            input_ids = np.zeros((rows, length), np.int32)
            target_ids = np.zeros((rows, length), np.int32)
            for row, index in enumerate(indices):
                sequence = sequences[index]
                input_ids[row, : len(sequence) - 1] = sequence[:-1]
                target_ids[row, : len(sequence) - 1] = sequence[1:]
            if self.input_sharding is not None:
                input_ids, target_ids = (
                    jax.make_array_from_callback(
                        array.shape, self.input_sharding, lambda where, array=array: array[where]
                    )
                    for array in (input_ids, target_ids)
                )
            outputs = on_host(*self.scores(params, input_ids, target_ids, top_k))
            for row, index in enumerate(indices):
                predicted = len(sequences[index]) - 1
                results[index] = SequenceScores(*(output[row, :predicted] for output in outputs))
        return results

    def batches(self, lengths: list[int]) -> list[tuple[list[int], int, int]]:
        """(indices of the sequences, rows, positions) of each padded batch: the longest sequences first, each batch
        as many rows as tokens_per_batch allows at the padded length of its longest sequence. Sorted so, every batch
        but the last is full: a call compiles a program per padded length, and one for the last batch."""
        order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
        order = [index for index in order if lengths[index] > 1]  # a single token has nothing to score
        batches, start, multiple = [], 0, self.row_multiple
        while start < len(order):
            length = padded_length(lengths[order[start]] - 1, self.max_length)
            capacity = max(multiple, self.tokens_per_batch // length // multiple * multiple)
            indices = order[start : start + capacity]
            rows = min(capacity, multiple * shape_bucket(math.ceil(len(indices) / multiple), 1))
            batches.append((indices, rows, length))
            start += len(indices)
        return batches


def padded_length(length: int, max_length: int) -> int:
    """The positions `length` inputs are padded to: the next of 16, 24, 32, 48, 64, 96, 128, ... (powers of two and
    halfway between them: at most half again as long, in two programs per doubling), at most max_length."""
    power = shape_bucket(length, SHORTEST_LENGTH)
    halfway = power * 3 // 4
    return min(halfway if halfway >= max(length, SHORTEST_LENGTH) else power, max_length)
