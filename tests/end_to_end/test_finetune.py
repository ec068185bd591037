"""Fine-tuning on prompts and conversations (flax_lm/data/finetune_examples.py, flax_lm/data/chat.py, run_clm_flax.py's
example_rows): the tokens trained on are the completions' and the assistant's, as transformers computes them from
outside; the eval loss is PyTorch's loss of the export on those tokens; bad rows are refused or counted; chat
generation in generate_flax.py and the server's /v1/chat/completions."""

import json
import logging
import os
import re

import datasets
import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import FIXTURES_DIR, stock_code
from test_clm import OFFLINE_ENV, model_dir_with_config, run_script
from test_serve import running_server
from transformers import AddedToken, AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

import generate_flax
import run_clm_flax
from flax_lm.command_line.arguments import ModelArguments
from flax_lm.data.chat import CHAT_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE, marks_assistant_tokens
from flax_lm.data.finetune_examples import (
    CONVERSATIONAL_PROMPT_COMPLETION,
    CONVERSATIONS,
    PROMPT_COMPLETION,
    data_format,
    format_of,
)
from flax_lm.data.packed import cached_blocks, load_packed_corpus
from flax_lm.errors import UsageError
from flax_lm.generation.sampling import Sampling
from flax_lm.models import stock_module
from flax_lm.models.huggingface import ModelLoading, load_config_and_tokenizer, save_model
from flax_lm.training.train_state import abstract_model_params

USER_TURN = {"role": "user", "content": "Hi"}
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "candle", "forest", "letter", "mirror", "bridge"]


def conversation(number: int) -> list[dict]:
    """A conversation of one or two exchanges (every third with a system message first)."""
    word = WORDS[number % len(WORDS)]
    messages = [{"role": "system", "content": "Answer briefly."}] if number % 3 == 0 else []
    messages += [
        {"role": "user", "content": f"Say {word} twice."},
        {"role": "assistant", "content": f"{word} {word}."},
    ]
    if number % 2:
        messages += [{"role": "user", "content": "And once?"}, {"role": "assistant", "content": f"{word.title()}."}]
    return messages


def data_row(example_format: str, number: int) -> dict:
    """Row `number` of data in `example_format`: TRL's column names and layouts."""
    messages = conversation(number)
    if example_format == CONVERSATIONS:
        return {"messages": messages}
    if example_format == CONVERSATIONAL_PROMPT_COMPLETION:
        return {"prompt": messages[:-1], "completion": messages[-1:]}
    return {"prompt": messages[-2]["content"] + "\n", "completion": messages[-1]["content"]}


def write_rows(path, rows: list[dict]) -> str:
    with open(path, "w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def with_chat_template(tokenizer_dir, directory) -> str:
    """A copy of a 1000-token test tokenizer with ChatML's two special tokens (ids 1000 and 1001) and the default
    chat template, as train_tokenizer.py --chat_template writes them."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_SPECIAL_TOKENS])
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def chat_tokenizer_dirs(gpt2_tokenizer_dir, llama_tokenizer_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat-tokenizers")
    # OLMo 2's tokenizer frames texts as GPT-2's does: no BOS, an end-of-text token after each.
    sources = {"gpt2": gpt2_tokenizer_dir, "llama": llama_tokenizer_dir, "olmo2": gpt2_tokenizer_dir}
    return {model_type: with_chat_template(source, directory / model_type) for model_type, source in sources.items()}


def expected_example(tokenizer, example_format: str, row: dict) -> tuple[list[int], list[int]]:
    """A row's token ids and which of them the loss covers, by default, computed from outside: the completion's own
    tokens and the end-of-text token (prompt/completion), or the tokens transformers' apply_chat_template marks as
    the assistant's (conversations), followed by the end-of-text token as documents are."""
    eos = tokenizer.eos_token_id
    if example_format == PROMPT_COMPLETION:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]  # a Llama tokenizer's BOS first
        completion_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        return prompt_ids + completion_ids + [eos], [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)
    messages = row["messages"] if example_format == CONVERSATIONS else row["prompt"] + row["completion"]
    whole = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    trained = list(whole["assistant_masks"])
    if example_format == CONVERSATIONAL_PROMPT_COMPLETION:
        prompt_length = len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"])
        trained = [flag if position >= prompt_length else 0 for position, flag in enumerate(trained)]
    return list(whole["input_ids"]) + [eos], trained + [0]


