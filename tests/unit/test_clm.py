"""run_clm_flax.py: the Flax GPT-2 against transformers' PyTorch GPT-2, the data pipeline, and the CLI."""

import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_DIR, script_environment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    Olmo2Config,
    PreTrainedTokenizerFast,
)

from flax_lm.data.packed import cached_blocks
from flax_lm.data.source import TextSource
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.training.train_state import abstract_model_params

REPO = str(REPO_DIR)
sys.path.insert(0, REPO)
import run_clm_flax  # noqa: E402

CORPUS = os.path.join(REPO, "tests", "fixtures", "en")
# A script started by a test: offline, PyTorch hidden as in a user's environment (conftest.script_environment).
OFFLINE_ENV = script_environment(TOKENIZERS_PARALLELISM="false")


def tiny_config(**overrides) -> GPT2Config:
    settings = dict(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**settings, **overrides})


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A Llama of GPT-2's tiny_config sizes, with grouped-query attention (2 heads, 1 key/value head)."""
    settings = dict(
        vocab_size=512, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return LlamaConfig(**{**settings, **overrides})


# One family of each model module besides Llama's at tiny_llama_config's sizes, with what sets its block apart: Gemma 3
# with a local layer whose window is shorter than the tests' sequences, QK-norm and scaled embeddings; OLMo 2 with its
# norms after attention and MLP and QK-norm.
TINY_FAMILY_CONFIGS = {
    "gemma3": lambda **overrides: Gemma3TextConfig(
        **{
            "vocab_size": 512,
            "max_position_embeddings": 64,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "intermediate_size": 64,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 0,
            **overrides,
        }
    ),  # fmt: skip
    "olmo2": lambda **overrides: Olmo2Config(
        **{
            "vocab_size": 512,
            "max_position_embeddings": 64,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "tie_word_embeddings": True,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 0,
            **overrides,
        }
    ),  # fmt: skip
}


def model_dir_with_config(tokenizer_dir, directory, model_type="gpt2", **overrides) -> str:
    """`directory` holding a copy of the 1000-token test tokenizer `tokenizer_dir` and a tiny config of its
    vocabulary and 64 positions (tiny_config for gpt2, tiny_llama_config for llama, TINY_FAMILY_CONFIGS for gemma3
    and olmo2), changed by `overrides` (a larger vocab_size for a tokenizer with tokens added, more positions)."""
    shutil.copytree(tokenizer_dir, directory, dirs_exist_ok=True)
    if model_type in TINY_FAMILY_CONFIGS:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        special_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        config = TINY_FAMILY_CONFIGS[model_type](**{"vocab_size": 1000, **special_ids, **overrides})
        config.save_pretrained(directory)
    elif model_type == "llama":
        tiny_llama_config(**{"vocab_size": 1000, **overrides}).save_pretrained(directory)
    else:
        tiny_config(**{"vocab_size": 1000, "n_positions": 64, **overrides}).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained on the English fixture corpus, and a tiny GPT-2 config."""
    return tiny_gpt2_dir_of_512_tokens(tmp_path_factory.mktemp("tiny-gpt2"))


def tiny_gpt2_dir_of_512_tokens(directory) -> str:
    """`directory` holding a byte-level BPE tokenizer of 512 tokens trained on the English fixture corpus (64
    positions), and tiny_config()."""
    directory = str(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([os.path.join(CORPUS, "train.txt")], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=64,
    ).save_pretrained(directory)
    tiny_config().save_pretrained(directory)
    return directory


def flax_logits(config, params, input_ids):
    model = gpt2.FlaxGPT2LMHeadModel(config)
    return np.asarray(model.apply({"params": params}, jnp.asarray(input_ids)))


def abstract_params(config):
    model = gpt2.FlaxGPT2LMHeadModel(config)
    return abstract_model_params(model, jnp.zeros((1, 8), jnp.int32))


def test_texts_are_joined_with_eos_packed_into_blocks_and_cached(model_dir, tmp_path, caplog):
    import datasets

    texts = [f"Line number {i} of a small test file." for i in range(50)]
    data_file = tmp_path / "texts.txt"
    data_file.write_text("\n".join(texts) + "\n")
    dataset = datasets.load_dataset(
        "text", data_files=str(data_file), cache_dir=str(tmp_path / "cache"), split="train", keep_linebreaks=True
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def pack(block_size):
        cache_dir, rows = str(tmp_path / "cache"), run_clm_flax.tokenized_rows
        return cached_blocks(dataset, "train", rows, tokenizer, block_size, cache_dir, TextSource(), framing="grouped")

    blocks = pack(16)
    expected = [token for text in texts for token in tokenizer(text + "\n")["input_ids"] + [tokenizer.eos_token_id]]
    expected = np.array(expected[: len(expected) // 16 * 16]).reshape(-1, 16)
    np.testing.assert_array_equal(blocks, expected)

    caplog.set_level("INFO", logger="flax_lm.data.packed")
    cached = pack(16)
    assert "Loading packed train blocks from cache" in caplog.text, "the second call should read the cached blocks"
    np.testing.assert_array_equal(cached, expected)
    other_block_size = pack(8)
    assert other_block_size.shape[1] == 8


def test_evaluation_batches_cover_every_block_once_with_padding_masked():
    blocks = np.arange(7 * 4).reshape(7, 4)
    batches = list(run_clm_flax.eval_batches(blocks, global_batch_size=3))
    assert len(batches) == 3
    assert all(batch["input_ids"].shape == (3, 4) for batch in batches)
    real_rows = np.concatenate([batch["input_ids"][batch["weights"][:, 0] == 1] for batch in batches])
    np.testing.assert_array_equal(real_rows, blocks)
    assert batches[-1]["weights"].sum() == 4  # one real block, two padding rows


def test_training_batches_follow_the_seed_and_differ_between_epochs():
    blocks = np.arange(10 * 2).reshape(10, 2)
    first = [batch["input_ids"] for batch in run_clm_flax.train_batches(blocks, 4, seed=3, epoch=0)]
    again = [batch["input_ids"] for batch in run_clm_flax.train_batches(blocks, 4, seed=3, epoch=0)]
    next_epoch = [batch["input_ids"] for batch in run_clm_flax.train_batches(blocks, 4, seed=3, epoch=1)]
    assert len(first) == 2
    np.testing.assert_array_equal(np.concatenate(first), np.concatenate(again))
    assert not np.array_equal(np.concatenate(first), np.concatenate(next_epoch))


# ----------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------


def run_script(arguments, env=None, check=True):
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "run_clm_flax.py"), *arguments],
        capture_output=True,
        text=True,
        env=env or OFFLINE_ENV,
        cwd=REPO,
        timeout=600,
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def training_arguments(model_dir, output_dir, *extra):
    return [
        "--output_dir",
        str(output_dir),
        "--config_name",
        model_dir,
        "--tokenizer_name",
        model_dir,
        "--train_file",
        os.path.join(CORPUS, "train.txt"),
        "--validation_file",
        os.path.join(CORPUS, "validation.txt"),
        "--block_size",
        "32",
        "--seed",
        "0",
        *extra,
    ]


def scalars(output_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(str(output_dir), "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--train_file", "README.md"], "unsupported extension"),
        (["--train_file", "no-such-dir/*.txt"], "matches no file"),
        (["--text_column_name", "body"], "no column 'body'"),
        (["--block_size", "128"], "exceeds the model's 64 positions"),
        (["--per_device_train_batch_size", "0"], "must be at least 1"),
        (["--max_steps", "-1", "--num_train_epochs", "0"], "no training steps"),
        (["--per_device_train_batch_size", "100000"], "lower --per_device_train_batch_size or --block_size"),
        (["--push_to_hub"], "--push_to_hub is not supported"),
        (["--learning_rte", "1e-3"], "unknown argument --learning_rte"),
        (
            ["--load_best_model_at_end"],
            "--metric_for_best_model compares the evaluations of training: add --do_train ",
        ),
        (
            ["--do_eval", "--load_best_model_at_end", "--save_steps", "3", "--eval_steps", "2"],
            "--save_steps 3 must be a multiple of --eval_steps 2",
        ),
        (["--do_eval", "--greater_is_better"], "--greater_is_better applies to --metric_for_best_model"),
    ],
)
def test_bad_input_is_reported_as_a_usage_error(arguments, message, model_dir, tmp_path, monkeypatch):
    arguments = training_arguments(model_dir, tmp_path / "out", "--do_train", *arguments)
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *arguments])
    with pytest.raises(run_clm_flax.UsageError, match=message):
        run_clm_flax.main()


def test_config_of_another_model_type_is_refused(model_dir, tmp_path, monkeypatch):
    from transformers import RobertaConfig

    config_dir = tmp_path / "roberta"
    RobertaConfig(vocab_size=512).save_pretrained(str(config_dir))
    arguments = training_arguments(model_dir, tmp_path / "out", "--do_train", "--config_name", str(config_dir))
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *arguments])
    with pytest.raises(run_clm_flax.UsageError, match="has no model of type 'roberta': it runs gpt2, llama"):
        run_clm_flax.main()


def test_tokenizer_larger_than_the_vocabulary_is_refused(model_dir, tmp_path, monkeypatch):
    config_dir = tmp_path / "small-vocab"
    tiny_config(vocab_size=100).save_pretrained(str(config_dir))
    arguments = training_arguments(model_dir, tmp_path / "out", "--do_train", "--config_name", str(config_dir))
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *arguments])
    with pytest.raises(
        run_clm_flax.UsageError, match="the tokenizer has 512 tokens but the config's vocab_size is 100"
    ):
        run_clm_flax.main()


def test_refuses_to_train_into_a_directory_with_files(model_dir, tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "notes.txt").write_text("keep me")
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *training_arguments(model_dir, output_dir, "--do_train")])
    with pytest.raises(run_clm_flax.UsageError, match="--overwrite_output_dir"):
        run_clm_flax.main()
    assert (output_dir / "notes.txt").read_text() == "keep me"
    assert os.listdir(output_dir) == ["notes.txt"]
