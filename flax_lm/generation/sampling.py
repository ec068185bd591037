"""Sampling from a causal language model with a key/value cache (the model's empty_cache): each row of a batch
decoded by its own settings, the decoding loop compiled once per shape and run some steps at a time."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from flax_lm.models.common import KeyValueCache

# The smallest normal float32, which decoding computes in: a temperature or top_p below it is flushed to 0 on a CPU
# (a top_p of 0 kept no token, and the row ended at once) or, at best, is a denormal number of little precision.
SMALLEST_FLOAT32 = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class Sampling:
    """How one row is decoded: greedy at temperature 0, else drawn (see next_tokens). Its draws depend only on
    `seed`, `prompt_index` (the prompt's place among those decoded under one seed, so that they draw differently)
    and the step, never on the rows beside it."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompt_index: int = 0

    def problem(self, prefix: str) -> str | None:
        """What is wrong with these settings (named with `prefix`, "--" on a command line), or None."""
        if self.max_new_tokens < 1:
            return f"{prefix}max_new_tokens must be at least 1"
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            return f"{prefix}temperature must be 0 (greedy) or positive"
        smallest = f"{SMALLEST_FLOAT32:.8g}, the smallest float32 that decoding computes in at full precision"
        if 0 < self.temperature < SMALLEST_FLOAT32:
            return (
                f"{prefix}temperature {self.temperature:g} is below {smallest}; so low a temperature is greedy: pass 0"
            )
        if not 0 <= self.top_k < 2**31:
            return f"{prefix}top_k must be 0 (all tokens) or positive, below 2**31"
        if not 0 < self.top_p <= 1:
            return f"{prefix}top_p must be in (0, 1]"
        if self.top_p < SMALLEST_FLOAT32:
            return (
                f"{prefix}top_p {self.top_p:g} is below {smallest}; any top_p below the most likely token's "
                f"probability keeps that token alone: pass {SMALLEST_FLOAT32:.2g} or more"
            )
        if not 0 <= self.seed < 2**31:
            return f"{prefix}seed must be in [0, 2**31)"
        return None


class RowSettings(flax.struct.PyTreeNode):
    """The Sampling of each row as arrays (batch,): data to the compiled program, so that rows with different
    settings share it."""

    max_new_tokens: jax.Array  # int32; 0 for the rows that only fill the batch
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    seed: jax.Array  # int32
    prompt_index: jax.Array  # int32

    @classmethod
    def of(cls, samplings: list[Sampling]):
        def column(name: str, dtype):
            return np.asarray([getattr(sampling, name) for sampling in samplings], dtype)

        return cls(
            max_new_tokens=column("max_new_tokens", np.int32),
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            seed=column("seed", np.int32),
            prompt_index=column("prompt_index", np.int32),
        )


class DecodingState(flax.struct.PyTreeNode):
    """What the decoding carries from one call of `decode` to the next."""

    cache: KeyValueCache
    settings: RowSettings
    last_token: jax.Array  # (batch,) int32
    tokens: jax.Array  # (batch, capacity) int32: the new tokens so far, then padding
    counts: jax.Array  # (batch,) int32: new tokens per row, the end-of-text token included
    finished: jax.Array  # (batch,) bool
    step: jax.Array  # int32: the column of `tokens` the next token goes to


def next_tokens(logits, row_keys, temperature, top_k, top_p, do_sample: bool, candidates: int):
    """One token per row from float32 logits (batch, vocab_size), each row by its own settings (arrays (batch,)):
    the most likely where the temperature is 0; else drawn as transformers does: logits divided by the
    temperature, cut to the `top_k` most likely (0: all), then to the most likely whose probabilities add up to
    `top_p`. `do_sample` (some row draws) and `candidates` (how many of the most likely tokens some row's cut
    needs to see; 0 where no row cuts) only leave out work that no row needs: a row's token is the same."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not do_sample:
        return greedy
    drawing = temperature > 0
    # Less the largest first: at a temperature near 0, the logits themselves over it would overflow to inf, and
    # every token whose logit is positive would tie with the most likely.
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.where(drawing, temperature, 1.0)[:, None]
    if candidates:
        logits = cut_to_most_likely(logits, top_k, top_p, candidates)
    # Every row draws over the whole vocabulary in its order, so that its draw is the same in any batch.
    drawn = jax.vmap(jax.random.categorical)(row_keys, logits)
    return jnp.where(drawing, drawn, greedy).astype(jnp.int32)


def cut_to_most_likely(logits, top_k, top_p, candidates: int):
    """The logits with -inf outside each row's top_k most likely tokens, then outside the most likely of those
    whose probabilities add up to its top_p; tokens that tie with the last one kept are kept too, as in
    transformers' top-k. `candidates`: how many of the most likely tokens to sort, at least every row's top_k
    (all of them where a row has top_p without top_k)."""
    sorted_logits, _ = jax.lax.top_k(logits, candidates)
    rank = jnp.arange(candidates)[None, :]
    in_top_k = rank < jnp.where(top_k > 0, top_k, candidates)[:, None]
    sorted_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
    probabilities = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probabilities, axis=-1) - probabilities  # the most likely token always stays
    kept = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1)
    cuts = (top_k > 0) | (top_p < 1)
    return jnp.where(~cuts[:, None] | (logits >= threshold[:, None]), logits, -jnp.inf)


def candidates_to_sort(samplings: list[Sampling], vocab_size: int) -> int:
    """The `candidates` of next_tokens for these rows: a power of two, so that few programs serve all top_k."""
    cutting = [s for s in samplings if s.temperature > 0 and (s.top_k or s.top_p < 1)]
    if not cutting:
        return 0
    if any(not s.top_k for s in cutting):
        return vocab_size
    return min(vocab_size, shape_bucket(max(s.top_k for s in cutting), 1))


@dataclass(frozen=True)
class Sampler:
    """The compiled decoding of a model: `prefill` reads the prompts and chooses each row's first token,
    `decode` goes on for some steps. Compiled once per (batch, prompt length, capacity), per greedy or not and
    per count of candidates (see next_tokens); every setting of a row is data, so changing it compiles nothing."""

    prefill: Callable
    decode: Callable
    vocab_size: int


def make_sampler(model, eos_token_id: int | list[int] | None) -> Sampler:
    """The decoding of `model`, each row ending at the end-of-text token `eos_token_id`, or at the first of several
    (a chat model's end of turn among them: flax_lm.data.chat.stop_token_ids)."""
    stop_ids = [] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    pad = max(stop_ids[0], 0) if stop_ids else 0  # what finished rows write

    def ends(token):
        return jnp.isin(token, jnp.asarray(stop_ids or [-1], jnp.int32))

    def choose(settings: RowSettings, step, logits, do_sample: bool, candidates: int):
        def row_key(seed, prompt_index):
            return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), prompt_index), step)

        row_keys = jax.vmap(row_key)(settings.seed, settings.prompt_index)
        return next_tokens(
            logits, row_keys, settings.temperature, settings.top_k, settings.top_p, do_sample, candidates
        )

    @partial(jax.jit, static_argnames=("capacity", "do_sample", "candidates"))
    def prefill(params, prompt_ids, prompt_mask, settings, *, capacity: int, do_sample: bool, candidates: int):
        # prompt_ids, prompt_mask: (batch, prompt length), left-padded
        batch = prompt_ids.shape[0]
        cache = model.empty_cache(prompt_mask, capacity)
        logits, cache = model.apply({"params": params}, prompt_ids, cache=cache)
        token = choose(settings, 0, logits[:, -1], do_sample, candidates)
        counts = (settings.max_new_tokens > 0).astype(jnp.int32)
        token = jnp.where(counts > 0, token, pad)
        return DecodingState(
            cache=cache,
            settings=settings,
            last_token=token,
            tokens=jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(token),
            counts=counts,
            finished=ends(token) | (counts >= settings.max_new_tokens),
            step=jnp.ones((), jnp.int32),
        )

    @partial(jax.jit, static_argnames=("do_sample", "candidates"), donate_argnames=("state",))
    def decode(params, state: DecodingState, until_step, ended, *, do_sample: bool, candidates: int):
        """Decodes until step `until_step` or until every row is finished; `ended` (batch,) bool finishes rows
        first, those the caller has no use for any more."""

        def not_done(state):
            return (state.step < until_step) & ~jnp.all(state.finished)

        def decode_one(state):
            logits, cache = model.apply({"params": params}, state.last_token[:, None], cache=state.cache)
            token = choose(state.settings, state.step, logits[:, 0], do_sample, candidates)
            token = jnp.where(state.finished, pad, token)
            counts = state.counts + ~state.finished
            return state.replace(
                cache=cache,
                last_token=token,
                tokens=state.tokens.at[:, state.step].set(token),
                counts=counts,
                finished=state.finished | ends(token) | (counts >= state.settings.max_new_tokens),
                step=state.step + 1,
            )

        return jax.lax.while_loop(not_done, decode_one, state.replace(finished=state.finished | ended))

    return Sampler(prefill, decode, model.config.vocab_size)


