"""The exports read by the tools users take them to, from outside: transformers 5 and 4.57 load every export (GPT-2,
Llama, RoBERTa, a chat model and each family of the models table) and tokenize as `tokenizers` alone does from
tokenizer.json; the exported chat template renders in plain Jinja2 and minijinja the prompt training rendered, and
training from an export gets the template's markers back."""

import json
import subprocess

import jinja2
import minijinja
import numpy as np
import pytest
import read_with_transformers
import torch
from conftest import CHECKS_DIR, REPO_DIR, stock_code
from test_clm import tiny_config, tiny_llama_config
from test_mlm_model import tiny_config as tiny_roberta_config
from test_models import FAMILY_CONFIGS, flax_params_of, hf_class_of, random_torch_model
from test_t5 import random_params, t5_config
from tokenizers import AddedToken, Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel, LlamaForCausalLM, RobertaForMaskedLM

from flax_lm.command_line.arguments import ModelArguments
from flax_lm.data.chat import CHAT_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE, marks_assistant_tokens
from flax_lm.errors import UsageError
from flax_lm.models import stock_module
from flax_lm.models.huggingface import load_config_and_tokenizer, save_model

TEXTS = [
    "The cat sat on the mat.",
    "  Leading spaces, trailing spaces  \nand a second line\twith a tab",
    "Ünïcödé, 한국어 and emoji 🙂 survive",
    "Special tokens written in text: <|endoftext|> <|im_start|>user <s> </s> <mask> <|begin_of_text|> "
    "<|end_of_text|> <|im_end|> <unk> <pad>",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "How are you?"},
]


GPT2_FRAMED_FAMILIES = ("qwen2", "qwen3", "olmo2", "gptj", "gpt_neox", "opt")
# The families whose positions are not set by one rope_parameters of config.json: Gemma 3's for each layer type,
# GPT-J's base fixed, OPT's learned.
OWN_POSITION_SETTINGS = ("gemma3_text", "gptj", "opt")


