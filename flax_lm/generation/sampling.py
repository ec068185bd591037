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

from flax_lm.models.shared.common import KeyValueCache

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
    # The processors of transformers' generate, applied in its order (see processed_scores), and OpenAI's penalties
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # Beam search (greedy: temperature 0), as transformers' generate does it
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"

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
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            return f"{prefix}repetition_penalty must be positive: 1 leaves the logits as they are, above 1 penalizes"
        if self.no_repeat_ngram_size < 0:
            return f"{prefix}no_repeat_ngram_size must be 0 (off) or positive"
        if self.min_new_tokens < 0:
            return f"{prefix}min_new_tokens must be 0 (off) or positive"
        if self.min_new_tokens > self.max_new_tokens:
            return (
                f"{prefix}min_new_tokens {self.min_new_tokens} exceeds {prefix}max_new_tokens {self.max_new_tokens}; "
                "lower the first or raise the second"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                return f"{prefix}{name} must be from -2 to 2"
        if self.num_beams < 1:
            return f"{prefix}num_beams must be at least 1 (1: no beam search)"
        if self.num_beams > 1 and self.temperature > 0:
            return (
                f"{prefix}num_beams {self.num_beams} with {prefix}temperature {self.temperature:g}: beam search here "
                f"keeps the most likely beams; pass {prefix}temperature 0, or {prefix}num_beams 1 to sample"
            )
        if not math.isfinite(self.length_penalty):
            return f"{prefix}length_penalty must be a finite number"
        if self.early_stopping not in (True, False, "never"):
            return f"{prefix}early_stopping must be true, false or never"
        return None

    @property
    def penalizes(self) -> bool:
        """Whether some token's score depends on the tokens before it (repetition, presence or frequency)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class RowSettings(flax.struct.PyTreeNode):
    """The Sampling of each row as arrays (batch,): data to the compiled program, so that rows with different
    settings share it."""

    max_new_tokens: jax.Array  # int32; 0 for the rows that only fill the batch
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    seed: jax.Array  # int32
    prompt_index: jax.Array  # int32
    repetition_penalty: jax.Array  # float32
    no_repeat_ngram_size: jax.Array  # int32
    min_new_tokens: jax.Array  # int32
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    logit_bias: jax.Array  # (batch, vocab_size) float32
    length_penalty: jax.Array  # float32
    early_stopping: jax.Array  # int32: EARLY_STOPPING's code

    @classmethod
    def of(cls, samplings: list[Sampling], vocab_size: int):
        def column(name: str, dtype):
            return np.asarray([getattr(sampling, name) for sampling in samplings], dtype)

        logit_bias = np.zeros((len(samplings), vocab_size), np.float32)
        for row, sampling in enumerate(samplings):
            for token_id, bias in sampling.logit_bias:
                logit_bias[row, token_id] = bias
        return cls(
            max_new_tokens=column("max_new_tokens", np.int32),
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            seed=column("seed", np.int32),
            prompt_index=column("prompt_index", np.int32),
            repetition_penalty=column("repetition_penalty", np.float32),
            no_repeat_ngram_size=column("no_repeat_ngram_size", np.int32),
            min_new_tokens=column("min_new_tokens", np.int32),
            presence_penalty=column("presence_penalty", np.float32),
            frequency_penalty=column("frequency_penalty", np.float32),
            logit_bias=logit_bias,
            length_penalty=column("length_penalty", np.float32),
            early_stopping=np.asarray([EARLY_STOPPING[s.early_stopping] for s in samplings], np.int32),
        )

    def repeat(self, times: int):
        """Each row `times` times over: the settings of a prompt's beams."""
        return jax.tree.map(lambda column: jnp.repeat(column, times, axis=0), self)


# transformers' early_stopping values as data: stop once num_beams hypotheses are done (True); once none of the
# running beams can score better, as estimated at the current length (False) or at the longest (never).
EARLY_STOPPING = {False: 0, True: 1, "never": 2}


class DecodingState(flax.struct.PyTreeNode):
    """What the decoding carries from one call of `decode` to the next."""

    cache: KeyValueCache
    settings: RowSettings
    prompt_ids: jax.Array  # (batch, prompt length) int32, with vocab_size in the padding
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


def processed_scores(scores, settings: RowSettings, prompt_ids, new_tokens, new_count, stop_ids, variant):
    """The scores (batch, vocab_size) of the next token (logits; log-probabilities in beam search) after the
    processors each row asks for, in transformers' order: the bias of each token (OpenAI's logit_bias, as
    transformers' sequence_bias), the repetition penalty over the prompt and the new tokens, OpenAI's presence and
    frequency penalties over the new tokens, the n-grams that may not repeat, and no end of text before
    min_new_tokens. `prompt_ids` (batch, prompt length) holds vocab_size in the padding; `new_tokens` (batch,
    capacity) holds the new tokens in its first `new_count` columns. `variant`'s "penalize" and "ngram" (the largest
    no_repeat_ngram_size of the batch) leave out work no row needs."""
    rows, vocab_size = scores.shape
    scores = scores + settings.logit_bias
    written = jnp.arange(new_tokens.shape[1])[None, :] < new_count
    generated = jnp.where(written, new_tokens, vocab_size)
    history = jnp.concatenate([prompt_ids, generated], axis=1)
    row = jnp.arange(rows)[:, None]
    if variant["penalize"]:
        seen = jnp.zeros((rows, vocab_size), bool).at[row, history].set(True, mode="drop")
        penalty = settings.repetition_penalty[:, None]
        scores = jnp.where(seen, jnp.where(scores < 0, scores * penalty, scores / penalty), scores)
        counts = jnp.zeros((rows, vocab_size), jnp.float32).at[row, generated].add(1.0, mode="drop")
        scores = (
            scores - settings.frequency_penalty[:, None] * counts - settings.presence_penalty[:, None] * (counts > 0)
        )
    if variant["ngram"]:
        next_position = prompt_ids.shape[1] + new_count
        banned = banned_by_ngrams(history, next_position, settings.no_repeat_ngram_size, variant["ngram"], vocab_size)
        scores = jnp.where(banned, -jnp.inf, scores)
    if stop_ids:
        too_early = new_count < settings.min_new_tokens
        is_stop = jnp.zeros(vocab_size, bool).at[jnp.asarray(stop_ids)].set(True)
        scores = jnp.where(too_early[:, None] & is_stop[None, :], -jnp.inf, scores)
    return scores


def banned_by_ngrams(history, next_position, sizes, largest: int, vocab_size: int):
    """(batch, vocab_size) bool: the tokens that would repeat an n-gram of the row's `history` (batch, length; its
    tokens before `next_position`, vocab_size in the padding), n the row's `sizes` (0: none); `largest`: the
    largest of `sizes`, static. As transformers' NoRepeatNGramLogitsProcessor: every earlier n-gram whose first n-1
    tokens are the last n-1 bans its last token."""
    rows, length = history.shape
    padded = jnp.pad(history, ((0, 0), (0, largest)), constant_values=vocab_size)
    starts = jnp.arange(length)[None, :]
    sizes = sizes[:, None]
    matches = jnp.ones((rows, length), bool)
    for offset in range(largest - 1):
        last_position = jnp.clip(next_position - sizes + 1 + offset, 0, length - 1)
        last = jnp.take_along_axis(history, last_position, axis=1)
        matches &= (padded[:, offset : offset + length] == last) | (offset >= sizes - 1)
    following = jnp.take_along_axis(padded, jnp.clip(starts + sizes - 1, 0, length + largest - 1), axis=1)
    counted = (sizes > 0) & (starts + sizes - 1 < next_position) & (history != vocab_size)
    banned_tokens = jnp.where(matches & counted, following, vocab_size)
    return jnp.zeros((rows, vocab_size), bool).at[jnp.arange(rows)[:, None], banned_tokens].set(True, mode="drop")


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
    `decode` goes on for some steps; `beam_search` decodes prompts by beam search to the end in one program. Compiled
    once per (batch, prompt length, capacity), per greedy or not, per count of candidates (see next_tokens) and per
    processors' variant (see processed_scores); every setting of a row is data, so changing it compiles nothing."""

    prefill: Callable
    decode: Callable
    beam_search: Callable
    vocab_size: int


VARIANT_NAMES = ("do_sample", "candidates", "penalize", "ngram")
# What transformers adds to a score to rule a beam out (not -inf, so that such scores still compare).
RULED_OUT = -1.0e9


def make_sampler(model, eos_token_id: int | list[int] | None) -> Sampler:
    """The decoding of `model`, each row ending at the end-of-text token `eos_token_id`, or at the first of several
    (a chat model's end of turn among them: flax_lm.data.chat.stop_token_ids)."""
    stop_ids = [] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    pad = max(stop_ids[0], 0) if stop_ids else 0  # what finished rows write

    def ends(token):
        return jnp.isin(token, jnp.asarray(stop_ids or [-1], jnp.int32))

    def choose(state: "DecodingState", logits, variant: dict):
        settings = state.settings
        scores = processed_scores(logits, settings, state.prompt_ids, state.tokens, state.step, stop_ids, variant)

        def row_key(seed, prompt_index):
            return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), prompt_index), state.step)

        row_keys = jax.vmap(row_key)(settings.seed, settings.prompt_index)
        return next_tokens(
            scores,
            row_keys,
            settings.temperature,
            settings.top_k,
            settings.top_p,
            variant["do_sample"],
            variant["candidates"],
        )

    @partial(jax.jit, static_argnames=("capacity", *VARIANT_NAMES))
    def prefill(params, prompt_ids, prompt_mask, settings, *, capacity: int, **variant):
        # prompt_ids, prompt_mask: (batch, prompt length), left-padded
        batch = prompt_ids.shape[0]
        cache = model.empty_cache(prompt_mask, capacity)
        logits, cache = model.apply({"params": params}, prompt_ids, cache=cache)
        counts = (settings.max_new_tokens > 0).astype(jnp.int32)
        state = DecodingState(
            cache=cache,
            settings=settings,
            prompt_ids=jnp.where(prompt_mask, prompt_ids, model.config.vocab_size),
            last_token=jnp.zeros((batch,), jnp.int32),
            tokens=jnp.zeros((batch, capacity), jnp.int32),
            counts=counts,
            finished=jnp.zeros((batch,), bool),
            step=jnp.zeros((), jnp.int32),
        )
        token = jnp.where(counts > 0, choose(state, logits[:, -1], variant), pad)
        return state.replace(
            last_token=token,
            tokens=state.tokens.at[:, 0].set(token),
            finished=ends(token) | (counts >= settings.max_new_tokens),
            step=jnp.ones((), jnp.int32),
        )

    @partial(jax.jit, static_argnames=VARIANT_NAMES, donate_argnames=("state",))
    def decode(params, state: DecodingState, until_step, ended, **variant):
        """Decodes until step `until_step` or until every row is finished; `ended` (batch,) bool finishes rows
        first, those the caller has no use for any more."""

        def not_done(state):
            return (state.step < until_step) & ~jnp.all(state.finished)

        def decode_one(state):
            logits, cache = model.apply({"params": params}, state.last_token[:, None], cache=state.cache)
            token = jnp.where(state.finished, pad, choose(state, logits[:, 0], variant))
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

    @partial(jax.jit, static_argnames=("num_beams", "capacity", "penalize", "ngram"))
    def beam_search(params, prompt_ids, prompt_mask, settings, *, num_beams: int, capacity: int, **variant):
        """The best hypothesis of each prompt by beam search, as transformers' generate finds it: (batch, capacity)
        tokens, then padding, and (batch,) their counts."""
        cache = model.empty_cache(prompt_mask, capacity)
        logits, cache = model.apply({"params": params}, prompt_ids, cache=cache)

        def decode_step(tokens, cache):
            return model.apply({"params": params}, tokens, cache=cache)

        history = jnp.where(prompt_mask, prompt_ids, model.config.vocab_size)
        search = BeamSearch(decode_step, stop_ids, pad, num_beams, capacity, variant)
        return search(logits[:, -1], cache, settings, history)

    return Sampler(prefill, decode, beam_search, model.config.vocab_size)