def find(rows: np.ndarray, ids: list[int]) -> tuple[int, int]:
    """(row, offset) of the first place the ids appear in the rows' token ids."""
    for number, row in enumerate(rows[:, 0].tolist()):
        for offset in range(len(row) - len(ids) + 1):
            if row[offset : offset + len(ids)] == ids:
                return number, offset
    raise AssertionError(f"the example {ids} is in no row")


def example_data_arguments(**settings) -> run_clm_flax.DataTrainingArguments:
    return run_clm_flax.DataTrainingArguments(**settings)


def example_source(**settings):
    """Where run_clm_flax.py reads its texts and examples with these data arguments, as the data layer takes it."""
    return example_data_arguments(**settings).text_source(run_clm_flax.ModelArguments())


def rows_of(data_file: str, tokenizer, cache_dir, block_size: int = 128, **settings) -> np.ndarray:
    """The rows run_clm_flax.py trains on for the examples of `data_file`, through the token cache."""
    dataset = datasets.load_dataset("json", data_files=data_file, split="train", cache_dir=str(cache_dir))
    data_args = example_data_arguments(train_file=[data_file], **settings)
    texts_to_rows = run_clm_flax.script_texts_to_rows(data_args, tokenizer, block_size)
    source = data_args.text_source(run_clm_flax.ModelArguments())
    example_format = data_format({"train": dataset}, source, streaming_alone=False)
    row_function, framing = (
        texts_to_rows.row_function(example_format),
        texts_to_rows.framing_of(example_format, source),
    )
    rows = cached_blocks(
        dataset, "train", row_function, tokenizer, block_size, str(cache_dir), source, framing=framing
    )
    return np.asarray(rows)


# ----------------------------------------------------------------------------------------------------
# The tokens trained on
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True], ids=["one-per-row", "packed"])
@pytest.mark.parametrize("example_format", [PROMPT_COMPLETION, CONVERSATIONS, CONVERSATIONAL_PROMPT_COMPLETION])
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_the_tokens_trained_on_are_the_completions_or_the_assistants(
    model_type, example_format, packing, chat_tokenizer_dirs, tmp_path
):
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs[model_type])
    data = [data_row(example_format, number) for number in range(12)]
    rows = rows_of(write_rows(tmp_path / "data.jsonl", data), tokenizer, tmp_path / "cache", packing=packing)
    assert rows.shape[1:] == (2, 128)
    if packing:
        assert len(rows) < len(data)
    else:
        assert len(rows) == len(data)
    total_trained = 0
    for row in data:
        ids, trained = expected_example(tokenizer, example_format, row)
        number, offset = find(rows, ids)
        np.testing.assert_array_equal(rows[number, 1, offset : offset + len(ids)], trained)
        total_trained += sum(trained)
        if example_format == CONVERSATIONS:  # what the assistant wrote, each turn ended by its end-of-turn token
            written = "".join(
                message["content"] + "<|im_end|>" for message in row["messages"] if message["role"] == "assistant"
            )
            assert tokenizer.decode(np.asarray(ids)[np.asarray(trained, bool)]) == written
    assert rows[:, 1].sum() == total_trained  # nothing else, padding included, weighs anything


def test_the_loss_covers_every_token_without_the_masks(chat_tokenizer_dirs, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs["gpt2"])
    data = [data_row(CONVERSATIONS, number) for number in range(4)]
    settings = dict(assistant_only_loss=False)
    rows = rows_of(write_rows(tmp_path / "data.jsonl", data), tokenizer, tmp_path / "cache", **settings)
    for row, (number, _) in zip(rows, enumerate(data)):
        length = len(expected_example(tokenizer, CONVERSATIONS, data[number])[0])
        np.testing.assert_array_equal(row[1], [0] + [1] * (length - 1) + [0] * (128 - length))


# ----------------------------------------------------------------------------------------------------
# The script: eval loss against PyTorch's, from a pretrained checkpoint, on a mesh
# ----------------------------------------------------------------------------------------------------


