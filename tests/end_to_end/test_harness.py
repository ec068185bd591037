"""lm-evaluation-harness tasks scored by the JAX model (flax_lm.evaluation.harness, run_clm_flax.py --eval_tasks) and
through the server (generate_flax.py --serve under lm-eval's local-completions backend) agree with lm-eval's hf
backend, which scores the same export in PyTorch. The tasks are local ones written here: multiple choice, a perplexity
over texts longer than the model's 64 positions, and a generative one."""

import importlib.util
import json
import re
import shutil
import sys

import datasets
import jax
import lm_eval.evaluator
import numpy as np
import openai
import pytest
import torch
from conftest import FIXTURES_DIR
from jax.sharding import NamedSharding, PartitionSpec
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from test_clm import TINY_FAMILY_CONFIGS, run_clm_flax, run_script, scalars
from test_serve import running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from flax_lm.data.chat import DEFAULT_CHAT_TEMPLATE
from flax_lm.data.source import TextSource
from flax_lm.data.texts import token_byte_counts
from flax_lm.devices.mesh import BATCH_AXES, create_mesh
from flax_lm.errors import UsageError
from flax_lm.evaluation.harness import FlaxLM, HarnessTasks, metric_values, task_index
from flax_lm.models.huggingface import ModelLoading

CHOICE, TEXTS, GENERATION, VALIDATION = "tiny_choice", "tiny_texts", "tiny_generation", "tiny_validation"
SHORT_CHOICE = "tiny_choice_zero_shot"
TASKS = [CHOICE, TEXTS, GENERATION]
TASK_SETTINGS = {
    CHOICE: {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    },
    GENERATION: {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{choices[0]}}",
        # A stop string the untrained model writes early, and one it never writes.
        "generation_kwargs": {"until": ["e", "\n\n"], "max_gen_toks": 12},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    },
}
PERPLEXITY_SETTINGS = {
    "output_type": "loglikelihood_rolling",
    "doc_to_text": "",
    "doc_to_target": "{{text}}",
    "metric_list": [
        {"metric": name, "aggregation": aggregation, "higher_is_better": False}
        for name, aggregation in [
            ("word_perplexity", "weighted_perplexity"),
            ("byte_perplexity", "weighted_perplexity"),
            ("bits_per_byte", "bits_per_byte"),
        ]
    ],
}
TASK_SETTINGS[TEXTS] = TASK_SETTINGS[VALIDATION] = PERPLEXITY_SETTINGS
DATA_FILES = {CHOICE: "choice.jsonl", GENERATION: "choice.jsonl", TEXTS: "texts.jsonl", VALIDATION: "validation.jsonl"}


def fixture_sentences() -> list[str]:
    text = (FIXTURES_DIR / "en" / "validation.txt").read_text()
    return [sentence.strip() for sentence in re.findall(r"[^.?!]+[.?!]", text)]