@dataclass(frozen=True)
class BeamSearch:
    """Beam search over a decoder with a cache, as transformers' generate does it, in one while_loop: of a causal
    model after its prompt (make_sampler), or of an encoder-decoder's decoder after its start token
    (flax_lm/generation/seq2seq.py). `decode_step(tokens (rows, 1), cache) -> (logits (rows, 1, vocab), cache)`
    decodes one token of each row; every array of the cache with a shape has the rows first."""

    decode_step: Callable
    stop_ids: list
    pad: int  # what the rows write after their end
    num_beams: int
    capacity: int  # new tokens at most
    variant: dict  # processed_scores' "penalize" and "ngram"

    def __call__(self, logits, cache, settings: RowSettings, history):
        """(batch, capacity) tokens of each row's best hypothesis, then padding, and (batch,) their counts, from the
        float logits (batch, vocab_size) of the first new token and the cache that gave them, one row a prompt; the
        processors read `history` (batch, length), what transformers' generate sees before the new tokens (vocab_size
        in the padding)."""
        batch, beams, capacity, stop_ids, pad = logits.shape[0], self.num_beams, self.capacity, self.stop_ids, self.pad
        decode_step, variant = self.decode_step, self.variant
        vocab_size = logits.shape[-1]
        # The most likely 2 * beams continuations (more with several end-of-text tokens) keep `beams` running ones
        # even where the most likely all end.
        kept = max(2, 1 + len(stop_ids)) * beams
        # Every beam of a prompt starts from its prompt: read once, then repeated.
        cache = jax.tree.map(lambda leaf: jnp.repeat(leaf, beams, axis=0) if leaf.ndim else leaf, cache)
        beam_settings = settings.repeat(beams)
        beam_prompt_ids = jnp.repeat(history, beams, axis=0)
        max_new_tokens = settings.max_new_tokens[:, None]
        length_penalty = settings.length_penalty[:, None]
        stop_early, never = settings.early_stopping == EARLY_STOPPING[True], settings.early_stopping == 2

        def ends(token):
            return jnp.isin(token, jnp.asarray(stop_ids or [-1], jnp.int32))

        def gather(array, indices):  # array (batch, n, ...) at indices (batch, m) of its second axis
            return jax.vmap(lambda rows, index: rows[index])(array, indices)

        initial = {
            "logits": jnp.repeat(logits.astype(jnp.float32), beams, axis=0),
            "cache": cache,
            "running": jnp.zeros((batch, beams, capacity), jnp.int32),
            "running_scores": jnp.zeros((batch, beams)).at[:, 1:].set(RULED_OUT),
            "done": jnp.full((batch, beams, capacity), pad, jnp.int32),
            "done_scores": jnp.full((batch, beams), RULED_OUT),
            "done_counts": jnp.zeros((batch, beams), jnp.int32),
            "is_done": jnp.zeros((batch, beams), bool),
            "improvable": settings.max_new_tokens > 0,  # rows that only fill the batch decode nothing
            "step": jnp.zeros((), jnp.int32),
        }

        def searching(state):
            open_beams = ~(jnp.all(state["is_done"], axis=1) & stop_early)
            return (state["step"] < capacity) & jnp.any(state["improvable"] & open_beams)

        def search_one(state):
            step = state["step"]
            log_probs = jax.nn.log_softmax(state["logits"], axis=-1)
            flat_running = state["running"].reshape(batch * beams, capacity)
            log_probs = processed_scores(
                log_probs, beam_settings, beam_prompt_ids, flat_running, step, stop_ids, variant
            )
            scores = log_probs.reshape(batch, beams, vocab_size) + state["running_scores"][:, :, None]
            top_scores, top_indices = jax.lax.top_k(scores.reshape(batch, beams * vocab_size), kept)
            source_beams, top_tokens = top_indices // vocab_size, top_indices % vocab_size
            candidates = gather(state["running"], source_beams).at[:, :, step].set(top_tokens)
            ended = ends(top_tokens) | (step + 1 >= max_new_tokens)

            # The best `beams` candidates that go on
            running_scores = top_scores + ended * RULED_OUT
            _, next_indices = jax.lax.top_k(running_scores, beams)
            running = gather(candidates, next_indices)
            running_scores = gather(running_scores, next_indices)
            running_sources = gather(source_beams, next_indices)

            # The best `beams` hypotheses done so far, among those done before and the candidates of the top
            # `beams` that end here
            just_done = ended & (jnp.arange(kept) < beams)[None, :]
            done_scores = top_scores / ((step + 1).astype(jnp.float32) ** length_penalty)
            done_scores += (jnp.all(state["is_done"], axis=1, keepdims=True) & stop_early[:, None]) * RULED_OUT
            done_scores += ~state["improvable"][:, None] * RULED_OUT
            done_scores += ~just_done * RULED_OUT
            merged_scores = jnp.concatenate([state["done_scores"], done_scores], axis=1)
            _, best = jax.lax.top_k(merged_scores, beams)
            done = gather(jnp.concatenate([state["done"], candidates], axis=1), best)
            counts = jnp.concatenate([state["done_counts"], jnp.full((batch, kept), step + 1)], axis=1)
            is_done = gather(jnp.concatenate([state["is_done"], just_done], axis=1), best)
            done_scores = gather(merged_scores, best)

            # Whether a running beam may still beat the worst hypothesis done, as transformers estimates it
            hypothetical_length = jnp.where(never & (length_penalty[:, 0] > 0), max_new_tokens[:, 0], step + 1)
            best_possible = running_scores[:, 0] / (hypothetical_length.astype(jnp.float32) ** length_penalty[:, 0])
            worst_done = jnp.where(is_done, jnp.min(done_scores, axis=1, keepdims=True), RULED_OUT)
            improvable = state["improvable"] & jnp.any(best_possible[:, None] > worst_done, axis=1)
            improvable &= step + 1 < max_new_tokens[:, 0]

            # The cache follows each beam to the beam it continues, on the device
            sources = (jnp.arange(batch)[:, None] * beams + running_sources).reshape(-1)
            cache = jax.tree.map(lambda leaf: leaf[sources] if leaf.ndim else leaf, state["cache"])
            logits, cache = decode_step(running[:, :, step].reshape(-1, 1), cache)
            return {
                "logits": logits[:, 0].astype(jnp.float32),
                "cache": cache,
                "running": running,
                "running_scores": running_scores,
                "done": done,
                "done_scores": done_scores,
                "done_counts": gather(counts, best),
                "is_done": is_done,
                "improvable": improvable,
                "step": step + 1,
            }

        final = jax.lax.while_loop(searching, search_one, initial)
        return final["done"][:, 0], final["done_counts"][:, 0]


