"""generate_flax.py and the cached sampler of flax_lm.generation.sampling it decodes with: transformers' greedy ids,
cached logits equal to a full recompute, seeded sampling, stopping at the end-of-text token, the command line and the
server."""

import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import REPO_DIR, script_environment
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from flax_lm.command_line.arguments import parse_training_arguments
from flax_lm.errors import UsageError
from flax_lm.generation import sampling
from flax_lm.models.huggingface import ModelLoading

sys.path.insert(0, str(REPO_DIR))
import generate_flax  # noqa: E402

PROMPTS = ["The gardener", "In the morning the old house was quiet and", "A"]
# A script started by a test: offline, PyTorch hidden as in a user's environment (conftest.script_environment).
OFFLINE_ENV = script_environment(TOKENIZERS_PARALLELISM="false")


def torch_greedy_ids(model_dir, prompt_ids, max_new_tokens):
    torch_model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    input_ids = torch.tensor([prompt_ids])
    output = torch_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=torch_model.config.eos_token_id,
    )
    return output[0, len(prompt_ids) :].tolist()


def test_greedy_ids_equal_transformers_generate_for_a_batch_of_different_lengths(generator, tiny_gpt2_dir):
    prompt_ids = generator.encode(PROMPTS, 20, "prompt")
    assert len({len(ids) for ids in prompt_ids}) == 3
    ours = sampling.generate_ids(generator.sampler, generator.params, prompt_ids, 20)
    for ids, new_ids in zip(prompt_ids, ours):
        expected = torch_greedy_ids(tiny_gpt2_dir, ids, 20)
        assert new_ids == expected
        assert len(set(new_ids)) > 3  # the model writes something, not one token over and over


@pytest.fixture(scope="module")
def tiny_llama_dir(llama_tokenizer_dir, tmp_path_factory):
    """A tiny random Llama (grouped-query attention) saved by transformers beside the Llama test tokenizer, its
    weights drawn wide as the tiny GPT-2's are."""
    directory = shutil.copytree(llama_tokenizer_dir, tmp_path_factory.mktemp("generate") / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_gemma2_dir(llama_tokenizer_dir, tmp_path_factory):
    """A tiny random Gemma 2 (the other decoder module: a sliding window shorter than the prompts and new tokens,
    soft-capped attention and logits) saved by transformers beside the Llama test tokenizer, its weights drawn wide
    enough that its texts vary and some rows end early."""
    directory = shutil.copytree(llama_tokenizer_dir, tmp_path_factory.mktemp("generate") / "tiny-gemma2")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = Gemma2Config(
        vocab_size=len(tokenizer), max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, initializer_range=1.0,
        sliding_window=6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def generators(generator, tiny_gpt2_dir, tiny_llama_dir, tiny_gemma2_dir):
    """(export directory, Generator) of the tiny GPT-2, Llama and Gemma 2, by model type."""
    found = {"gpt2": (tiny_gpt2_dir, generator)}
    for model_type, directory in (("llama", tiny_llama_dir), ("gemma2", tiny_gemma2_dir)):
        model, params, tokenizer = generate_flax.load_model(ModelLoading(str(directory)))
        found[model_type] = (directory, generate_flax.Generator(model, params, tokenizer, batch_size=4))
    return found


# Each of transformers' settings alone and all together, with greedy decoding; the end of text is a token the models
# write (see test_decoding_settings_give_the_tokens_of_transformers_generate), so that beams and rows end early. The
# rows of each group share one batch, each by its own settings: two compiled programs per model.
DECODING_SETTINGS = {
    "greedy": [dict(repetition_penalty=1.8), dict(no_repeat_ngram_size=2), dict(min_new_tokens=10)],
    "beam search": [
        dict(num_beams=3),
        dict(num_beams=3, length_penalty=0.5, early_stopping=True),
        dict(num_beams=3, length_penalty=2.0, early_stopping="never"),
        dict(num_beams=3, repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=6),
    ],
}


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "gemma2"])
def test_decoding_settings_give_the_tokens_of_transformers_generate(generators, model_type):
    model_dir, generator = generators[model_type]
    prompt_ids = generator.encode(PROMPTS, 16, "prompt")
    greedy = sampling.generate_ids(generator.sampler, generator.params, prompt_ids, 16)
    # The end of text: a token greedy decoding writes early in some row, not in all
    end_of_text = next(token for token in greedy[1][2:] if not all(token in row for row in greedy))
    sampler = sampling.make_sampler(generator.model, end_of_text)
    torch_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ended_early = 0
    for group in DECODING_SETTINGS.values():
        rows = [(ids, settings) for settings in group for ids in prompt_ids]
        samplings = [sampling.Sampling(16, prompt_index=row, **settings) for row, (_, settings) in enumerate(rows)]
        ours = sampling.decode_rows(sampler, generator.params, [ids for ids, _ in rows], samplings)
        for (ids, settings), new_ids in zip(rows, ours):
            expected = torch_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=16,
                do_sample=False, eos_token_id=end_of_text, pad_token_id=end_of_text, **settings,
            )[0, len(ids) :].tolist()  # fmt: skip
            assert new_ids == expected, settings
            ended_early += len(new_ids) < 16
    assert ended_early >= 3  # the end of text mattered