def pytorch_loss(model, tokenizer, example_format: str, rows: list[dict]) -> tuple[float, int]:
    """The mean cross-entropy of the export over the tokens the loss covers (labels -100 on every other), as
    transformers computes it, and their count."""
    loss_sum, count = 0.0, 0
    for row in rows:
        ids, trained = expected_example(tokenizer, example_format, row)
        labels = [token if flag else -100 for token, flag in zip(ids, trained)]
        with torch.no_grad():
            loss = model(torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
        predicted = sum(trained[1:])
        loss_sum, count = loss_sum + loss * predicted, count + predicted
    return loss_sum / count, count


RUNS = {
    # A pretrained GPT-2 fine-tuned on prompt/completion pairs, one per row, on a mesh of 8 devices split every way.
    "gpt2-prompt_completion-mesh": (
        "gpt2",
        PROMPT_COMPLETION,
        ["--mesh_shape", "data=2,fsdp=2,tensor=2", "--per_device_train_batch_size", "1"],
        {**OFFLINE_ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    ),
    # A pretrained Llama fine-tuned on conversations packed into rows, through --packed_data_dir.
    "llama-conversations-packed": ("llama", CONVERSATIONS, ["--packing", "--per_device_train_batch_size", "4"], None),
    # A pretrained OLMo 2 (a model module of its own) fine-tuned on conversations, one per row.
    "olmo2-conversations": ("olmo2", CONVERSATIONS, ["--per_device_train_batch_size", "4"], None),
}


@pytest.mark.parametrize("run", RUNS)
def test_eval_loss_is_pytorchs_loss_of_the_export_on_the_trained_tokens(run, chat_tokenizer_dirs, tmp_path):
    model_type, example_format, options, env = RUNS[run]
    if "--packing" in options:
        options = [*options, "--packed_data_dir", str(tmp_path / "packed")]
    positions = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
    pretrained = model_dir_with_config(
        chat_tokenizer_dirs[model_type], tmp_path / "pretrained", model_type, vocab_size=1008, **{positions: 128}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained)).save_pretrained(pretrained)
    data = [data_row(example_format, number) for number in range(24)]
    train_file, validation_file = (
        write_rows(tmp_path / "train.jsonl", data[:16]),
        write_rows(tmp_path / "valid.jsonl", data[16:]),
    )
    output_dir = tmp_path / "out"
    run_script(
        [
            "--output_dir", output_dir, "--model_name_or_path", pretrained, "--train_file", train_file,
            "--validation_file", validation_file, "--do_train", "--do_eval", "--block_size", "128", "--max_steps", "3",
            "--learning_rate", "1e-2", "--per_device_eval_batch_size", "2", "--sample_tokens", "0", "--seed", "0",
            "--cache_dir", tmp_path / "cache", *options,
        ],
        env=env,
    )  # fmt: skip
    results = json.loads((output_dir / "eval_results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    # The tokens trained on as the training template marks them: the export's template renders the same text without
    # the markers, which other engines refuse.
    training_tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs[model_type])
    loss, count = pytorch_loss(model, training_tokenizer, example_format, data[16:])
    assert results["eval_tokens"] == count
    assert results["eval_loss"] == pytest.approx(loss, rel=1e-5)
    # The export carries the chat template and stops at its end of turn, in transformers' pipeline too.
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(output_dir).eos_token_id == [tokenizer.eos_token_id, end_of_turn]
    reply = pipeline("text-generation", model=str(output_dir))(conversation(0)[:-1], max_new_tokens=4)
    assert reply[0]["generated_text"][-1]["role"] == "assistant"


# ----------------------------------------------------------------------------------------------------
# Formats and bad rows
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "columns, settings, expected",
    [
        ({"text": ["a"]}, {}, None),
        ({"prompt": ["a"], "completion": ["b"]}, {}, PROMPT_COMPLETION),
        ({"text": ["a"], "prompt": ["a"], "completion": ["b"]}, {}, None),  # data with a text column train as text
        ({"text": ["a"], "prompt": ["a"], "completion": ["b"]}, {"prompt_column": "prompt"}, PROMPT_COMPLETION),
        ({"in_text": ["a"], "out_text": ["b"]}, {"prompt_column": "in_text", "completion_column": "out_text"},
         PROMPT_COMPLETION),
        ({"prompt": [[USER_TURN]], "completion": [[{"role": "assistant", "content": "b"}]]}, {},
         CONVERSATIONAL_PROMPT_COMPLETION),
        ({"messages": [[USER_TURN]]}, {}, CONVERSATIONS),
    ],
)  # fmt: skip
def test_the_format_is_told_from_the_columns(columns, settings, expected):
    assert format_of(datasets.Dataset.from_dict(columns), "train", example_source(**settings)) == expected


def test_conversations_with_a_tools_column_are_refused_not_trained_without_their_tools():
    columns = {"messages": [[USER_TURN]], "tools": [[{"type": "function", "function": {"name": "now"}}]]}
    with pytest.raises(UsageError, match=r"^the train data has a 'tools' column of tool definitions, which training"):
        format_of(datasets.Dataset.from_dict(columns), "train", example_source())


BAD_ROWS = {
    "a message without a role": (
        CONVERSATIONS,
        {"messages": [{"content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {},
        "row 3 of {file} has a conversation that has no role in message 1",
    ),
    "a completion that is null": (
        PROMPT_COMPLETION,
        {"prompt": "Say hi.", "completion": None},
        {},
        "row 3 of {file} has no 'completion' (it is missing or null); fix the data, or pass --skip_missing_texts",
    ),
    "a conversation among prompt/completion examples": (
        PROMPT_COMPLETION,
        {"messages": [USER_TURN, {"role": "assistant", "content": "Hello"}]},
        {},
        "the train data mixes prompt/completion examples ('prompt', 'completion') with conversations ('messages'); "
        "give each kind in a file of its own",
    ),
    "tool calls the template does not render": (
        CONVERSATIONS,
        {
            "messages": [
                USER_TURN,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
                    ],
                },
            ]
        },
        {},
        "row 3 of {file} has a conversation whose message 2 has 'tool_calls', which the chat template does not render",
    ),
    "a prompt/completion pair of conversations among text ones": (
        PROMPT_COMPLETION,
        {"prompt": [USER_TURN], "completion": "Hello"},
        {},
        "row 3 of {file} has a list prompt and a str completion; give both as text, as the first row does",
    ),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_row_that_is_no_example_is_refused_in_one_line(case, chat_tokenizer_dirs, tmp_path):
    example_format, bad_row, settings, message = BAD_ROWS[case]
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs["gpt2"])
    data = [data_row(example_format, 0), data_row(example_format, 1), bad_row, data_row(example_format, 2)]
    data_file = write_rows(tmp_path / "data.jsonl", data)
    with pytest.raises(UsageError) as refusal:
        rows_of(data_file, tokenizer, tmp_path / "cache", **settings)
    assert str(refusal.value).startswith(message.format(file=data_file))
    assert "\n" not in str(refusal.value)


LEFT_OUT = {
    "an empty completion": (
        PROMPT_COMPLETION, {"prompt": "Say hi.", "completion": ""}, {}, "examples with an empty completion"
    ),
    "a conversation without an assistant turn": (
        CONVERSATIONS, {"messages": [USER_TURN]}, {}, "examples without an assistant turn"
    ),
    "a row longer than the block": (
        PROMPT_COMPLETION, {"prompt": "word " * 160, "completion": "x"}, {}, "examples longer than --block_size 128"
    ),
    "a missing prompt, with --skip_missing_texts": (
        PROMPT_COMPLETION, {"completion": "x"}, {"skip_missing_texts": True}, "examples without a 'prompt'"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", LEFT_OUT)
def test_a_row_with_nothing_to_learn_or_too_long_is_left_out_and_counted(case, chat_tokenizer_dirs, tmp_path, caplog):
    example_format, bad_row, settings, reason = LEFT_OUT[case]
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs["gpt2"])
    data = [data_row(example_format, 0), data_row(example_format, 1), bad_row, data_row(example_format, 2)]
    with caplog.at_level(logging.INFO):
        rows = rows_of(write_rows(tmp_path / "data.jsonl", data), tokenizer, tmp_path / "cache", **settings)
    assert len(rows) == 3
    assert f"train: left out 1 {reason}" in caplog.text and "row 3" in caplog.text


def test_conversations_need_a_template_that_marks_the_assistants_tokens(chat_tokenizer_dirs, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs["gpt2"])
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    data_file = write_rows(tmp_path / "data.jsonl", [data_row(CONVERSATIONS, number) for number in range(3)])
    with pytest.raises(UsageError, match="does not mark the assistant's tokens with {% generation %}"):
        rows_of(data_file, tokenizer, tmp_path / "cache")
    assert len(rows_of(data_file, tokenizer, tmp_path / "cache", assistant_only_loss=False)) == 3
    tokenizer.chat_template = None
    with pytest.raises(UsageError, match="has no chat template to render them with"):
        rows_of(data_file, tokenizer, tmp_path / "cache", assistant_only_loss=False)


# ----------------------------------------------------------------------------------------------------
# What keys the rows: the token cache and --packed_data_dir
# ----------------------------------------------------------------------------------------------------


def test_a_packed_data_dir_of_examples_is_used_alone_and_refused_with_other_loss_settings(
    chat_tokenizer_dirs, tmp_path
):
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs["gpt2"])
    data_file = write_rows(tmp_path / "data.jsonl", [data_row(PROMPT_COMPLETION, number) for number in range(8)])
    model_args = run_clm_flax.ModelArguments(cache_dir=str(tmp_path / "cache"))
    packed = str(tmp_path / "packed")

    def load(**settings):
        data_args = example_data_arguments(packed_data_dir=packed, **settings)
        texts_to_rows = run_clm_flax.script_texts_to_rows(data_args, tokenizer, 64)
        blocks, _ = load_packed_corpus(packed, data_args.text_source(model_args), texts_to_rows)
        return np.asarray(blocks["train"])

    packed_rows = load(train_file=[data_file])
    np.testing.assert_array_equal(load(), packed_rows)  # without data arguments: the rows as they were packed
    recorded, asked = r"prompt/completion examples \(.*loss on the completions", r"\(.*loss on every token"
    with pytest.raises(UsageError, match=f"holds {recorded}.* rows, not prompt/completion examples {asked}"):
        load(completion_only_loss=False)
    # The token cache keeps both, apart.
    masked, unmasked = (
        rows_of(data_file, tokenizer, tmp_path / "cache", completion_only_loss=flag) for flag in (True, False)
    )
    np.testing.assert_array_equal(masked[:, 0], unmasked[:, 0])
    assert unmasked[:, 1].sum() > masked[:, 1].sum()


# ----------------------------------------------------------------------------------------------------
# Chat generation: generate_flax.py --chat and the server's /v1/chat/completions
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_gpt2_dir(chat_tokenizer_dirs, tmp_path_factory):
    """A tiny random GPT-2 saved by transformers beside the chat tokenizer, its weights drawn wide (as conftest's
    tiny_gpt2_dir) so that greedy decoding wanders."""
    directory = model_dir_with_config(
        chat_tokenizer_dirs["gpt2"], tmp_path_factory.mktemp("chat") / "gpt2", vocab_size=1008, initializer_range=0.3
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).eval().save_pretrained(directory)
    return directory


def load_generator(model_dir) -> generate_flax.Generator:
    model, params, tokenizer = generate_flax.load_model(ModelLoading(str(model_dir)))
    return generate_flax.Generator(model, params, tokenizer, batch_size=4)


@pytest.fixture(scope="module")
def chat_generator(chat_gpt2_dir):
    return load_generator(chat_gpt2_dir)


@pytest.fixture(scope="module")
def turn_ending_dir(chat_gpt2_dir, tmp_path_factory):
    """The tiny chat GPT-2 changed to end every turn at once: the final layer norm gives every position the embedding
    of <|im_end|>, made the longest, so that it is always the most likely next token. Exported by save_model, as
    run_clm_flax.py exports: its generation_config.json lists the end of turn among the tokens that end generation."""
    tokenizer = AutoTokenizer.from_pretrained(chat_gpt2_dir)
    config = AutoConfig.from_pretrained(chat_gpt2_dir)
    state_dict = {
        name: tensor.numpy().copy()
        for name, tensor in AutoModelForCausalLM.from_pretrained(chat_gpt2_dir).state_dict().items()
    }
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    state_dict["transformer.wte.weight"][end_of_turn] *= 20
    state_dict["transformer.ln_f.weight"][:] = 0
    state_dict["transformer.ln_f.bias"][:] = state_dict["transformer.wte.weight"][end_of_turn]
    module = stock_module("gpt2")
    abstract = abstract_model_params(module.MODEL_CLASS(config), np.zeros((1, 8), np.int32))
    directory = tmp_path_factory.mktemp("turn-ending")
    save_model(str(directory), module.from_hf_state_dict(state_dict, abstract), config, tokenizer, stock_code(config))
    return directory


def test_chat_replies_are_transformers_greedy_replies_to_the_rendered_conversation(chat_generator, chat_gpt2_dir):
    conversations = [conversation(0)[:-1], conversation(1)[:-1], [USER_TURN]]
    replies = chat_generator.reply(conversations, Sampling(max_new_tokens=8))
    tokenizer = AutoTokenizer.from_pretrained(chat_gpt2_dir)
    torch_model = AutoModelForCausalLM.from_pretrained(chat_gpt2_dir).eval()
    for messages, reply in zip(conversations, replies):
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = torch_model.generate(
                **prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        new = output[0, prompt["input_ids"].shape[1] :].tolist()
        assert reply["text"] == tokenizer.decode(new, skip_special_tokens=False)
        assert (reply["prompt_tokens"], reply["finish_reason"]) == (prompt["input_ids"].shape[1], "length")


def test_a_reply_ends_at_the_end_of_turn_token_in_flax_and_in_transformers(turn_ending_dir):
    reply = load_generator(turn_ending_dir).reply([[USER_TURN]], Sampling(max_new_tokens=8))[0]
    assert (reply["text"], reply["new_tokens"], reply["finish_reason"]) == ("", 1, "eos")
    tokenizer = AutoTokenizer.from_pretrained(turn_ending_dir)
    torch_model = AutoModelForCausalLM.from_pretrained(turn_ending_dir).eval()
    prompt = tokenizer.apply_chat_template(
        [USER_TURN], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = torch_model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert output[0, prompt["input_ids"].shape[1] :].tolist() == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_chat_prompts_are_user_turns_and_a_jsonl_prompt_file_holds_conversations(tmp_path):
    arguments = generate_flax.GenerationArguments(prompt=["Hi", "Bye"], chat=True)
    assert generate_flax.read_conversations(arguments) == [
        [USER_TURN],
        [{"role": "user", "content": "Bye"}],
    ]
    rows = [conversation(0), {"messages": conversation(1)}]
    prompt_file = tmp_path / "conversations.jsonl"
    prompt_file.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    arguments = generate_flax.GenerationArguments(prompt_file=str(prompt_file), chat=True)
    assert generate_flax.read_conversations(arguments) == [conversation(0), conversation(1)]


@pytest.fixture(scope="module")
def chat_server(chat_generator):
    """The server of the tiny chat GPT-2, in this process: (its URL, its model's name)."""
    with running_server(chat_generator) as (url, _):
        yield url, chat_generator.model.config.name_or_path


def test_the_openai_client_gets_a_chat_completion_and_a_streamed_one(chat_generator, chat_server):
    messages = conversation(1)[:-1]
    expected = chat_generator.reply([messages], Sampling(max_new_tokens=6))[0]
    url, model = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (expected["text"], "length")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (expected["prompt_tokens"], 6)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected["text"]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_logprobs_equal_the_completions_endpoints_and_n_replies_fill_the_room_left(chat_generator, chat_server):
    messages = conversation(1)[:-1]
    url, model = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # No max_tokens: up to the room left after the conversation (64 positions), at most the server's limit (32)
    answer = client.chat.completions.create(
        model=model, messages=messages, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=3
    )
    prompt_ids = chat_generator.encode_conversations([messages], 1, "conversation")[0]
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content
    assert answer.usage.prompt_tokens == len(prompt_ids)
    # The same draws in this process: choice i is row i of the request, drawn by its own index
    max_new_tokens = min(32, 64 - len(prompt_ids))
    samplings = [Sampling(max_new_tokens, temperature=1.0, seed=3, prompt_index=index) for index in range(2)]
    for choice, ended in zip(answer.choices, chat_generator.decode([prompt_ids] * 2, samplings)):
        content = choice.logprobs.content
        assert choice.message.content == ended.text
        assert [entry.token for entry in content] == [chat_generator.tokenizer.decode([i]) for i in ended.ids]
        if choice.finish_reason == "length":
            assert len(content) == max_new_tokens
        # The completions endpoint's numbers for the same tokens
        scored = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": prompt_ids + ended.ids, "max_tokens": 0, "echo": True, "logprobs": 3},
            timeout=120,
        ).json()["choices"][0]["logprobs"]
        # (scored in a batch of another shape: equal to float32's rounding)
        assert [entry.logprob for entry in content] == pytest.approx(
            scored["token_logprobs"][len(prompt_ids) :], abs=1e-5
        )
        for entry, top in zip(content, scored["top_logprobs"][len(prompt_ids) :]):
            shown = {candidate.token: candidate.logprob for candidate in entry.top_logprobs}
            assert len(shown) == 3 and shown == pytest.approx({token: top[token] for token in shown}, abs=1e-5)
            assert bytes(entry.bytes).decode() == entry.token


def test_the_server_ends_a_reply_at_the_end_of_turn_token(turn_ending_dir):
    generator = load_generator(turn_ending_dir)
    with running_server(generator) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        request = dict(model=generator.model.config.name_or_path, messages=[USER_TURN])
        answer = client.chat.completions.create(**request, max_tokens=8)
        chunks = list(client.chat.completions.create(**request, max_tokens=8, stream=True))
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("", "stop")
    assert answer.usage.completion_tokens == 1
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "stop"


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"messages": [{"role": "user"}]}, "messages", "conversation 1 has no text in message 1"),
        ({}, "messages", '"messages" is missing'),
        ({"messages": [USER_TURN], "tools": [{"type": "function"}]}, "tools", '"tools" is not supported'),
        ({"messages": [USER_TURN], "max_completion_tokens": 33}, "max_completion_tokens", "max_completion_tokens 33"),
        ({"messages": [USER_TURN], "top_logprobs": 2}, "top_logprobs", '"top_logprobs" needs "logprobs": true'),
        ({"messages": [USER_TURN], "logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
        ({"messages": [USER_TURN], "logprobs": True, "stream": True}, "logprobs", "not supported with"),
        ({"messages": [USER_TURN], "n": 5}, "n", '"n" 5 times 1 prompts is 5 choices'),
        ({"messages": [USER_TURN], "presence_penalty": -2.5}, None, "presence_penalty must be from -2 to 2"),
    ],
)
def test_bad_chat_requests_are_refused_in_openai_error_shape(chat_server, fields, param, message):
    url, model = chat_server
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": model, **fields}, timeout=120)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and message in error["message"]


def test_a_model_without_a_chat_template_refuses_conversations(generator):
    with running_server(generator) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="tokenizer has no chat template"):
            client.chat.completions.create(model=generator.model.config.name_or_path, messages=[USER_TURN])