def shape_bucket(size: int, smallest: int) -> int:
    """The power of two at least `size` and `smallest`: shapes from a few buckets, so few compilations."""
    return max(smallest, 1 << (size - 1).bit_length())


def on_host(*arrays) -> list[np.ndarray]:
    # On several processes every one takes part in the decoding and gets the result.
    if all(array.is_fully_addressable for array in arrays):
        return [np.asarray(array) for array in arrays]
    return list(multihost_utils.process_allgather(arrays, tiled=True))


def left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of the prompts left-padded to a common length, in a batch of a few shapes (shape_bucket); rows
    that only fill the batch hold one token."""
    batch = shape_bucket(len(prompts), 1)
    prompt_length = shape_bucket(max(map(len, prompts)), 8)
    prompt_ids = np.zeros((batch, prompt_length), np.int32)
    prompt_mask = np.zeros((batch, prompt_length), bool)
    prompt_mask[len(prompts) :, -1] = True
    for row, ids in enumerate(prompts):
        prompt_ids[row, prompt_length - len(ids) :] = ids
        prompt_mask[row, prompt_length - len(ids) :] = True
    return prompt_ids, prompt_mask


def batch_settings(samplings: list[Sampling], batch: int, vocab_size: int) -> RowSettings:
    """The settings of the rows, and of rows that only fill the batch (they decode nothing)."""
    return RowSettings.of(samplings + [Sampling(max_new_tokens=0)] * (batch - len(samplings)), vocab_size)


def processing_variant(samplings: list[Sampling]) -> dict:
    """The static part of processed_scores' work for these rows: few values, so few compiled programs."""
    largest_ngram = max(s.no_repeat_ngram_size for s in samplings)
    return {
        "penalize": any(s.penalizes for s in samplings),
        "ngram": shape_bucket(largest_ngram, 1) if largest_ngram else 0,
    }


