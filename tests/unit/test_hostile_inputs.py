"""Bad inputs to the four scripts, as a careless user or a hostile environment would give them: each is refused in
one line (a UsageError, which the scripts print as `error: ...` with exit status 2) before any training, or works.

The table runs each command line inside this process (a fresh interpreter per case would cost seconds of imports
each); the tests below it run the scripts as commands where the exit status, the log or the files left on disk are
the point."""

import dataclasses
import errno
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
import types
import typing
from functools import partial

import datasets
import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import safetensors
import torch
from conftest import FIXTURES_DIR, REPO_DIR
from test_clm import run_clm_flax, tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, GPT2LMHeadModel, PreTrainedTokenizerFast, RobertaConfig

import flax_lm.data.packed
import flax_lm.data.texts
import flax_lm.devices.processes
import flax_lm.errors
from flax_lm.data.source import TextSource
from flax_lm.models.huggingface import read_safetensors_checkpoint

TRAIN_FILE = FIXTURES_DIR / "en" / "train.txt"
NULL_ROW = 57  # the row of the JSON-lines files below whose text is null (or absent): row 58 counted from 1


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPTS = {
    "run_clm_flax": run_clm_flax,
    "run_mlm_flax": load_script("run_mlm_flax"),
    "train_tokenizer": load_script("train_tokenizer"),
    "create_config": load_script("create_config"),
}