def test_stop_strings_end_the_text_where_transformers_stops(generators, tiny_gpt2_dir):
    _, generator = generators["gpt2"]
    plain = generator.generate(PROMPTS, sampling.Sampling(16))
    # A piece of each text as the stop string, and one never written
    stop = [result["text"][6:9] for result in plain[1:]] + ["never written"]
    prompt_ids = generator.encode(PROMPTS, 16, "prompt")
    samplings = [sampling.Sampling(16, prompt_index=row) for row in range(3)]
    ended = generator.decode(prompt_ids, samplings, stop)
    torch_model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).eval()
    for ids, result, row in zip(prompt_ids, ended, plain):
        expected = torch_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=16,
            do_sample=False, stop_strings=stop, tokenizer=generator.tokenizer, pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
        assert result.ids == expected and result.new_tokens == len(expected)
        if result.finish_reason == "stop":
            position = min(p for p in map(row["text"].find, stop) if p >= 0)
            assert result.text == row["text"][:position]
    assert [result.finish_reason for result in ended].count("stop") >= 2


def test_sampling_draws_from_the_distribution_of_transformers_processors_in_their_order():
    from transformers import generation

    vocab_size, draws = 8, 4000
    logits = np.random.default_rng(0).normal(0, 0.8, vocab_size).astype(np.float32)
    prompt, new = [2, 3, 5], [2]  # the bigram (2, 3) was written: after 2, 3 may not come again
    settings = dict(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.5, no_repeat_ngram_size=2)
    samplings = [sampling.Sampling(8, min_new_tokens=3, **settings)] * draws
    processors = generation.LogitsProcessorList(
        [
            generation.RepetitionPenaltyLogitsProcessor(1.5),
            generation.NoRepeatNGramLogitsProcessor(2),
            generation.MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos_token_id=7),
            generation.TemperatureLogitsWarper(0.7),
            generation.TopKLogitsWarper(5),
            generation.TopPLogitsWarper(0.9),
        ]
    )
    expected_scores = processors(torch.tensor([prompt + new]), torch.tensor(logits)[None])
    expected = torch.softmax(expected_scores, dim=-1)[0].numpy()

    row_settings = sampling.RowSettings.of(samplings, vocab_size)
    scores = sampling.processed_scores(
        jnp.asarray(np.tile(logits, (draws, 1))), row_settings, jnp.asarray([prompt] * draws),
        jnp.asarray([new + [0, 0, 0]] * draws), 1, [7], {"penalize": True, "ngram": 2},
    )  # fmt: skip
    row_keys = jax.random.split(jax.random.key(0), draws)
    tokens = sampling.next_tokens(
        scores, row_keys, row_settings.temperature, row_settings.top_k, row_settings.top_p, True, vocab_size
    )
    frequencies = np.bincount(np.asarray(tokens), minlength=vocab_size) / draws
    assert set(np.flatnonzero(frequencies)) == set(np.flatnonzero(expected))  # the same tokens ruled out
    assert expected[3] == expected[7] == 0 and (expected > 0).sum() >= 3
    tolerance = 4 * np.sqrt(expected * (1 - expected) / draws) + 1e-9
    assert np.all(np.abs(frequencies - expected) <= tolerance), (frequencies, expected)


def test_training_samples_are_decoded_by_the_sample_flags(generator, monkeypatch):
    import run_clm_flax

    flags = ["--sample_temperature", "0", "--sample_num_beams", "2", "--sample_repetition_penalty", "1.3"]
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", "--output_dir", "unused", "--sample_tokens", "8", *flags])
    arguments = (run_clm_flax.ModelArguments, run_clm_flax.DataTrainingArguments, run_clm_flax.TrainingArguments)
    _, _, training_args, _ = parse_training_arguments(*arguments)
    sample_sampling = run_clm_flax.sample_sampling(training_args)
    texts = run_clm_flax.sample_texts(
        generator.sampler, generator.params, generator.tokenizer, PROMPTS[:2], sample_sampling, 64
    )
    prompt_ids = generator.encode(PROMPTS[:2], 8, "prompt")
    expected = generator.decode(prompt_ids, [sampling.Sampling(8, num_beams=2, repetition_penalty=1.3)] * 2)
    assert texts == [prompt + ended.text for prompt, ended in zip(PROMPTS, expected)]

    monkeypatch.setattr(
        sys, "argv", ["run_clm_flax.py", "--output_dir", "unused", "--model_type", "gpt2", "--sample_num_beams", "2"]
    )
    model_args, data_args, training_args, _ = parse_training_arguments(*arguments)
    with pytest.raises(UsageError, match=re.escape("--sample_num_beams 2 with --sample_temperature 1")):
        run_clm_flax.check_arguments(model_args, data_args, training_args)