class DecodingBatch:
    """Prompts (non-empty lists of ids) decoded together, each by its own Sampling, some steps at a time: between
    calls of `advance` the caller reads each row's new tokens (to send them on) and may end rows. A row's tokens
    end with the end-of-text token where the model wrote it."""

    def __init__(self, sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]):
        self.sampler, self.params, self.rows = sampler, params, len(prompts)
        prompt_ids, prompt_mask = left_padded(prompts)
        settings = batch_settings(samplings, len(prompt_ids), sampler.vocab_size)
        self.variant = {
            "do_sample": any(s.temperature > 0 for s in samplings),
            "candidates": candidates_to_sort(samplings, sampler.vocab_size),
            **processing_variant(samplings),
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


def beam_search_rows(sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]) -> list[list[int]]:
    """The new tokens of each prompt's best hypothesis by beam search, all prompts with the same num_beams (each
    with its own other settings), in one compiled program."""
    (num_beams,) = {s.num_beams for s in samplings}
    prompt_ids, prompt_mask = left_padded(prompts)
    settings = batch_settings(samplings, len(prompt_ids), sampler.vocab_size)
    capacity = shape_bucket(max(s.max_new_tokens for s in samplings), 8)
    tokens, counts = sampler.beam_search(
        params,
        prompt_ids,
        prompt_mask,
        settings,
        num_beams=num_beams,
        capacity=capacity,
        **processing_variant(samplings),
    )
    tokens, counts = on_host(tokens, counts)
    return [tokens[row, : counts[row]].tolist() for row in range(len(prompts))]


def decode_rows(sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]) -> list[list[int]]:
    """The new tokens after each prompt, decoded together to the end (by beam search where the rows ask for it)."""
    if samplings[0].num_beams > 1:
        return beam_search_rows(sampler, params, prompts, samplings)
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
