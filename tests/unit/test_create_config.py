"""Behaviour of create_config.py: the config it writes, the parameter count it prints, and the settings it refuses."""

import importlib.util
import json
import re

import pytest
from conftest import REPO_DIR
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaForMaskedLM,
)

from flax_lm.command_line import tool_arguments
from flax_lm.models import config_class


def load_create_config_module():
    spec = importlib.util.spec_from_file_location("create_config", REPO_DIR / "create_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


create_config = load_create_config_module()


def torch_parameter_count(model):
    return sum(parameter.numel() for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# What is written
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Parameter count
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2-tiny", {"vocab_size": 1000}),
        ("gpt2-tiny", {"vocab_size": 1000, "tie_word_embeddings": False, "n_inner": 300}),
        ("roberta-tiny", {"vocab_size": 1000}),
        ("roberta-tiny", {"vocab_size": 1000, "tie_word_embeddings": False, "type_vocab_size": 2}),
        ("qwen3-tiny", {"vocab_size": 1000}),
        ("gemma3-tiny", {"vocab_size": 1000}),
        ("olmo2-tiny", {"vocab_size": 1000, "tie_word_embeddings": False}),
        ("gpt-j-tiny", {"vocab_size": 1000, "tie_word_embeddings": True}),
        ("pythia-tiny", {"vocab_size": 1000, "attention_bias": False}),
        ("opt-tiny", {"vocab_size": 1000, "word_embed_proj_dim": 64, "tie_word_embeddings": False}),
        ("opt-tiny", {"vocab_size": 1000, "do_layer_norm_before": False, "enable_bias": False}),
    ],
)
def test_parameter_count_matches_the_pytorch_model(preset, overrides):
    model_type, preset_values = create_config.PRESETS[preset]
    config = config_class(model_type)(**{**preset_values, **overrides})
    model_class = {"gpt2": GPT2LMHeadModel, "roberta": RobertaForMaskedLM}.get(model_type, AutoModelForCausalLM)
    model = model_class.from_config(config) if model_class is AutoModelForCausalLM else model_class(config)

    assert create_config.count_parameters(config) == torch_parameter_count(model)


# The presets of the small open models that continued pretraining starts from, and tiny sizes of each.
FAMILY_PRESETS = ["qwen3-0.6b", "gemma3-270m", "olmo2-1b", "smollm-135m", "qwen3-tiny", "gemma3-tiny", "olmo2-tiny"]
# The parameter counts of the published models the family presets take their shapes from (their model cards: 0.6B,
# 268M, 1.48B, 134.5M; Pythia's table of sizes in the EleutherAI/pythia README; the tensors of the facebook/opt-125m
# and EleutherAI/gpt-j-6b weight files, whose model card's table says 6,053,381,344, 2,498,560 more than they hold).
PUBLISHED_PARAMETERS = {"qwen3-0.6b": 596_049_920, "gemma3-270m": 268_098_176, "olmo2-1b": 1_484_916_736,
                        "smollm-135m": 134_515_008, "pythia-160m": 162_322_944, "opt-125m": 125_239_296,
                        "gpt-j-6b": 6_050_882_784}  # fmt: skip


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_each_family_preset_is_a_config_its_module_computes(preset):
    model_type, preset_values = create_config.PRESETS[preset]
    config = config_class(model_type)(**preset_values)
    create_config.check_config(config, preset)
    assert config.model_type == model_type
    if preset in PUBLISHED_PARAMETERS:
        assert create_config.count_parameters(config) == PUBLISHED_PARAMETERS[preset]


def test_parameter_count_of_gpt2_small_is_the_published_124m():
    model_type, preset_values = create_config.PRESETS["gpt2"]

    assert create_config.count_parameters(GPT2Config(**preset_values)) == 124_439_808


# ---------------------------------------------------------------------------------------------------------------------
# Refused settings
# ---------------------------------------------------------------------------------------------------------------------


# The refusals below are checked by calling main() in this process, which is faster than starting a new one; the
# tests above show that a UsageError reaches the user as one line on stderr.