def write_local_tasks(directory, tokenizer_dir) -> int:
    """Task YAML files and their data (JSON lines) into `directory`, as a user writes a task of their own. The
    documents of the validation task are four sentences of one token length N after an empty one: as validation data
    of run_clm_flax.py with --block_size N + 1, each block is then one sentence after the end-of-text token, as
    lm-eval's rolling windows score it. Returns N + 1."""
    sentences = fixture_sentences()
    # Six questions: a sentence's first five words, the next four as the answer, those of two other sentences as the
    # wrong choices.
    long_sentences = [sentence.split() for sentence in sentences if len(sentence.split()) >= 9]
    choices = [
        {"question": " ".join(long_sentences[3 * number][:5]), "answer": 0}
        | {"choices": [" " + " ".join(words[5:9]) for words in long_sentences[3 * number : 3 * number + 3]]}
        for number in range(6)
    ]
    texts = [" ".join(sentences[20:21]), " ".join(sentences[21:23]), " ".join(sentences[23:35])]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths = [len(tokenizer(sentence)["input_ids"]) for sentence in sentences]
    length = max(set(lengths), key=lambda n: (n < 64 and lengths.count(n) >= 4, n))
    validation = [""] + [sentence for sentence, n in zip(sentences, lengths) if n == length][:4]
    documents = {
        "choice.jsonl": choices,
        "texts.jsonl": [{"text": text} for text in texts],
        "validation.jsonl": [{"text": text} for text in validation],
    }
    for name, rows in documents.items():
        (directory / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    for task, settings in TASK_SETTINGS.items():
        data_files = {"test": str(directory / DATA_FILES[task])}
        config = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": data_files}}
        config |= {"test_split": "test", **settings}
        (directory / f"{task}.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML
    return length + 1


@pytest.fixture(scope="module")
def local_tasks(tiny_gpt2_dir, tmp_path_factory):
    """(the directory of the local tasks, the block size that makes each validation document a block)."""
    directory = tmp_path_factory.mktemp("tasks")
    return directory, write_local_tasks(directory, tiny_gpt2_dir)


@pytest.fixture(scope="module")
def tasks_dir(local_tasks):
    return local_tasks[0]


def evaluate(model, tasks_dir, tasks=TASKS, model_args: dict | None = None) -> dict:
    """lm_eval.simple_evaluate of `model` (an LM, or a backend's name with `model_args`), with every request's answers
    logged."""
    task_index = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.evaluator.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=task_index, bootstrap_iters=0
    )


def answers(results: dict, task: str) -> list:
    """The model's answer to every request of a task, in order."""
    return [answer for sample in results["samples"][task] for [answer] in sample["resps"]]


@pytest.fixture(scope="module")
def hf_results(tiny_gpt2_dir, tasks_dir):
    """The hf backend on the tiny GPT-2 in PyTorch."""
    return evaluate(HFLM(pretrained=str(tiny_gpt2_dir), batch_size=4, device="cpu"), tasks_dir)


@pytest.fixture(scope="module")
def flax_results(generator, tasks_dir):
    """The JAX model of generate_flax.py, through lm-eval's model interface, as run_clm_flax.py scores it."""
    model = FlaxLM(generator.scorer, generator.sampler, generator.tokenizer, batch_size=4)
    model.params = generator.params
    return evaluate(model, tasks_dir)


def assert_same_log_likelihoods(answers, expected, atol=1e-3):
    log_likelihoods = [answer[0] if isinstance(answer, tuple) else answer for answer in answers]
    expected_log_likelihoods = [answer[0] if isinstance(answer, tuple) else answer for answer in expected]
    np.testing.assert_allclose(log_likelihoods, expected_log_likelihoods, rtol=0, atol=atol)


def test_the_jax_model_scores_each_choice_as_the_hf_backend_does(flax_results, hf_results):
    ours, theirs = answers(flax_results, CHOICE), answers(hf_results, CHOICE)
    assert len(ours) == 18
    assert_same_log_likelihoods(ours, theirs)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert metric_values(flax_results["results"])[CHOICE] == metric_values(hf_results["results"])[CHOICE]


def test_the_jax_model_scores_texts_longer_than_its_positions_as_the_hf_backend_does(
    flax_results, hf_results, tiny_gpt2_dir
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    texts = [sample["doc"]["text"] for sample in hf_results["samples"][TEXTS]]
    assert max(len(tokenizer(text)["input_ids"]) for text in texts) > 2 * 64  # three windows of the 64 positions
    assert_same_log_likelihoods(answers(flax_results, TEXTS), answers(hf_results, TEXTS))
    ours, theirs = metric_values(flax_results["results"])[TEXTS], metric_values(hf_results["results"])[TEXTS]
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_the_jax_model_generates_the_texts_of_the_hf_backend_up_to_the_stop_string(flax_results, hf_results):
    ours, theirs = answers(flax_results, GENERATION), answers(hf_results, GENERATION)
    assert ours == theirs
    assert all("e" not in text for text in ours) and any(len(text) < 8 for text in ours), ours


def test_local_completions_against_the_server_score_each_choice_as_the_hf_backend_does(
    generator, tasks_dir, hf_results
):
    with running_server(generator) as (url, _):
        model_id = generator.model.config.name_or_path
        model_args = {"base_url": f"{url}/v1/completions", "model": model_id, "tokenizer": model_id}
        model_args |= {"tokenizer_backend": "huggingface", "max_length": 64, "batch_size": 4}
        results = evaluate("local-completions", tasks_dir, [CHOICE], model_args)
    ours, theirs = answers(results, CHOICE), answers(hf_results, CHOICE)
    assert_same_log_likelihoods(ours, theirs)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert metric_values(results["results"])[CHOICE] == metric_values(hf_results["results"])[CHOICE]


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tiny_gpt2_dir, tmp_path_factory):
    """A tiny random Gemma 3 (a model module of its own: a local layer of a window shorter than the tasks' texts,
    QK-norm, scaled embeddings) saved by transformers beside the tiny GPT-2's tokenizer."""
    directory = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    shutil.copytree(tiny_gpt2_dir, directory, ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = TINY_FAMILY_CONFIGS["gemma3"](vocab_size=len(tokenizer), initializer_range=0.3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_gemma3_scores_each_choice_in_jax_and_through_the_server_as_the_hf_backend_does(tiny_gemma3_dir, tasks_dir):
    """The lm-eval routes of a model module besides GPT-2's: run_clm_flax.py's --eval_tasks (FlaxLM) and
    local-completions against generate_flax.py's server; and the server's greedy completion."""
    import generate_flax

    model, params, tokenizer = generate_flax.load_model(ModelLoading(str(tiny_gemma3_dir)))
    generator = generate_flax.Generator(model, params, tokenizer, batch_size=4)
    flax_model = FlaxLM(generator.scorer, generator.sampler, generator.tokenizer, batch_size=4)
    flax_model.params = generator.params
    theirs = answers(
        evaluate(HFLM(pretrained=str(tiny_gemma3_dir), batch_size=4, device="cpu"), tasks_dir, [CHOICE]), CHOICE
    )
    assert len({score for score, _ in theirs}) == len(theirs)  # a model that tells the choices apart
    assert_same_log_likelihoods(answers(evaluate(flax_model, tasks_dir, [CHOICE]), CHOICE), theirs)
    with running_server(generator) as (url, _):
        model_args = {"base_url": f"{url}/v1/completions", "model": str(tiny_gemma3_dir)}
        model_args |= {"tokenizer": str(tiny_gemma3_dir), "tokenizer_backend": "huggingface", "max_length": 64}
        through_the_server = evaluate("local-completions", tasks_dir, [CHOICE], model_args | {"batch_size": 4})
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = "In the morning the old house was quiet and"  # with the reply, longer than the window of 8
        reply = client.completions.create(model=str(tiny_gemma3_dir), prompt=prompt, max_tokens=10, temperature=0)
    assert_same_log_likelihoods(answers(through_the_server, CHOICE), theirs)
    # The server's greedy reply is transformers' generate's.
    prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch_model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir).eval()
    expected = torch_model.generate(prompt_ids, max_new_tokens=10, do_sample=False)[0, prompt_ids.shape[1] :]
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(expected) > 0
    assert prompt_ids.shape[1] + len(expected) > 8  # the local layer's window slid


@pytest.fixture(scope="module")
def evaluation_only(tiny_gpt2_dir, tasks_dir, tmp_path_factory):
    """run_clm_flax.py --do_eval on the tiny GPT-2's export with no data of its own, scoring the first 4 documents of
    the choice task."""
    output_dir = tmp_path_factory.mktemp("evaluation-only")
    arguments = [
        "--output_dir", output_dir, "--model_name_or_path", tiny_gpt2_dir, "--do_eval", "--eval_tasks", CHOICE,
        "--eval_tasks_path", tasks_dir, "--eval_tasks_limit", 4, "--sample_tokens", 0, "--report_to", "tensorboard",
    ]  # fmt: skip
    result = run_script(list(map(str, arguments)))
    return output_dir, result


def test_evaluation_only_scores_an_export_into_the_results_and_trackers(evaluation_only, hf_results):
    output_dir, result = evaluation_only
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    all_results = json.loads((output_dir / "all_results.json").read_text())
    assert eval_results.keys() == {f"eval_{CHOICE}_acc", f"eval_{CHOICE}_acc_norm", "step"}
    first_four = hf_results["samples"][CHOICE][:4]
    for metric in ("acc", "acc_norm"):
        expected = np.mean([sample[metric] for sample in first_four])
        assert eval_results[f"eval_{CHOICE}_{metric}"] == all_results[f"eval_{CHOICE}_{metric}"] == expected
        assert scalars(output_dir, f"eval/{CHOICE}/{metric}") == [(0, pytest.approx(expected))]
    assert f"eval tasks: {CHOICE} acc " in result.stdout


def test_a_perplexity_task_agrees_with_the_eval_loss_on_the_same_text(generator, local_tasks):
    tasks_dir, block_size = local_tasks
    texts = datasets.load_dataset("json", data_files=str(tasks_dir / "validation.jsonl"), split="train")
    blocks = np.concatenate(
        list(run_clm_flax.tokenized_rows(texts, "validation", generator.tokenizer, block_size, TextSource()))
    )
    assert len(blocks) == 4  # each document after the end-of-text token that the empty one before it wrote
    token_bytes = token_byte_counts(generator.tokenizer, generator.model.config.vocab_size)
    eval_step = jax.jit(run_clm_flax.make_eval_step(generator.model, token_bytes))
    sharding = NamedSharding(create_mesh(), PartitionSpec(BATCH_AXES))
    eval_results = run_clm_flax.evaluation_results(
        run_clm_flax.evaluation_sums(eval_step, generator.params, blocks, 4, sharding)
    )
    model = FlaxLM(generator.scorer, generator.sampler, generator.tokenizer, batch_size=4)
    task_results = HarnessTasks([VALIDATION], str(tasks_dir), None, model)(generator.params)[VALIDATION]
    assert task_results["bits_per_byte"] == pytest.approx(eval_results["bits_per_byte"], rel=1e-5)
    assert task_results["byte_perplexity"] == pytest.approx(2 ** eval_results["bits_per_byte"], rel=1e-5)


def test_a_task_whose_data_cannot_be_read_is_refused_in_one_line(generator, tasks_dir, tmp_path):
    broken = json.loads((tasks_dir / f"{CHOICE}.yaml").read_text())
    broken |= {"task": "broken", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "missing.jsonl")}}}
    (tmp_path / "broken.yaml").write_text(json.dumps(broken))
    model = FlaxLM(generator.scorer, generator.sampler, generator.tokenizer, batch_size=4)
    with pytest.raises(UsageError, match="^--eval_tasks broken: cannot load the tasks: .*missing.jsonl") as error:
        HarnessTasks(["broken"], str(tmp_path), None, model)
    assert "\n" not in str(error.value)