def chat_tokenizer(tokenizer_dir):
    """The test tokenizer with ChatML's two special tokens and the default template, as train_tokenizer.py
    --chat_template gives it to training."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_SPECIAL_TOKENS])
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def export_dirs(gpt2_tokenizer_dir, llama_tokenizer_dir, roberta_tokenizer_dir, tmp_path_factory):
    """Exports written by save_model, as the training scripts write them, of tiny random models."""
    directory = tmp_path_factory.mktemp("exports")
    exports = {
        "gpt2": (tiny_config(vocab_size=1000), GPT2LMHeadModel, AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)),
        "llama": (
            tiny_llama_config(vocab_size=1000),
            LlamaForCausalLM,
            AutoTokenizer.from_pretrained(llama_tokenizer_dir),
        ),
        "roberta": (
            tiny_roberta_config(vocab_size=1000, pad_token_id=1, bos_token_id=0, eos_token_id=2),
            RobertaForMaskedLM,
            AutoTokenizer.from_pretrained(roberta_tokenizer_dir),
        ),
        "chat": (tiny_llama_config(vocab_size=1002), LlamaForCausalLM, chat_tokenizer(llama_tokenizer_dir)),
    }
    # The families of the models table, each with the tokenizer whose framing it shares (GPT-2's: text, then
    # end-of-text; Llama's: BOS, text, EOS).
    for model_type, make_config in FAMILY_CONFIGS.items():
        framing = gpt2_tokenizer_dir if model_type in GPT2_FRAMED_FAMILIES else llama_tokenizer_dir
        tokenizer = AutoTokenizer.from_pretrained(framing)
        special_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        config = make_config(vocab_size=1000, pad_token_id=None, **special_ids)
        if model_type not in OWN_POSITION_SETTINGS:
            # A base other than transformers 4's default, and a scaling: both must reach it from config.json.
            config.rope_parameters = {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
        exports[model_type] = (config, hf_class_of(config), tokenizer)
    # T5 v1.1, whose output layer is its own, and the original, whose output is the scaled embedding: transformers 5
    # writes tie_word_embeddings true for both (their weights are random Flax ones: transformers 5 ties its own).
    for name, tied in [("t5_v1_1", False), ("t5", True)]:
        config = t5_config(
            vocab_size=1000, tie_word_embeddings=tied, feed_forward_proj="relu" if tied else "gated-gelu"
        )
        exports[name] = (config, None, AutoTokenizer.from_pretrained(llama_tokenizer_dir))
    dirs = {}
    for name, (config, torch_class, tokenizer) in exports.items():
        module = stock_module(config.model_type)
        if torch_class is None:
            params = random_params(module.MODEL_CLASS(config), config)
        else:
            _, params = flax_params_of(module, config, random_torch_model(torch_class, config))
        dirs[name] = str(directory / name)
        save_model(dirs[name], params, config, tokenizer, stock_code(config))
    return dirs


def reading_request(export_dirs):
    # transformers 4 runs Gemma 2 with SDPA unless told otherwise, which leaves out its attention soft-capping (its
    # documentation asks for eager attention); transformers 5 refuses SDPA for it and runs eager.
    return {"directories": list(export_dirs.values()), "texts": TEXTS, "conversation": CONVERSATION,
            "token_ids": [0, 5, 17, 300, 999, 42],
            "attn_implementation": {export_dirs["gemma2"]: "eager"}}  # fmt: skip


@pytest.fixture(scope="module")
def readings(export_dirs, transformers_4_python):
    """What transformers 5 (here) and transformers 4 (in its own environment) read from each export."""
    request = reading_request(export_dirs)
    result = subprocess.run(
        [str(transformers_4_python), str(CHECKS_DIR / "read_with_transformers.py")],
        input=json.dumps(request), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return {"5": read_with_transformers.read_directories(request), "4": json.loads(result.stdout)}


@pytest.mark.parametrize("export", ["gpt2", "llama", "roberta", "chat", *FAMILY_CONFIGS, "t5_v1_1", "t5"])
def test_the_export_reads_the_same_in_transformers_4_and_5_and_tokenizers(export, export_dirs, readings):
    directory = export_dirs[export]
    version_5, version_4 = readings["5"][directory], readings["4"][directory]
    assert version_5["transformers"].startswith("5.") and version_4["transformers"].startswith("4.57.")
    assert not version_4["loading_problems"] and not version_5["loading_problems"]
    assert version_4["model_class"] == version_5["model_class"]
    np.testing.assert_allclose(version_4["logits"], version_5["logits"], atol=1e-5)
    for key in ["special_tokens", "eos_token", "model_max_length", "ids", "ids_without_special_tokens", "pair_ids",
                "decoded", "chat_prompt"]:  # fmt: skip
        assert version_4[key] == version_5[key], key
    assert version_5["decoded"][:3] == TEXTS[:3]  # the last: RoBERTa's <mask> takes the space before it
    assert (version_5["chat_prompt"] is not None) == (export == "chat")
    # tokenizers alone, from tokenizer.json, as engines outside Python's transformers read it.
    backend = Tokenizer.from_file(f"{directory}/tokenizer.json")
    assert [encoding.ids for encoding in backend.encode_batch(TEXTS)] == version_5["ids"]
    assert backend.encode(TEXTS[0], TEXTS[1]).ids == version_5["pair_ids"]
    # The special tokens written in a text are each one token there, as in training.
    for token in version_5["special_tokens"]:
        assert backend.token_to_id(token) in version_5["ids"][3], token


def rendered_in_every_engine(template: str, **context) -> dict:
    """The template rendered by plain Jinja2, by Jinja2 as transformers configures it, and by minijinja."""
    return {
        "jinja2": jinja2.Template(template).render(**context),
        "jinja2 trim_blocks lstrip_blocks": jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        .from_string(template)
        .render(**context),
        "minijinja": minijinja.Environment().render_str(template, **context),
    }


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_exported_chat_template_renders_the_training_prompt_in_jinja2_and_minijinja(
    add_generation_prompt, export_dirs
):
    directory = export_dirs["chat"]
    with open(f"{directory}/chat_template.jinja") as file:
        exported_template = file.read()
    with open(f"{directory}/tokenizer_config.json") as file:
        assert json.load(file)["chat_template"] == exported_template  # where transformers 4 and engines look
    assert not marks_assistant_tokens(exported_template)
    exported_tokenizer = AutoTokenizer.from_pretrained(directory)
    training_tokenizer = chat_tokenizer(directory)
    training_prompt = training_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    context = dict(
        messages=CONVERSATION,
        add_generation_prompt=add_generation_prompt,
        bos_token=exported_tokenizer.bos_token,
        eos_token=exported_tokenizer.eos_token,
    )
    for engine, prompt in rendered_in_every_engine(exported_template, **context).items():
        assert prompt == training_prompt, engine
    assert training_prompt.startswith("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n")
    assert training_prompt.endswith("<|im_start|>assistant\n") == add_generation_prompt
    with pytest.raises(jinja2.TemplateSyntaxError, match="generation"):
        jinja2.Template(DEFAULT_CHAT_TEMPLATE)  # what the engines met before the export was made portable


def test_training_from_an_export_uses_the_template_with_its_markers(export_dirs):
    _, tokenizer = load_config_and_tokenizer(ModelArguments(model_name_or_path=export_dirs["chat"]), "llama")
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    assert marks_assistant_tokens(tokenizer.chat_template)


def test_train_tokenizer_writes_what_transformers_4_reads(
    gpt2_tokenizer_dir, run_tool, tmp_path, transformers_4_python
):
    output_dir = tmp_path / "chat-tokenizer"
    result = run_tool(
        "train_tokenizer.py", "--train_file", REPO_DIR / "tests" / "fixtures" / "en" / "train.txt",
        "--model_type", "llama", "--vocab_size", 400, "--chat_template", "--output_dir", output_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    read = (
        "import json, sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
        "conversation = json.loads(sys.argv[3]); "
        "print(json.dumps([t(sys.argv[2])['input_ids'], t.apply_chat_template(conversation, tokenize=False)]))"
    )
    result = subprocess.run(
        [str(transformers_4_python), "-c", read, str(output_dir), TEXTS[3], json.dumps(CONVERSATION)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    expected = [tokenizer(TEXTS[3])["input_ids"], tokenizer.apply_chat_template(CONVERSATION, tokenize=False)]
    assert json.loads(result.stdout) == expected
    assert "<|im_start|>" in expected[1]


def test_a_sharded_export_replaces_a_single_file_and_back_and_loads_as_save_pretrained_writes_it(
    export_dirs, tmp_path
):
    config = tiny_llama_config(vocab_size=1000)
    torch_model = random_torch_model(LlamaForCausalLM, config)
    _, params = flax_params_of(stock_module("llama"), config, torch_model)
    tokenizer = AutoTokenizer.from_pretrained(export_dirs["llama"])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    save_model(str(ours), params, config, tokenizer, stock_code(config))
    save_model(str(ours), params, config, tokenizer, stock_code(config), max_shard_size="40KB")
    torch_model.save_pretrained(theirs, max_shard_size="40KB")
    names = sorted(path.name for path in ours.glob("model*"))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert names == sorted(path.name for path in theirs.glob("model*"))
    index, their_index = (json.loads((path / "model.safetensors.index.json").read_text()) for path in (ours, theirs))
    assert sorted(index["weight_map"]) == sorted(their_index["weight_map"])
    assert index["metadata"]["total_size"] == their_index["metadata"]["total_size"]
    loaded, loading_info = AutoModelForCausalLM.from_pretrained(ours, output_loading_info=True)
    assert not any(loading_info.values()), loading_info
    input_ids = torch.tensor([[1, 5, 9, 300, 999]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(input_ids).logits.numpy(), torch_model(input_ids).logits.numpy(), atol=1e-5)
    save_model(str(ours), params, config, tokenizer, stock_code(config))
    assert sorted(path.name for path in ours.glob("model*")) == ["model.safetensors"]


def test_chat_template_path_trains_with_a_template_file_and_the_export_carries_it(export_dirs, tmp_path):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    )
    arguments = ModelArguments(model_name_or_path=export_dirs["chat"], chat_template_path=str(template_file))
    _, tokenizer = load_config_and_tokenizer(arguments, "llama")
    assert tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False) == "system: Be brief.\nuser: Hi there\n"
    arguments.chat_template_path = export_dirs["chat"]  # a tokenizer directory: its chat_template.jinja
    assert load_config_and_tokenizer(arguments, "llama")[1].chat_template == DEFAULT_CHAT_TEMPLATE
    arguments.chat_template_path = str(tmp_path / "missing.jinja")
    with pytest.raises(UsageError, match="^cannot read --chat_template_path .*missing.jinja.*pass a Jinja file"):
        load_config_and_tokenizer(arguments, "llama")