def test_cached_logits_equal_a_full_recompute(generator):
    model, params = generator.model, generator.params
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    new_tokens = [[20, 21, 22], [30, 31, 32]]
    prompt_length = 8
    prompt_ids = np.zeros((2, prompt_length), np.int32)
    prompt_mask = np.zeros((2, prompt_length), bool)
    for row, ids in enumerate(rows):
        prompt_ids[row, prompt_length - len(ids) :], prompt_mask[row, prompt_length - len(ids) :] = ids, True
    cache = model.empty_cache(jnp.asarray(prompt_mask), 3)
    logits, cache = model.apply({"params": params}, jnp.asarray(prompt_ids), cache=cache)
    cached = [np.asarray(logits[:, -1])]
    for step in range(3):
        logits, cache = model.apply({"params": params}, jnp.asarray([[row[step]] for row in new_tokens]), cache=cache)
        cached.append(np.asarray(logits[:, 0]))
    for row, ids in enumerate(rows):
        full = model.apply({"params": params}, jnp.asarray([ids + new_tokens[row]]))[0]
        recomputed = np.asarray(full[len(ids) - 1 :])  # the logits after the prompt and after each new token
        np.testing.assert_allclose(np.stack([step[row] for step in cached]), recomputed, atol=1e-5, rtol=1e-5)


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(generator):
    prompt_ids = generator.encode(PROMPTS, 16, "prompt")

    def generate(**settings):
        return sampling.generate_ids(generator.sampler, generator.params, prompt_ids, 16, **settings)

    greedy = generate()
    sampled = generate(temperature=1.0, seed=3)
    assert sampled == generate(temperature=1.0, seed=3)
    assert sampled != generate(temperature=1.0, seed=4)
    assert sampled != greedy
    assert generate(temperature=1.0, top_k=1, seed=3) == greedy
    assert generate(temperature=1.0, top_p=1e-6, seed=3) == greedy
    # A row's draws do not depend on the rows beside it.
    alone = sampling.generate_ids(generator.sampler, generator.params, prompt_ids[:1], 16, temperature=1.0, seed=3)
    assert alone[0] == sampled[0]


def test_each_row_decodes_by_its_own_settings_as_it_would_alone(generator):
    prompt_ids = generator.encode(PROMPTS + ["The"], 16, "prompt")
    samplings = [
        sampling.Sampling(16),
        sampling.Sampling(9, temperature=0.9, top_k=20, seed=7),
        sampling.Sampling(12, temperature=1.2, top_p=0.8, seed=7, prompt_index=1),
        sampling.Sampling(5, temperature=1.0, seed=2),
    ]
    together = sampling.decode_rows(generator.sampler, generator.params, prompt_ids, samplings)
    for ids, row_sampling, new_ids in zip(prompt_ids, samplings, together):
        assert new_ids == sampling.decode_rows(generator.sampler, generator.params, [ids], [row_sampling])[0]
        assert len(new_ids) == row_sampling.max_new_tokens


def test_decoding_in_chunks_gives_the_tokens_of_one_go(generator):
    prompt_ids = generator.encode(PROMPTS, 16, "prompt")
    samplings = [
        sampling.Sampling(16 - 3 * row, temperature=1.0, top_k=30, seed=1, prompt_index=row) for row in range(3)
    ]
    batch = sampling.DecodingBatch(generator.sampler, generator.params, prompt_ids, samplings)
    chunks = [batch.advance(steps) for steps in (0, 5, 5, 5, 5)]
    joined = [sum(row_chunks, []) for row_chunks in zip(*chunks)]
    assert batch.finished.all() and chunks[0] == [row[:1] for row in joined]  # the first look: each row's first token
    assert joined == sampling.decode_rows(generator.sampler, generator.params, prompt_ids, samplings)