class PickleThatWritesAFile:
    """Unpickled without weights_only, this writes a file: the test that the loader never runs it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def save_model_dir(directory, tokenizer_dir, config):
    shutil.copytree(tokenizer_dir, directory, dirs_exist_ok=True)
    config.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def paths(gpt2_tokenizer_dir, roberta_tokenizer_dir, tmp_path_factory):
    return hostile_paths(tmp_path_factory.mktemp("hostile"), gpt2_tokenizer_dir, roberta_tokenizer_dir)


def hostile_paths(root, gpt2_tokenizer_dir, roberta_tokenizer_dir) -> dict:
    """Model directories and data files in `root`, good and bad, named for the placeholders of the table."""
    gpt2 = save_model_dir(root / "gpt2", gpt2_tokenizer_dir, tiny_config(vocab_size=1000, n_positions=64))
    roberta_config = RobertaConfig(
        vocab_size=1000,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=66,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    roberta = save_model_dir(root / "roberta", roberta_tokenizer_dir, roberta_config)
    config_only = root / "config-only"  # AutoTokenizer builds a tokenizer without vocabulary from it
    tiny_config(vocab_size=1000).save_pretrained(config_only)

    # A tokenizer that knows one word, not in the corpus: every text encodes to unknown tokens.
    unknown_only = root / "unknown-only"
    word_level = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<unk>": 1, "xylophone": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(
        unknown_only
    )
    tiny_config(vocab_size=8).save_pretrained(unknown_only)

    lines = TRAIN_FILE.read_text().splitlines()[:300]
    data = root / "data"
    data.mkdir()
    with open(data / "null.jsonl", "w") as file:
        for row, line in enumerate(lines):
            file.write(json.dumps({"text": None if row == NULL_ROW else line}) + "\n")
    with open(data / "missing.jsonl", "w") as file:
        for row, line in enumerate(lines):
            file.write(json.dumps({"id": row} if row == NULL_ROW else {"id": row, "text": line}) + "\n")
    with open(data / "texts.jsonl", "w") as file:
        file.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    # Line 41 broken by a line break inside its string; a copy cut short in the middle of line 101.
    text_lines = [json.dumps({"text": line}) + "\n" for line in lines]
    (data / "broken.jsonl").write_text("".join(text_lines[:40] + ['{"text": "cut\n'] + text_lines[41:]))
    (data / "cut-short.jsonl").write_text("".join(text_lines[:100]) + text_lines[100][:20])
    pyarrow.parquet.write_table(pyarrow.table({"text": list(range(300))}), data / "int.parquet")
    (data / "whitespace.txt").write_text("   \n\t\n \u3000 \n" * 50)

    GPT2LMHeadModel(tiny_config(vocab_size=1000, n_positions=64)).save_pretrained(root / "good")
    good_weights = (root / "good" / "model.safetensors").read_bytes()
    bad_weights = {
        "truncated_weights": good_weights[: len(good_weights) // 2],
        "garbage_weights": os.urandom(4096),
        "empty_weights": b"",
    }
    for name, content in bad_weights.items():
        save_model_dir(root / name, gpt2, tiny_config(vocab_size=1000, n_positions=64))
        (root / name / "model.safetensors").write_bytes(content)
    pickled = save_model_dir(root / "pickled", gpt2, tiny_config(vocab_size=1000, n_positions=64))
    # config.json spells it Infinity, as Python's json writes and reads it
    infinite = save_model_dir(
        root / "infinite", gpt2, tiny_config(vocab_size=1000, n_positions=64, initializer_range=float("inf"))
    )
    # A config.json edited by hand past create_config.py's checks: no attention heads (ZeroDivisionError in a model)
    no_heads = save_model_dir(root / "no-heads", gpt2, tiny_config(vocab_size=1000, n_positions=64, n_head=0))
    (root / "broken.jinja").write_text("{% for message in messages %}{{ message['content'] }}")  # no endfor
    code = PickleThatWritesAFile(str(root / "pickle-ran"))
    torch.save({"transformer.wte.weight": code}, pickled / "pytorch_model.bin")

    return {
        "gpt2": gpt2, "roberta": roberta, "config_only": config_only, "unknown_only": unknown_only,
        "train": TRAIN_FILE, "texts": data / "texts.jsonl", "null": data / "null.jsonl",
        "missing": data / "missing.jsonl",
        "int": data / "int.parquet", "whitespace": data / "whitespace.txt", "pickled": pickled,
        "broken": data / "broken.jsonl", "cut_short": data / "cut-short.jsonl",
        "pickle_ran": root / "pickle-ran", "root": root, "infinite": infinite, "no_heads": no_heads,
        "broken_template": root / "broken.jinja",
        **{name: root / name for name in bad_weights},
    }  # fmt: skip


CLM = [
    "--config_name", "{gpt2}", "--tokenizer_name", "{gpt2}", "--do_train", "--train_file", "{train}",
    "--block_size", "32", "--per_device_train_batch_size", "4", "--max_steps", "2", "--sample_tokens", "0",
]  # fmt: skip
MLM = [
    "--config_name", "{roberta}", "--tokenizer_name", "{roberta}", "--do_train", "--train_file", "{train}",
    "--max_seq_length", "32", "--per_device_train_batch_size", "4", "--max_steps", "2",
]  # fmt: skip
TOKENIZER = ["--vocab_size", "300", "--train_file"]
# Under /proc nothing can be created, not even by root, for whom os.access says yes to everything.
UNWRITABLE = "/proc/no-such-directory/output"
MISSING_TEXT = ["row 58 of", "has no text", "--skip_missing_texts"]

# (script, arguments, fragments of the error line). Placeholders name the paths of the fixture above; training
# scripts also get --output_dir and --cache_dir in a fresh directory unless the arguments give --output_dir.
REFUSALS = {
    # A tokenizer that cannot encode text
    "clm-tokenizer-without-vocabulary": (
        "run_clm_flax", [*CLM, "--tokenizer_name", "{config_only}"], ["--tokenizer_name", "has no vocabulary"]),
    "mlm-tokenizer-without-vocabulary": (
        "run_mlm_flax", [*MLM, "--tokenizer_name", "{config_only}"], ["--tokenizer_name", "has no vocabulary"]),
    "clm-tokenizer-of-unknown-tokens-only": (
        "run_clm_flax", [*CLM, "--config_name", "{unknown_only}", "--tokenizer_name", "{unknown_only}"],
        ["cannot encode the", "data", "only the unknown token <unk>"]),
    "clm-tokenizer-of-unknown-tokens-only-streaming": (
        "run_clm_flax",
        [*CLM, "--config_name", "{unknown_only}", "--tokenizer_name", "{unknown_only}", "--streaming"],
        ["cannot encode the train data", "only the unknown token <unk>"]),
    # Rows without text
    "clm-null-text": ("run_clm_flax", [*CLM, "--train_file", "{null}"], ["null.jsonl", *MISSING_TEXT]),
    "clm-absent-text": ("run_clm_flax", [*CLM, "--train_file", "{missing}"], ["missing.jsonl", *MISSING_TEXT]),
    "clm-null-text-streaming": (
        "run_clm_flax", [*CLM, "--train_file", "{null}", "--streaming"], ["null.jsonl", *MISSING_TEXT]),
    "clm-null-text-packing": (
        "run_clm_flax", [*CLM, "--train_file", "{null}", "--packed_data_dir", "{root}/packed-null"],
        ["null.jsonl", *MISSING_TEXT]),
    "clm-null-validation-text": (
        "run_clm_flax", [*CLM, "--train_file", "{texts}", "--validation_file", "{null}"],
        ["null.jsonl", *MISSING_TEXT]),
    "mlm-null-text": ("run_mlm_flax", [*MLM, "--train_file", "{null}"], ["null.jsonl", *MISSING_TEXT]),
    "mlm-null-text-line-by-line": (
        "run_mlm_flax", [*MLM, "--train_file", "{null}", "--line_by_line"], ["null.jsonl", *MISSING_TEXT]),
    "tokenizer-null-text": ("train_tokenizer", [*TOKENIZER, "{null}"], ["null.jsonl", *MISSING_TEXT]),
    "clm-int-column": ("run_clm_flax", [*CLM, "--train_file", "{int}"], ["column 'text'", "int64", "not text"]),
    "clm-int-column-streaming": (
        "run_clm_flax", [*CLM, "--train_file", "{int}", "--streaming"], ["column 'text'", "int", "not text"]),
    "mlm-int-column": ("run_mlm_flax", [*MLM, "--train_file", "{int}"], ["column 'text'", "int64", "not text"]),
    "tokenizer-int-column": ("train_tokenizer", [*TOKENIZER, "{int}"], ["column 'text'", "int", "not text"]),
    "tokenizer-whitespace-only": ("train_tokenizer", [*TOKENIZER, "{whitespace}"], ["only whitespace"]),
    # JSON Lines that are not: named by file and line (the reader counts its rows from the start of a block)
    "clm-broken-json-line": (
        "run_clm_flax", [*CLM, "--train_file", "{broken}"],
        ["cannot read the train data: line 41 of", "broken.jsonl is not JSON", "fix or remove that line"]),
    "clm-broken-json-line-streaming": (
        "run_clm_flax", [*CLM, "--train_file", "{broken}", "--streaming"],
        ["cannot read the train data: line 41 of", "broken.jsonl is not JSON"]),
    "clm-cut-short-validation-file": (
        "run_clm_flax", [*CLM, "--do_eval", "--validation_file", "{cut_short}"],
        ["cannot read the validation data: line 101 of", "cut-short.jsonl is not JSON (Unterminated string"]),
    "mlm-cut-short-validation-file-streaming": (
        "run_mlm_flax", [*MLM, "--do_eval", "--validation_file", "{cut_short}", "--streaming"],
        ["cannot read the validation data: line 101 of", "cut-short.jsonl is not JSON"]),
    # Damaged weights
    **{
        f"clm-{name.replace('_', '-')}": (
            "run_clm_flax", [*CLM, "--model_name_or_path", f"{{{name}}}"],
            ["model.safetensors", "is not a readable safetensors file"])
        for name in ["truncated_weights", "garbage_weights", "empty_weights"]
    },
    "clm-pickle-with-code": (
        "run_clm_flax", [*CLM, "--model_name_or_path", "{pickled}", "--allow_pickle_weights"],
        ["pytorch_model.bin", "cannot be loaded as plain tensors", "none of them was run"]),
    # A local model directory that is not there, named as such rather than looked up on the hub
    "clm-missing-model-directory": (
        "run_clm_flax", [*CLM, "--model_name_or_path", "{root}/no-such-model"],
        ["--model_name_or_path", "no-such-model: no such directory"]),
    "mlm-missing-tokenizer-directory": (
        "run_mlm_flax", [*MLM, "--tokenizer_name", "./no-such-tokenizer"],
        ["--tokenizer_name ./no-such-tokenizer: no such directory"]),
    # Unwritable output directories
    "clm-unwritable-output-dir": (
        "run_clm_flax", [*CLM, "--output_dir", UNWRITABLE], ["--output_dir", UNWRITABLE, "cannot be written"]),
    "mlm-unwritable-output-dir": (
        "run_mlm_flax", [*MLM, "--output_dir", UNWRITABLE], ["--output_dir", UNWRITABLE, "cannot be written"]),
    "clm-unwritable-packed-data-dir": (
        "run_clm_flax", [*CLM, "--packed_data_dir", UNWRITABLE],
        ["--packed_data_dir", UNWRITABLE, "cannot be written"]),
    "tokenizer-unwritable-output-dir": (
        "train_tokenizer", [*TOKENIZER, "{train}", "--output_dir", UNWRITABLE],
        ["--output_dir", UNWRITABLE, "cannot be written"]),
    "config-unwritable-output-dir": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", UNWRITABLE],
        ["--output_dir", UNWRITABLE, "cannot be written"]),
    # Numbers out of range
    "clm-negative-learning-rate": (
        "run_clm_flax", [*CLM, "--learning_rate", "-1"], ["--learning_rate -1.0", "positive"]),
    "clm-nan-learning-rate": ("run_clm_flax", [*CLM, "--learning_rate", "nan"], ["--learning_rate nan"]),
    "clm-negative-warmup": ("run_clm_flax", [*CLM, "--warmup_steps", "-5"], ["--warmup_steps -5", "0 or more"]),
    "clm-unwritable-cache-dir": (
        "run_clm_flax", [*CLM, "--cache_dir", UNWRITABLE], ["--cache_dir", UNWRITABLE, "cannot be written"]),
    "mlm-unwritable-cache-dir": (
        "run_mlm_flax", [*MLM, "--cache_dir", UNWRITABLE], ["--cache_dir", UNWRITABLE, "cannot be written"]),
    "clm-warmup-longer-than-the-run": (
        "run_clm_flax", [*CLM, "--warmup_steps", "5"], ["--warmup_steps 5", "longer than the run's 2 steps"]),
    "mlm-warmup-longer-than-the-run": (
        "run_mlm_flax", [*MLM, "--warmup_steps", "3"], ["--warmup_steps 3", "longer than the run's 2 steps"]),
    "clm-min-lr-rate-of-1": ("run_clm_flax", [*CLM, "--min_lr_rate", "1"], ["--min_lr_rate 1.0", "[0, 1)"]),
    "clm-min-lr-rate-without-a-decay": (
        "run_clm_flax", [*CLM, "--lr_scheduler_type", "constant", "--min_lr_rate", "0.1"],
        ["--min_lr_rate", "a --lr_scheduler_type that decays"]),
    "clm-unknown-optimizer": (
        "run_clm_flax", [*CLM, "--optim", "sgd"], ["--optim sgd is not one of adamw, muon, lion, adafactor"]),
    "mlm-unknown-schedule": (
        "run_mlm_flax", [*MLM, "--lr_scheduler_type", "inverse_sqrt"],
        ["--lr_scheduler_type inverse_sqrt is not one of linear, cosine, constant, warmup_stable_decay"]),
    "clm-unknown-decay-shape": (
        "run_clm_flax", [*CLM, "--lr_decay_shape", "step"], ["--lr_decay_shape step", "linear, cosine, 1-sqrt"]),
    "clm-decay-ratio-above-1": ("run_clm_flax", [*CLM, "--lr_decay_ratio", "1.5"], ["--lr_decay_ratio 1.5"]),
    "clm-warmup-and-decay-longer-than-the-run": (
        "run_clm_flax",
        [*CLM, "--lr_scheduler_type", "warmup_stable_decay", "--warmup_steps", "1", "--lr_decay_ratio", "1"],
        ["warm-up (1 steps)", "decay (--lr_decay_ratio 1.0: 2 steps)", "longer than the run's 2 steps"]),
    "clm-adam-beta2-above-1": ("run_clm_flax", [*CLM, "--adam_beta2", "1.5"], ["--adam_beta2 1.5", "[0, 1)"]),
    "clm-negative-max-grad-norm": ("run_clm_flax", [*CLM, "--max_grad_norm", "-1"], ["--max_grad_norm -1.0"]),
    "clm-max-steps-of-0": ("run_clm_flax", [*CLM, "--max_steps", "0"], ["--max_steps 0 must be positive, or -1"]),
    "clm-repeated-mesh-axis": (
        "run_clm_flax", [*CLM, "--mesh_shape", "data=1,data=1"], ["--mesh_shape data=1,data=1 sizes the data axis"]),
    "clm-negative-max-train-samples": (
        "run_clm_flax", [*CLM, "--max_train_samples", "-5"], ["--max_train_samples -5", "at least 1"]),
    "clm-negative-sample-tokens": ("run_clm_flax", [*CLM, "--sample_tokens", "-1"], ["--sample_tokens"]),
    "mlm-negative-learning-rate": (
        "run_mlm_flax", [*MLM, "--learning_rate", "-1"], ["--learning_rate -1.0", "positive"]),
    "mlm-negative-weight-decay": ("run_mlm_flax", [*MLM, "--weight_decay", "-0.1"], ["--weight_decay -0.1"]),
    "config-dropout-above-1": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", "{out}", "--set", "resid_pdrop=1.5"],
        ["resid_pdrop", "dropout probability", "1.5"]),
    "config-roberta-dropout-of-1": (
        "create_config", ["--preset", "roberta-tiny", "--output_dir", "{out}", "--set", "hidden_dropout_prob=1"],
        ["hidden_dropout_prob", "dropout probability"]),
    "config-negative-dropout": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", "{out}", "--set", "attn_pdrop=-0.1"],
        ["attn_pdrop", "-0.1"]),
    "config-zero-inner-size": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", "{out}", "--set", "n_inner=0"],
        ["n_inner must be a whole number of 1 or more, not 0"]),
    "config-zero-layer-norm-epsilon": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", "{out}", "--set", "layer_norm_epsilon=0"],
        ["layer_norm_epsilon must be positive"]),
    "config-infinite-initializer-range": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", "{out}", "--set", "initializer_range=Infinity"],
        ["initializer_range is inf, not a finite number", "--set initializer_range=0.02"]),
    "config-roberta-negative-infinite-epsilon": (
        "create_config", ["--preset", "roberta-tiny", "--output_dir", "{out}", "--set", "layer_norm_eps=-Infinity"],
        ["layer_norm_eps is -inf, not a finite number"]),
    "clm-infinite-config-value": (
        "run_clm_flax", [*CLM, "--config_name", "{infinite}"],
        ["--config_name", "infinite: the config's initializer_range is inf, not a finite number", "config.json"]),
    "clm-config-edited-to-no-heads": (
        "run_clm_flax", [*CLM, "--config_name", "{no_heads}"],
        ["--config_name", "no-heads: the config's n_head must be a whole number of 1 or more, not 0", "config.json"]),
    "config-activation-no-model-computes": (
        "create_config", ["--preset", "gpt2-tiny", "--output_dir", "{out}", "--set", "activation_function=tanh"],
        ["activation_function 'tanh' is not an activation the models compute", "gelu_new"]),
    "config-roberta-activation-no-model-computes": (
        "create_config", ["--preset", "roberta-tiny", "--output_dir", "{out}", "--set", "hidden_act=gelu_fast"],
        ["hidden_act 'gelu_fast' is not an activation"]),
    # Sizes no model of the family can have: each refused before config.json is written
    "config-negative-head-dim": (
        "create_config", ["--preset", "qwen3-tiny", "--output_dir", "{out}", "--set", "head_dim=-1"],
        ["head_dim must be a whole number of 1 or more, not -1"]),
    "config-zero-head-dim": (
        "create_config", ["--preset", "gemma3-tiny", "--output_dir", "{out}", "--set", "head_dim=0"],
        ["head_dim must be a whole number of 1 or more, not 0"]),
    "config-zero-key-value-heads": (
        "create_config", ["--preset", "qwen3-tiny", "--output_dir", "{out}", "--set", "num_key_value_heads=0"],
        ["num_key_value_heads must be a whole number of 1 or more, not 0"]),
    "config-llama-zero-heads": (  # LlamaConfig divides by the heads on its own: a ZeroDivisionError before
        "create_config", ["--preset", "llama-tiny", "--output_dir", "{out}", "--set", "num_attention_heads=0"],
        ["--set num_attention_heads=0: sizes must be 1 or more"]),
    "config-key-value-heads-not-dividing-the-heads": (
        "create_config", ["--preset", "llama-tiny", "--output_dir", "{out}", "--set", "num_key_value_heads=3"],
        ["num_attention_heads 2 is not a multiple of num_key_value_heads 3"]),
    "config-negative-query-scalar": (
        "create_config", ["--preset", "gemma3-tiny", "--output_dir", "{out}", "--set", "query_pre_attn_scalar=-1"],
        ["query_pre_attn_scalar must be a whole number of 1 or more, not -1"]),
    "config-vocabulary-of-10-billion": (
        "create_config", ["--preset", "qwen3-tiny", "--output_dir", "{out}", "--set", "vocab_size=10000000000"],
        ["vocab_size 10000000000 is more token ids than int32 holds (2147483647)"]),
    # Special tokens that cannot make a tokenizer, refused before any text is read
    "tokenizer-mask-token-that-is-the-beginning-token": (
        "train_tokenizer", [*TOKENIZER, "{train}", "--model_type", "roberta", "--mask_token", "<s>"],
        ["--mask_token '<s>' is the bos token too", "give --mask_token a token of its own"]),
    "tokenizer-padding-token-that-is-the-end-token": (
        "train_tokenizer", [*TOKENIZER, "{train}", "--model_type", "roberta", "--pad_token", "</s>"],
        ["--pad_token '</s>' is the eos token too"]),
    "tokenizer-empty-extra-special-token": (
        "train_tokenizer", [*TOKENIZER, "{train}", "--extra_special_tokens", "<|tool|>", ""],
        ["--extra_special_tokens holds an empty token"]),
    # Flags naming what cannot be used, refused before any work
    "clm-chat-template-that-does-not-parse": (
        "run_clm_flax", [*CLM, "--chat_template_path", "{broken_template}"],
        ["--chat_template_path", "broken.jinja: the template does not parse (line 1: Unexpected end of template"]),
    "clm-allow-resume-changes-of-an-unknown-name": (
        "run_clm_flax", [*CLM, "--resume_from_checkpoint", "--allow_resume_changes", "learning_rate,not_a_flag"],
        ["--allow_resume_changes not_a_flag is nothing a resume compares; name some of all, model_code, config, "
         "tokenizer, training_data, global_batch_size, mixture_weights, ", ", learning_rate, "]),
    "clm-allow-resume-changes-misspelt": (
        "run_clm_flax", [*CLM, "--resume_from_checkpoint", "--allow_resume_changes", "learning_rte"],
        ["--allow_resume_changes learning_rte is nothing a resume compares (did you mean learning_rate?)"]),
    # Flags for another model or of the Hugging Face examples that these scripts do not take
    "clm-roberta-model-type": (
        "run_clm_flax", [*CLM, "--model_type", "roberta"], ["--model_type roberta", "run_mlm_flax.py trains roberta"]),
    "mlm-gpt2-model-type": (
        "run_mlm_flax", [*MLM, "--model_type", "gpt2"], ["--model_type gpt2", "run_clm_flax.py trains gpt2"]),
    "clm-hub-model-id": ("run_clm_flax", [*CLM, "--hub_model_id", "me/model"], ["--hub_model_id", "hf upload"]),
    "mlm-hub-token": ("run_mlm_flax", [*MLM, "--hub_token=hf_abc"], ["--hub_token", "hf auth login"]),
    "mlm-adafactor": ("run_mlm_flax", [*MLM, "--adafactor"], ["--adafactor is not supported", "--optim adafactor"]),
    "clm-use-fast-tokenizer": (
        "run_clm_flax", [*CLM, "--use_fast_tokenizer", "False"], ["--use_fast_tokenizer", "always the fast"]),
    "mlm-remat-policy": (
        "run_mlm_flax", [*MLM, "--remat_policy", "dots_saveable"], ["--gradient_checkpointing dots_saveable"]),
    "clm-unknown-remat-policy": (
        "run_clm_flax", [*CLM, "--gradient_checkpointing", "everything_saveable"],
        ["--gradient_checkpointing everything_saveable", "dots_with_no_batch_dims_saveable"]),
    # Distributed flags, refused before the process tries to join others
    "clm-process-id-out-of-range": (
        "run_clm_flax", [*CLM, "--coordinator_address", "127.0.0.1:1", "--num_processes", "2", "--process_id", "2"],
        ["--process_id 2 is not in 0..1"]),
    "mlm-coordinator-without-process-id": (
        "run_mlm_flax", [*MLM, "--coordinator_address", "127.0.0.1:1"], ["go together"]),
}  # fmt: skip


def script_arguments(script, arguments, paths, directory):
    placeholders = {**paths, "out": directory / "out"}
    arguments = [argument.format(**placeholders) for argument in arguments]
    if arguments.count("--train_file") > 1:  # a case's own data replaces that of CLM or MLM (both would be read)
        first = arguments.index("--train_file")
        arguments = arguments[:first] + arguments[first + 2 :]
    if script.startswith("run_") and "--output_dir" not in arguments:
        arguments += ["--output_dir", str(directory / "out")]
    if script.startswith("run_") and "--cache_dir" not in arguments:
        arguments += ["--cache_dir", str(directory / "cache")]
    if script == "train_tokenizer" and "--output_dir" not in arguments:
        arguments += ["--output_dir", str(directory / "out")]
    return arguments


def printed_error(module, error):
    """What the script's command prints after `error: ` for this exception; None where it shows a traceback."""
    assert module.call_with_one_line_errors is flax_lm.errors.call_with_one_line_errors, (
        "every script's command ends in the handler of flax_lm.errors"
    )
    return flax_lm.errors.user_error_message(error)


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_input_is_refused_in_one_line(case, paths, tmp_path, monkeypatch):
    script, arguments, fragments = REFUSALS[case]
    module = SCRIPTS[script]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *script_arguments(script, arguments, paths, tmp_path)])
    with pytest.raises(Exception) as refusal:
        module.main()
    message = printed_error(module, refusal.value)
    assert message is not None, f"a traceback: {refusal.value!r}"
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out"), "it wrote output before refusing"


