"""Generating text with an encoder-decoder (T5, flax_lm/models/t5): each source encoded once, the decoder's
cross-attention keys and values computed once from it, then the target decoded token by token over the decoder's
cache from the decoder start token, all in one compiled program. Each row by its own Sampling (greedy at temperature
0, or drawn, with transformers' logit processors over the target so far, as its generate applies them to an
encoder-decoder's decoder input), or by beam search (the causal models' BeamSearch of sampling.py, over the decoder
from its start token: the beams of a source share its encoding)."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.errors import UsageError
from flax_lm.generation.sampling import (
    VARIANT_NAMES,
    BeamSearch,
    RowSettings,
    Sampling,
    batch_settings,
    candidates_to_sort,
    left_padded,
    next_tokens,
    on_host,
    processed_scores,
    processing_variant,
    shape_bucket,
)


class TargetState(flax.struct.PyTreeNode):
    """What the decoding loop carries from one target token to the next."""

    cache: object  # the model's decoder cache (flax_lm.models.t5.model.DecoderCache)
    last_token: jax.Array  # (batch,) int32
    tokens: jax.Array  # (batch, capacity) int32: the new tokens so far, then padding
    counts: jax.Array  # (batch,) int32: new tokens per row, the end-of-text token included
    finished: jax.Array  # (batch,) bool
    step: jax.Array  # int32: the column of `tokens` the next token goes to


@dataclass(frozen=True)
class Seq2SeqDecoding:
    """The compiled decodings of an encoder-decoder, each (params, source_ids, source_mask, settings, *, capacity,
    **static) -> (tokens (batch, capacity), counts (batch,)): `sample` token by token (static: the variant of
    VARIANT_NAMES), `beam_search` to each source's best hypothesis (static: num_beams, penalize, ngram)."""

    sample: Callable
    beam_search: Callable


def make_seq2seq_generate(model, eos_token_id: int | list[int] | None) -> Seq2SeqDecoding:
    """The compiled decoding of the encoder-decoder `model` (its encode, start_decoding and decode methods, and the
    decoder_start_token_id it starts from), each row ending at the first of `eos_token_id` or at its max_new_tokens.
    Compiled once per (batch, source length, capacity) and static settings; every other setting of a row is data."""
    stop_ids = [] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    pad = max(stop_ids[0], 0) if stop_ids else 0  # what finished rows write

    @partial(jax.jit, static_argnames=("capacity", *VARIANT_NAMES))
    def sample(params, source_ids, source_mask, settings: RowSettings, *, capacity: int, **variant):
        variables = {"params": params}
        encoder_output = model.apply(variables, source_ids, source_mask, method="encode")
        cache = model.apply(variables, encoder_output, source_mask, capacity, method="start_decoding")
        batch = source_ids.shape[0]
        # The decoder's input so far, as transformers' processors read it: the start token, then the new tokens.
        start_ids = jnp.full((batch, 1), model.decoder_start_token_id, jnp.int32)

        def row_key(seed, prompt_index, step):
            return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), prompt_index), step)

        def not_done(state: TargetState):
            return (state.step < capacity) & ~jnp.all(state.finished)

        def decode_one(state: TargetState):
            logits, cache = model.apply(variables, state.last_token[:, None], state.cache, method="decode")
            scores = processed_scores(logits[:, 0], settings, start_ids, state.tokens, state.step, stop_ids, variant)
            keys = jax.vmap(row_key, in_axes=(0, 0, None))(settings.seed, settings.prompt_index, state.step)
            token = next_tokens(
                scores,
                keys,
                settings.temperature,
                settings.top_k,
                settings.top_p,
                variant["do_sample"],
                variant["candidates"],
            )
            token = jnp.where(state.finished, pad, token)
            counts = state.counts + ~state.finished
            return state.replace(
                cache=cache,
                last_token=token,
                tokens=state.tokens.at[:, state.step].set(token),
                counts=counts,
                finished=state.finished
                | jnp.isin(token, jnp.asarray(stop_ids or [-1]))
                | (counts >= settings.max_new_tokens),
                step=state.step + 1,
            )

        state = TargetState(
            cache=cache,
            last_token=start_ids[:, 0],
            tokens=jnp.full((batch, capacity), pad, jnp.int32),
            counts=jnp.zeros((batch,), jnp.int32),
            finished=settings.max_new_tokens <= 0,  # the rows that only fill the batch
            step=jnp.zeros((), jnp.int32),
        )
        final = jax.lax.while_loop(not_done, decode_one, state)
        return final.tokens, final.counts

    @partial(jax.jit, static_argnames=("num_beams", "capacity", "penalize", "ngram"))
    def beam_search(params, source_ids, source_mask, settings, *, num_beams: int, capacity: int, **variant):
        variables = {"params": params}
        encoder_output = model.apply(variables, source_ids, source_mask, method="encode")
        cache = model.apply(variables, encoder_output, source_mask, capacity + 1, method="start_decoding")
        # The decoder's input before the new tokens, as transformers' processors read it: the start token.
        start_ids = jnp.full((source_ids.shape[0], 1), model.decoder_start_token_id, jnp.int32)
        logits, cache = model.apply(variables, start_ids, cache, method="decode")

        def decode_step(tokens, cache):
            return model.apply(variables, tokens, cache, method="decode")

        search = BeamSearch(decode_step, stop_ids, pad, num_beams, capacity, variant)
        return search(logits[:, 0], cache, settings, start_ids)

    return Seq2SeqDecoding(sample, beam_search)


def decode_sources(
    decoding: Seq2SeqDecoding, params, sources: list[list[int]], samplings: list[Sampling], vocab_size: int
):
    """The new tokens for each source (a non-empty list of ids, its end-of-text token included as the tokenizer puts
    it), ending with the end-of-text token where the model wrote it; by beam search where the samplings ask for it,
    all with the same num_beams."""
    num_beams = {sampling.num_beams for sampling in samplings}
    if len(num_beams) > 1:
        raise UsageError(f"sources decoded together need the same num_beams, not {sorted(num_beams)}")
    # Left-padded, as the causal models' prompts: T5's relative positions see only distances, and the mask the padding.
    source_ids, source_mask = left_padded(sources)
    settings = batch_settings(samplings, len(source_ids), vocab_size)
    capacity = shape_bucket(max(s.max_new_tokens for s in samplings), 8)
    if samplings[0].num_beams > 1:
        static = {"num_beams": samplings[0].num_beams, **processing_variant(samplings)}
        decode = decoding.beam_search
    else:
        static = {
            "do_sample": any(s.temperature > 0 for s in samplings),
            "candidates": candidates_to_sort(samplings, vocab_size),
            **processing_variant(samplings),
        }
        decode = decoding.sample
    tokens, counts = on_host(*decode(params, source_ids, source_mask, settings, capacity=capacity, **static))
    return [tokens[row, : counts[row]].tolist() for row in range(len(sources))]


def generate_seq2seq_ids(
    decoding: Seq2SeqDecoding,
    params,
    sources: list[list[int]],
    vocab_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[list[int]]:
    """decode_sources with the same settings for every source. Temperature 0 is greedy decoding."""
    samplings = [Sampling(max_new_tokens, temperature, top_k, top_p, seed, row) for row in range(len(sources))]
    return decode_sources(decoding, params, sources, samplings, vocab_size)