def shape_bucket(size: int, smallest: int) -> int:
    """The power of two at least `size` and `smallest`: shapes from a few buckets, so few compilations."""
    return max(smallest, 1 << (size - 1).bit_length())


def on_host(*arrays) -> list[np.ndarray]:
    # On several processes every one takes part in the decoding and gets the result.
    if all(array.is_fully_addressable for array in arrays):
        return [np.asarray(array) for array in arrays]
    return list(multihost_utils.process_allgather(arrays, tiled=True))


class DecodingBatch:
    """Prompts (non-empty lists of ids) decoded together, each by its own Sampling, some steps at a time: between
    calls of `advance` the caller reads each row's new tokens (to send them on) and may end rows. A row's tokens
    end with the end-of-text token where the model wrote it."""

    def __init__(self, sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]):
        self.sampler, self.params, self.rows = sampler, params, len(prompts)
        batch = shape_bucket(len(prompts), 1)
        prompt_length = shape_bucket(max(map(len, prompts)), 8)
        prompt_ids = np.zeros((batch, prompt_length), np.int32)
        prompt_mask = np.zeros((batch, prompt_length), bool)
        prompt_mask[len(prompts) :, -1] = True  # rows that only fill the batch hold one token and decode none
        for row, ids in enumerate(prompts):
            prompt_ids[row, prompt_length - len(ids) :] = ids
            prompt_mask[row, prompt_length - len(ids) :] = True
        settings = RowSettings.of(samplings + [Sampling(max_new_tokens=0)] * (batch - len(prompts)))
        self.variant = {
            "do_sample": any(s.temperature > 0 for s in samplings),
            "candidates": candidates_to_sort(samplings, sampler.vocab_size),
        }
        self.capacity = shape_bucket(max(s.max_new_tokens for s in samplings), 8)
        self.state = sampler.prefill(params, prompt_ids, prompt_mask, settings, capacity=self.capacity, **self.variant)
        self.read = np.zeros(len(prompts), int)  # tokens of each row handed out so far
        self.finished = np.zeros(len(prompts), bool)

    def advance(self, steps: int, ended=()) -> list[list[int]]:
        """Decodes up to `steps` more steps (none once every row is finished) and returns each row's tokens that
        no earlier call returned (the first call: from the first). Rows in `ended` decode no more."""
        ended_rows = np.zeros(self.state.counts.shape, bool)
        ended_rows[list(ended)] = True
        until_step = self.state.step + steps
        self.state = self.sampler.decode(self.params, self.state, until_step, ended_rows, **self.variant)
        tokens, counts, finished = on_host(self.state.tokens, self.state.counts, self.state.finished)
        new = [tokens[row, self.read[row] : counts[row]].tolist() for row in range(self.rows)]
        self.read, self.finished = counts[: self.rows], finished[: self.rows]
        return new


def decode_rows(sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]) -> list[list[int]]:
    """The new tokens after each prompt, decoded together to the end."""
    batch = DecodingBatch(sampler, params, prompts, samplings)
    return batch.advance(batch.capacity)


def generate_ids(
    sampler: Sampler,
    params,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[list[int]]:
    """The new tokens after each prompt (non-empty lists of ids), ending with the end-of-text token where the
    model wrote it, all prompts by the same settings. Temperature 0 is greedy decoding."""
    samplings = [Sampling(max_new_tokens, temperature, top_k, top_p, seed, row) for row in range(len(prompts))]
    return decode_rows(sampler, params, prompts, samplings)