@pytest.mark.parametrize("script", ["run_clm_flax", "run_mlm_flax"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_number_flag_that_is_not_finite_is_refused_in_one_line(script, value, paths, tmp_path, monkeypatch):
    """Each flag of a float, given NaN or an infinity, is refused naming it, before anything is written."""
    module = SCRIPTS[script]
    groups = (module.ModelArguments, module.DataTrainingArguments, module.TrainingArguments)
    float_flags = [
        argument.name
        for group in groups
        for argument in dataclasses.fields(group)
        if typing.get_type_hints(group)[argument.name] is float
    ]
    assert "learning_rate" in float_flags and len(float_flags) >= 12
    for flag in float_flags:
        arguments = script_arguments(script, [*(CLM if script == "run_clm_flax" else MLM), f"--{flag}={value}"],
                                     paths, tmp_path)  # fmt: skip
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *arguments])
        with pytest.raises(Exception) as refusal:
            module.main()
        message = printed_error(module, refusal.value)
        assert message is not None and "\n" not in message, f"--{flag}: {refusal.value!r}"
        assert message.startswith(f"--{flag} {float(value)}"), message
        assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out"), "it wrote output before refusing"


def test_generate_flax_refuses_a_config_with_a_number_that_is_not_finite(paths, monkeypatch):
    generate_flax = load_script("generate_flax")
    monkeypatch.setattr(
        sys, "argv", ["generate_flax.py", "--model_name_or_path", str(paths["infinite"]), "--prompt", "a"]
    )
    with pytest.raises(Exception) as refusal:
        generate_flax.main()
    message = printed_error(generate_flax, refusal.value)
    assert message is not None and "the config's initializer_range is inf, not a finite number" in message, message


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device", "/disk/out/train_results.json"),
        safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        ValueError(  # TensorStore's, under Orbax's checkpoint writes
            'RESOURCE_EXHAUSTED: Error writing local file "/disk/out/checkpoints/4.orbax-checkpoint-tmp/_sharding": '
            "Failed to write 16800 bytes: No space left on device [os_error_code='28']"
        ),
    ],
    ids=["OSError", "safetensors", "TensorStore"],
)
def test_a_full_disk_is_one_line_whichever_library_finds_it(error):
    message = flax_lm.errors.user_error_message(error)
    assert message.startswith("the disk is full") and "--resume_from_checkpoint" in message
    assert ("writing /disk/out/" in message) == ("/disk/out/" in str(error))