def test_a_task_file_that_does_not_parse_is_named_with_its_error(tmp_path):
    """lm-eval leaves a task YAML it cannot parse out of its index: the task is then unknown, and the message names
    the file and YAML's error rather than the task alone."""
    (tmp_path / "bad.yaml").write_text("task: bad\ndataset_path: json\ndoc_to_text: [unclosed\n")
    with pytest.raises(UsageError) as error:
        task_index(["bad"], str(tmp_path))
    message = str(error.value)
    assert "bad.yaml under --eval_tasks_path does not parse as YAML" in message and "\n" not in message, message
    assert "line 4" in message or "line 3" in message, message


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--do_train", "--eval_tasks", CHOICE], "--eval_tasks are scored at each evaluation: add --do_eval"),
        (["--eval_tasks_limit", "5"], "--eval_tasks_path, --eval_tasks_limit and --apply_chat_template apply to --ev"),
        (["--apply_chat_template"], "--eval_tasks_path, --eval_tasks_limit and --apply_chat_template apply to --eval"),
        (["--eval_tasks", CHOICE, "--fewshot_as_multiturn"], "--fewshot_as_multiturn makes the few-shot examples"),
        (["--eval_tasks", CHOICE, "--eval_tasks_path", "no-such-dir"], "--eval_tasks_path no-such-dir is not a dir"),
        (["--eval_tasks", CHOICE, "--eval_tasks_limit", "0"], "--eval_tasks_limit 0 must be at least 1"),
    ],
)
def test_bad_task_arguments_are_refused_in_one_line(arguments, message, tiny_gpt2_dir, tmp_path, monkeypatch):
    train_file = str(FIXTURES_DIR / "en" / "train.txt")
    command_line = [
        "--output_dir",
        str(tmp_path),
        "--model_name_or_path",
        str(tiny_gpt2_dir),
        "--train_file",
        train_file,
    ]
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *command_line, *arguments])
    with pytest.raises(UsageError, match=re.escape(message)):
        run_clm_flax.main()