def run_main(monkeypatch, *args):
    monkeypatch.setattr("sys.argv", ["create_config.py", *map(str, args)])
    create_config.main()


def test_too_few_positions_for_the_tokenizer_are_refused(monkeypatch, roberta_model_dir):
    with pytest.raises(create_config.UsageError) as refusal:
        run_main(
            monkeypatch,
            "--preset", "roberta-tiny",
            "--tokenizer_dir", roberta_model_dir,
            "--set", "max_position_embeddings=130",
        )  # fmt: skip

    # RoBERTa's positions start after the padding id, so 130 positions hold 128 tokens, fewer than 256.
    message = str(refusal.value)
    assert "room for 128 tokens" in message and "model_max_length is 256" in message
    assert "--set max_position_embeddings=258" in message
    assert not (roberta_model_dir / "config.json").exists()


def test_model_type_contradicting_the_preset_is_refused(monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match="model_type=roberta contradicts the preset"):
        run_main(monkeypatch, "--preset", "gpt2-tiny", "--output_dir", tmp_path, "--set", "model_type=roberta")

    assert not (tmp_path / "config.json").exists()


def test_two_names_for_one_value_must_agree(monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match="contradict each other"):
        run_main(
            monkeypatch, "--preset", "gpt2-tiny", "--output_dir", tmp_path, "--set", "n_embd=128", "hidden_size=256"
        )


def test_missing_tokenizer_dir_is_refused(monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match="--tokenizer_dir .*missing is not a directory"):
        run_main(monkeypatch, "--preset", "gpt2-tiny", "--tokenizer_dir", tmp_path / "missing")

    assert not (tmp_path / "missing").exists()


def test_existing_config_is_kept_unless_overwrite_is_given(monkeypatch, gpt2_model_dir):
    (gpt2_model_dir / "config.json").write_text('{"model_type": "gpt2", "n_layer": 7}')

    with pytest.raises(create_config.UsageError, match="already has a config.json; pass --overwrite"):
        run_main(monkeypatch, "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_model_dir)
    assert (gpt2_model_dir / "config.json").read_text() == '{"model_type": "gpt2", "n_layer": 7}'

    run_main(monkeypatch, "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_model_dir, "--overwrite")
    assert AutoConfig.from_pretrained(gpt2_model_dir).n_layer == 2


def test_a_json_arguments_file_with_a_value_of_the_wrong_type_is_refused(monkeypatch, tmp_path):
    arguments = {"preset": "gpt2-tiny", "output_dir": str(tmp_path / "model"), "pad_vocab_to_multiple_of": "64"}
    (tmp_path / "arguments.json").write_text(json.dumps(arguments))

    message = "arguments.json: 'pad_vocab_to_multiple_of' must be of type int | None, not '64'"
    with pytest.raises(create_config.UsageError, match=re.escape(message)):
        run_main(monkeypatch, tmp_path / "arguments.json")
    assert not (tmp_path / "model").exists()


def test_arguments_are_parsed_by_the_one_definition_train_tokenizer_uses():
    """create_config.py and train_tokenizer.py share their argument parsing: flax_lm.command_line.tool_arguments, not
    a copy."""
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO_DIR / "train_tokenizer.py")
    train_tokenizer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tokenizer)

    assert create_config.parse_arguments is tool_arguments.parse_arguments
    assert train_tokenizer.parse_arguments is tool_arguments.parse_arguments


@pytest.mark.parametrize(
    "arguments, message",
    [
        # Named before argparse would answer that --preset is required.
        (["--presett", "gpt2-tiny"], "unknown argument --presett; see --help"),
        (["--preset", "gpt2-tiny", "--tokenizer_dirr=x"], "unknown argument --tokenizer_dirr; see --help"),
        (["--preset", "gpt2-tiny", "stray"], "unexpected argument stray; flags start with --"),
    ],
)
def test_a_misspelt_or_stray_argument_is_refused_in_one_line_naming_it(arguments, message, monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match=re.escape(message)):
        run_main(monkeypatch, "--output_dir", tmp_path / "model", *arguments)
    assert not (tmp_path / "model").exists()