def test_a_checkpoint_failing_on_a_full_disk_leaves_no_traceback_from_its_threads():
    """Orbax logs its threads' errors, TensorStore's callbacks find the loop Orbax closed: the last line tells all."""
    full_disk = ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")
    record = logging.LogRecord(
        "absl", logging.ERROR, "", 0, "Save Finalize thread failed", (), (ValueError, full_disk, None)
    )
    assert not flax_lm.devices.processes.not_a_full_disk(record)
    record.exc_info = (ValueError, ValueError("another failure"), None)
    assert flax_lm.devices.processes.not_a_full_disk(record)

    reported = []
    report = flax_lm.errors.without_echoes_of_a_failed_write(reported.append)
    for error in (RuntimeError("Event loop is closed"), full_disk, RuntimeError("another failure")):
        report(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None, object=None))
    assert [str(unraisable.exc_value) for unraisable in reported] == ["another failure"]


def test_pickle_is_refused_without_running_it(paths):
    # The table checks the message; this checks that the call pickled in the file was never made.
    module = run_clm_flax
    with pytest.raises(module.UsageError):
        read_safetensors_checkpoint(str(paths["pickled"]), module.ModelArguments(allow_pickle_weights=True))
    assert not paths["pickle_ran"].exists()


# ----------------------------------------------------------------------------------------------------
# Rows without text, left out on request (as commands: tests/end_to_end/test_hostile_runs.py)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["dataset", "stream"])
@pytest.mark.parametrize("script", ["run_clm_flax", "run_mlm_flax"])
def test_skip_missing_texts_leaves_out_the_rows_without_text(script, streaming, paths, tmp_path, caplog):
    module = SCRIPTS[script]
    data_args = module.DataTrainingArguments(train_file=str(paths["null"]), skip_missing_texts=True)
    with caplog.at_level(logging.WARNING, logger=flax_lm.data.texts.logger.name):
        source = data_args.text_source(module.ModelArguments(cache_dir=str(tmp_path)))
        splits = flax_lm.data.texts.load_text_datasets(source, streaming)
        train = splits["train"]
        texts = [text for batch in train.iter(batch_size=100) for text in batch["text"]]
    expected = [json.loads(line)["text"] for line in paths["null"].read_text().splitlines()]
    assert texts == [text for text in expected if text is not None] and len(texts) == 299
    assert "left out 1" in caplog.text and "rows without text, the first at row 58 of" in caplog.text