def test_eval_tasks_without_lm_eval_installed_are_refused_in_one_line(tiny_gpt2_dir, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "lm_eval" else find_spec(name, *rest)
    )
    command_line = ["--output_dir", str(tmp_path), "--model_name_or_path", str(tiny_gpt2_dir), "--eval_tasks", CHOICE]
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *command_line])
    with pytest.raises(
        UsageError, match="^--eval_tasks needs lm-evaluation-harness, which is not installed: pip install lm_eval$"
    ):
        run_clm_flax.main()


@pytest.fixture(scope="module")
def chat_setup(tiny_gpt2_dir, tasks_dir, tmp_path_factory):
    """The tiny GPT-2 with the default chat template (its ChatML markers are text to this tokenizer), its
    generate_flax.py Generator, and the local tasks for chat."""
    import generate_flax

    root = tmp_path_factory.mktemp("chat-tasks")
    model_dir = shutil.copytree(tiny_gpt2_dir, root / "tiny-chat-gpt2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    chat_tasks_dir = shutil.copytree(tasks_dir, root / "tasks")
    # One few-shot example for the choices; none for the generation and for a copy of the choices that the server
    # scores: those conversations fit the 64 positions whole, which the server requires (lm-eval's backends cut a
    # longer prompt's start off, each by its own rule).
    for task, name, shots in ((CHOICE, CHOICE, 1), (GENERATION, GENERATION, 0), (CHOICE, SHORT_CHOICE, 0)):
        config = json.loads((chat_tasks_dir / f"{task}.yaml").read_text())
        (chat_tasks_dir / f"{name}.yaml").write_text(json.dumps(config | {"task": name, "num_fewshot": shots}))
    model, params, tokenizer = generate_flax.load_model(ModelLoading(str(model_dir)))
    return model_dir, chat_tasks_dir, generate_flax.Generator(model, params, tokenizer, batch_size=4)


def chat_evaluate(model, tasks_dir, tasks=(CHOICE, GENERATION), model_args: dict | None = None) -> dict:
    """lm-eval as `lm_eval --apply_chat_template` runs it (few-shot examples as turns, its default then)."""
    task_index = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.evaluator.simple_evaluate(
        model=model, model_args=model_args, tasks=list(tasks), task_manager=task_index, bootstrap_iters=0,
        apply_chat_template=True, fewshot_as_multiturn=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def chat_results(chat_setup):
    model_dir, chat_tasks_dir, generator = chat_setup
    hf = chat_evaluate(
        HFLM(pretrained=str(model_dir), batch_size=4, device="cpu"), chat_tasks_dir, [CHOICE, GENERATION, SHORT_CHOICE]
    )
    model = FlaxLM(generator.scorer, generator.sampler, generator.tokenizer, batch_size=4)
    model.params = generator.params
    ours = chat_evaluate(model, chat_tasks_dir)
    # What run_clm_flax.py --eval_tasks --apply_chat_template computes at an evaluation.
    in_training = HarnessTasks([CHOICE, GENERATION], str(chat_tasks_dir), None, model, True, True)(generator.params)
    # Through the server: the choices scored by local-completions on prompts the client renders with the tokenizer's
    # template; the generation asked of local-chat-completions, whose messages the server renders.
    with running_server(generator) as (url, _):
        model_args = {"model": str(model_dir), "tokenizer": str(model_dir), "tokenizer_backend": "huggingface"}
        model_args |= {"max_length": 64, "batch_size": 4}
        served = chat_evaluate(
            "local-completions", chat_tasks_dir, [SHORT_CHOICE], model_args | {"base_url": f"{url}/v1/completions"}
        )
        chat_args = {"model": str(model_dir), "base_url": f"{url}/v1/chat/completions", "max_length": 64}
        served_chat = chat_evaluate("local-chat-completions", chat_tasks_dir, [GENERATION], chat_args)
    return hf, ours, in_training, {SHORT_CHOICE: served, GENERATION: served_chat}


@pytest.mark.parametrize("task", [CHOICE, GENERATION])
def test_with_apply_chat_template_the_jax_model_answers_chat_prompts_as_the_hf_backend_does(
    task, chat_setup, chat_results
):
    hf, ours, in_training, through_the_server = chat_results
    contexts = [sample["arguments"][0][0] for sample in hf["samples"][task]]
    # The prompt is a conversation: the few-shot example (if any) and the question each a user turn, then the
    # assistant's.
    user_turns = 2 if task == CHOICE else 1
    assert all(context.count("<|im_start|>user\n") == user_turns for context in contexts), contexts[0]
    assert all(context.endswith("<|im_start|>assistant\n") for context in contexts), contexts[0]
    assert [sample["arguments"] for sample in ours["samples"][task]] == [
        sample["arguments"] for sample in hf["samples"][task]
    ]
    if task == CHOICE:
        assert_same_log_likelihoods(answers(ours, task), answers(hf, task))
        assert [greedy for _, greedy in answers(ours, task)] == [greedy for _, greedy in answers(hf, task)]
    else:
        assert answers(ours, task) == answers(hf, task)
    assert metric_values(ours["results"])[task] == metric_values(hf["results"])[task] == in_training[task]
    task = SHORT_CHOICE if task == CHOICE else task
    served = through_the_server[task]
    if task == SHORT_CHOICE:
        assert [sample["arguments"] for sample in served["samples"][task]] == [
            sample["arguments"] for sample in hf["samples"][task]
        ]
        assert_same_log_likelihoods(answers(served, task), answers(hf, task))
    else:
        # The chat endpoint got the conversation itself; rendered by the tokenizer's template, it is the hf backend's
        # prompt, and the server answered what the hf backend generated from that prompt.
        tokenizer = AutoTokenizer.from_pretrained(chat_setup[0])
        conversations = [json.loads(sample["arguments"][0][0][0]) for sample in served["samples"][task]]
        rendered = [
            tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) for turns in conversations
        ]
        assert rendered == [sample["arguments"][0][0] for sample in hf["samples"][task]]
        assert answers(served, task) == answers(hf, task)
    assert metric_values(served["results"])[task] == metric_values(hf["results"])[task]