def test_ended_rows_decode_no_more_and_the_others_go_on(generator):
    prompt_ids = generator.encode(PROMPTS, 16, "prompt")
    samplings = [sampling.Sampling(16, prompt_index=row) for row in range(3)]
    batch = sampling.DecodingBatch(generator.sampler, generator.params, prompt_ids, samplings)
    first = batch.advance(3)
    rest = batch.advance(16, ended=[1])
    assert rest[1] == [] and batch.finished.tolist() == [True, True, True]
    full = sampling.decode_rows(generator.sampler, generator.params, prompt_ids, samplings)
    assert [first[0] + rest[0], first[2] + rest[2]] == [full[0], full[2]]


def test_top_k_and_top_p_draw_only_from_the_most_likely_tokens():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]] * 2000))
    row_keys = jax.random.split(jax.random.key(0), 2000)

    def drawn(top_k, top_p):
        rows = jnp.ones(2000)
        tokens = sampling.next_tokens(logits, row_keys, rows, rows.astype(int) * top_k, rows * top_p, True, 5)
        return set(np.asarray(tokens).tolist())

    assert drawn(0, 1.0) == {0, 1, 2, 3, 4}
    assert drawn(2, 1.0) == {1, 3}
    assert drawn(0, 0.75) == {1, 3, 4}  # 0.4 + 0.3 < 0.75: the third most likely is needed too
    assert drawn(2, 0.3) == {1}


def test_bfloat16_loads_bfloat16_weights_and_decodes_like_float32(generator, tiny_gpt2_dir):
    model, params, tokenizer = generate_flax.load_model(ModelLoading(str(tiny_gpt2_dir)), dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    bfloat16_generator = generate_flax.Generator(model, params, tokenizer, batch_size=4)
    prompt_ids = generator.encode(PROMPTS, 4, "prompt")
    float32_ids = sampling.generate_ids(generator.sampler, generator.params, prompt_ids, 4)
    assert sampling.generate_ids(bfloat16_generator.sampler, params, prompt_ids, 4) == float32_ids


def test_generation_stops_at_the_end_of_text_token(generator):
    prompt_ids = generator.encode(PROMPTS, 12, "prompt")
    greedy = sampling.generate_ids(generator.sampler, generator.params, prompt_ids, 12)
    stop_token = greedy[1][4]  # as if the fifth token the second prompt gets were the end of the text
    sampler = sampling.make_sampler(generator.model, stop_token)
    stopped = sampling.generate_ids(sampler, generator.params, prompt_ids, 12)
    for full, short in zip(greedy, stopped):
        end = full.index(stop_token) + 1 if stop_token in full else len(full)
        assert short == full[:end]
    assert len(stopped[1]) == 5 and stopped[1][-1] == stop_token


def test_prompt_too_long_for_the_model_is_refused_in_one_line(tiny_gpt2_dir, monkeypatch):
    arguments = ["--model_name_or_path", str(tiny_gpt2_dir), "--prompt", "word " * 70]
    monkeypatch.setattr(sys, "argv", ["generate_flax.py", *arguments])
    with pytest.raises(UsageError, match=r"--prompt 1 has .*exceeds the model's 64 positions"):
        generate_flax.main()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--prompt", "A", "--top_p", "0"], "--top_p must be in (0, 1]"),
        (["--prompt", "A", "--max_new_tokens", "0"], "--max_new_tokens must be at least 1"),
        (["--prompt_file", "missing.txt"], "cannot read --prompt_file missing.txt"),
        (["--serve", "--prompt", "A"], "--serve takes its prompts from HTTP requests"),
        (["--serve", "--max_queued_requests", "0"], "--max_queued_requests must be at least 1"),
        (["--prompt", "A", "--seed", "-1"], "--seed must be in [0, 2**31)"),
        (["--prompt", "A", "--num_beams", "2", "--temperature", "1"], "--num_beams 2 with --temperature 1"),
        (["--prompt", "A", "--num_beams", "2", "--stop", "."], "--num_beams with --stop"),
        (
            ["--serve", "--repetition_penalty", "1.2"],
            "--serve with --repetition_penalty: the server decodes each request by its own",
        ),
        (["--prompt", "A", "--min_new_tokens", "60"], "--min_new_tokens 60 exceeds --max_new_tokens 50"),
        (["--prompt", "A", "--repetition_penalty", "0"], "--repetition_penalty must be positive"),
        (["--prompt", "A", "--no_repeat_ngram_size", "-1"], "--no_repeat_ngram_size must be 0 (off) or positive"),
        (
            ["--model_name_or_path", "./no-such-model", "--prompt", "A"],
            "--model_name_or_path ./no-such-model: no such",
        ),
    ],
)
def test_bad_arguments_are_reported_as_a_usage_error(tiny_gpt2_dir, arguments, message, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["generate_flax.py", "--model_name_or_path", str(tiny_gpt2_dir), *arguments])
    with pytest.raises(UsageError, match=re.escape(message)):
        generate_flax.main()