def test_skip_missing_texts_leaves_out_the_rows_without_text_in_train_tokenizer(paths, tmp_path, monkeypatch, caplog):
    module = SCRIPTS["train_tokenizer"]
    arguments = [*TOKENIZER, str(paths["null"]), "--output_dir", str(tmp_path / "tokenizer"), "--skip_missing_texts"]
    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py", *arguments])
    with caplog.at_level(logging.INFO):
        module.main()
    assert "Trained on 299 texts" in caplog.text and "Left out 1 rows of" in caplog.text
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()


# ----------------------------------------------------------------------------------------------------
# Caches: damaged shards, leftovers of killed runs
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def text_dataset(tmp_path):
    """The training texts as a dataset with cache files, as load_text_datasets gives them."""
    return datasets.load_dataset("text", data_files=str(TRAIN_FILE), split="train", cache_dir=str(tmp_path / "cache"))


def cut_in_half(path):
    os.truncate(path, os.path.getsize(path) // 2)


def pack_token_cache(text_dataset, tokenizer, directory):
    """The token cache of the texts in blocks of 32 tokens, in shards of 4,000 tokens: several shards."""
    rows = run_clm_flax.tokenized_rows
    return flax_lm.data.packed.cached_blocks(
        text_dataset,
        "train",
        rows,
        tokenizer,
        32,
        str(directory),
        TextSource(),
        framing="grouped",
        tokens_per_shard=4000,
    )


def test_a_cut_short_shard_of_the_tokenized_cache_is_packed_again(text_dataset, paths, tmp_path, caplog):
    pack = partial(pack_token_cache, text_dataset, AutoTokenizer.from_pretrained(paths["gpt2"]), tmp_path / "packed")
    expected = np.asarray(pack())
    shard = os.path.join(pack().directory, "train-00001.npy")
    cut_in_half(shard)
    with caplog.at_level(logging.WARNING, logger=flax_lm.data.packed.logger.name):
        np.testing.assert_array_equal(np.asarray(pack()), expected)
    assert "is damaged (train-00001.npy is cut short" in caplog.text


def clm_rows(tokenizer) -> flax_lm.data.loading.TextsToRows:
    """run_clm_flax.py's way from texts to blocks of 32 tokens."""
    return run_clm_flax.script_texts_to_rows(run_clm_flax.DataTrainingArguments(), tokenizer, 32)


def test_a_cut_short_shard_of_a_packed_data_dir_is_refused(paths, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(paths["gpt2"])

    def load(**settings):
        data_args = run_clm_flax.DataTrainingArguments(packed_data_dir=str(tmp_path / "packed"), **settings)
        source = data_args.text_source(run_clm_flax.ModelArguments())
        tokens_per_shard = data_args.packed_tokens_per_shard
        packed = str(tmp_path / "packed")
        return flax_lm.data.packed.load_packed_corpus(
            packed, source, clm_rows(tokenizer), tokens_per_shard=tokens_per_shard
        )

    load(train_file=str(TRAIN_FILE), text_sample_by="document", packed_tokens_per_shard=4000)
    cut_in_half(tmp_path / "packed" / "train-00001.npy")
    with pytest.raises(run_clm_flax.UsageError, match=r"is damaged: train-00001.npy is cut short .*--overwrite_cache"):
        load()


def overwrite_bytes_in_the_middle(path):
    """Bytes changed in place, the file's size kept: ids of 65535, beyond any vocabulary of the tests."""
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        file.write(b"\xff" * 64)


def test_a_packed_data_dir_shard_whose_bytes_changed_is_refused_when_opened(paths, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(paths["gpt2"])
    data_args = run_clm_flax.DataTrainingArguments(
        packed_data_dir=str(tmp_path / "packed"), train_file=str(TRAIN_FILE), packed_tokens_per_shard=4000
    )
    source, rows = data_args.text_source(run_clm_flax.ModelArguments()), clm_rows(tokenizer)
    load = partial(
        flax_lm.data.packed.load_packed_corpus, data_args.packed_data_dir, source, rows, tokens_per_shard=4000
    )
    load()
    overwrite_bytes_in_the_middle(tmp_path / "packed" / "train-00001.npy")
    blocks = load()[0]["train"]
    blocks[:100]  # a view: no shard is opened
    first_shard = blocks.split_entry["shards"][0]["num_blocks"]
    assert np.asarray(blocks[np.arange(first_shard)]).max() < 1000  # the intact shard reads
    with pytest.raises(
        run_clm_flax.UsageError,
        match=r"--packed_data_dir .*packed is damaged: train-00001.npy differs from the checksum taken when it was "
        r"packed; .*--overwrite_cache",
    ):
        blocks[np.array([first_shard])]


def test_a_token_cache_shard_whose_bytes_changed_stops_the_run_and_is_packed_again_by_the_next(
    text_dataset, paths, tmp_path
):
    pack = partial(pack_token_cache, text_dataset, AutoTokenizer.from_pretrained(paths["gpt2"]), tmp_path / "packed")
    expected = np.asarray(pack())
    overwrite_bytes_in_the_middle(os.path.join(pack().directory, "train-00000.npy"))
    with pytest.raises(run_clm_flax.UsageError, match=r"the token cache .* is damaged: train-00000.npy differs"):
        np.asarray(pack())
    np.testing.assert_array_equal(np.asarray(pack()), expected)


def test_a_cut_short_line_cache_is_tokenized_again(text_dataset, paths, tmp_path, caplog):
    mlm = SCRIPTS["run_mlm_flax"]
    tokenizer = AutoTokenizer.from_pretrained(paths["roberta"])
    cache_dir = str(tmp_path / "lines")

    def tokenize():
        rows = partial(mlm.tokenized_rows, line_by_line=True)
        return flax_lm.data.packed.cached_blocks(
            text_dataset, "train", rows, tokenizer, 30, cache_dir, TextSource(), framing="line_by_line"
        )

    expected = np.asarray(tokenize())
    cut_in_half(os.path.join(tokenize().directory, "train-00000.npy"))
    with caplog.at_level(logging.WARNING, logger=flax_lm.data.packed.logger.name):
        np.testing.assert_array_equal(np.asarray(tokenize()), expected)
    assert "is damaged (train-00000.npy is cut short" in caplog.text


def test_temporary_files_of_killed_runs_are_removed_from_the_cache(text_dataset, paths, tmp_path):
    """A run killed while it packs leaves its unfinished corpus (about the size of the tokens) in the cache; the
    next run removes those untouched for ten minutes, and leaves a fresh one, which may be a live run's."""
    cache_dir = str(tmp_path / "packed")
    os.makedirs(cache_dir)
    stale = [os.path.join(cache_dir, name) for name in ("packed-89ab.4241.tmp", "packed-0123.4242.tmp")]
    fresh = os.path.join(cache_dir, "packed-4567.4243.tmp")
    kept = os.path.join(cache_dir, "notes-packed-0123.4242.tmp")
    with open(stale[0], "wb") as file:
        file.write(b"\0" * 1000)
    os.makedirs(os.path.join(stale[1]))
    for path in (fresh, kept):
        open(path, "wb").close()
    an_hour_ago = time.time() - 3600
    for path in (*stale, kept):
        os.utime(path, (an_hour_ago, an_hour_ago))
    tokenizer = AutoTokenizer.from_pretrained(paths["gpt2"])
    flax_lm.data.packed.cached_blocks(
        text_dataset, "train", run_clm_flax.tokenized_rows, tokenizer, 32, cache_dir, TextSource(), framing="grouped"
    )
    assert not any(os.path.exists(path) for path in stale)
    assert os.path.exists(fresh) and os.path.exists(kept)
