"""create_config.py run as a user runs it: the config it writes beside the tokenizer, and its refusals, each one line
on stderr with nothing written."""

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_create_config import torch_parameter_count
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
)


def assert_single_error_line(result, *expected_words):
    """A bad setting ends with status 2 and one line on stderr that says what is wrong, without a traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for word in expected_words:
        assert word in lines[0]


def printed_parameter_count(stdout):
    return int(re.search(r"parameters: ([\d,]+)", stdout).group(1).replace(",", ""))


def test_gpt2_config_goes_next_to_the_tokenizer_and_matches_it(run_tool, gpt2_model_dir):
    result = run_tool("create_config.py", "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_model_dir)

    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(gpt2_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_model_dir)
    assert isinstance(config, GPT2Config)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (2, 128, 2, 256)
    assert config.vocab_size == len(tokenizer) == 1000
    assert config.bos_token_id == config.eos_token_id == tokenizer.eos_token_id == 0
    assert config.architectures == ["GPT2LMHeadModel"]
    assert type(tokenizer).__name__ == "GPT2Tokenizer"  # the tokenizer still loads from the model directory
    assert printed_parameter_count(result.stdout) == torch_parameter_count(GPT2LMHeadModel(config))


def test_roberta_config_rounds_the_vocab_up_and_takes_the_special_ids(run_tool, roberta_model_dir):
    result = run_tool(
        "create_config.py",
        "--preset", "roberta-tiny",
        "--tokenizer_dir", roberta_model_dir,
        "--pad_vocab_to_multiple_of", 128,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(roberta_model_dir)
    assert isinstance(config, RobertaConfig)
    assert config.vocab_size == 1024  # the tokenizer's 1000, rounded up
    assert (config.bos_token_id, config.pad_token_id, config.eos_token_id) == (0, 1, 2)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 128, 512)
    assert config.max_position_embeddings == 258
    assert config.type_vocab_size == 1
    assert config.architectures == ["RobertaForMaskedLM"]
    assert printed_parameter_count(result.stdout) == torch_parameter_count(RobertaForMaskedLM(config))


def test_preset_and_overrides_from_a_json_arguments_file_without_a_tokenizer(run_tool, tmp_path):
    arguments = {
        "preset": "gpt2-mini",
        "output_dir": str(tmp_path / "model"),
        "overrides": ["n_layer=3", "resid_pdrop=0", "activation_function=gelu", "hidden_size=192"],
    }
    (tmp_path / "arguments.json").write_text(json.dumps(arguments))

    result = run_tool("create_config.py", tmp_path / "arguments.json")

    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(tmp_path / "model")
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (3, 192, 4, 512)
    assert config.resid_pdrop == 0.0
    assert config.activation_function == "gelu"
    assert config.vocab_size == 50257  # the preset's, as there is no tokenizer


@pytest.fixture(scope="module")
def refusals(run_tool, gpt2_tokenizer_dir, tmp_path_factory):
    """The refused settings its page names, each run as a user runs it, side by side (most of each run is Python
    starting up). Returns the scratch directory they ran in and their CompletedProcess by name.
    """
    scratch = tmp_path_factory.mktemp("refusals")
    shutil.copytree(gpt2_tokenizer_dir, scratch / "gpt2-vocab")
    cases = {
        "heads": ["--preset", "roberta-mini", "--output_dir", scratch / "heads", "--set", "num_attention_heads=3"],
        "vocab": ["--preset", "gpt2-tiny", "--tokenizer_dir", scratch / "gpt2-vocab", "--set", "vocab_size=999"],
        "unknown key": ["--preset", "gpt2-tiny", "--output_dir", scratch / "unknown", "--set", "n_layers=4"],
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_tool, "create_config.py", *args) for name, args in cases.items()}
    return scratch, {name: future.result() for name, future in futures.items()}


def test_hidden_size_not_divisible_by_heads_is_refused(refusals):
    scratch, results = refusals

    assert_single_error_line(results["heads"], "hidden size 256", "3 attention heads")
    assert not (scratch / "heads" / "config.json").exists()


def test_vocab_smaller_than_the_tokenizer_is_refused(refusals):
    scratch, results = refusals

    assert_single_error_line(results["vocab"], "vocab_size 999", "1000")
    assert not (scratch / "gpt2-vocab" / "config.json").exists()


def test_unknown_key_is_refused_with_close_matches(refusals):
    scratch, results = refusals

    assert_single_error_line(results["unknown key"], "n_layers", "did you mean n_layer")
    assert not (scratch / "unknown" / "config.json").exists()