# ----------------------------------------------------------------------------------------------------
# train_tokenizer.py --chat_template
# ----------------------------------------------------------------------------------------------------


def test_train_tokenizer_writes_a_chat_template_training_reads_with_the_assistants_tokens_marked(run_tool, tmp_path):
    corpus = os.path.join(FIXTURES_DIR, "en", "train.txt")
    output_dir = tmp_path / "tokenizer"
    result = run_tool(
        "train_tokenizer.py", "--train_file", corpus, "--model_type", "llama", "--vocab_size", 300,
        "--chat_template", "--output_dir", output_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not marks_assistant_tokens(AutoTokenizer.from_pretrained(output_dir).chat_template)  # for other engines
    _, tokenizer = load_config_and_tokenizer(
        ModelArguments(tokenizer_name=str(output_dir), model_type="llama"), "llama"
    )
    assert tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", *CHAT_SPECIAL_TOKENS]) == [
        0,
        1,
        2,
        3,
    ]
    rendered = tokenizer.apply_chat_template(conversation(0), return_dict=True, return_assistant_tokens_mask=True)
    trained = [token for token, flag in zip(rendered["input_ids"], rendered["assistant_masks"]) if flag]
    assert tokenizer.decode(trained) == "apple apple.<|im_end|>"
    assert rendered["input_ids"][0] == tokenizer.bos_token_id
    refused = run_tool(
        "train_tokenizer.py",
        "--train_file",
        corpus,
        "--model_type",
        "roberta",
        "--chat_template",
        "--output_dir",
        tmp_path / "r",
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: --chat_template is for"
    )


def test_packing_refuses_conversations_that_would_not_start_a_document_of_their_own(chat_tokenizer_dirs, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dirs["llama"])
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE.replace("{{- bos_token -}}", "")  # no <|begin_of_text|> first
    data_file = write_rows(tmp_path / "data.jsonl", [data_row(CONVERSATIONS, number) for number in range(3)])
    with pytest.raises(UsageError, match=re.escape("does not hold the token <|begin_of_text|> where alone it")):
        rows_of(data_file, tokenizer, tmp_path / "cache", packing=True)
    # One per row, each is as the template renders it: no <|begin_of_text|> is added.
    rows = rows_of(data_file, tokenizer, tmp_path / "cache")
    assert (rows[:, 0, 0] == tokenizer.convert_tokens_to_ids("<|im_start|>")).all()
