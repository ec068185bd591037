"""run_dpo_flax.py: its losses against the formulas worked by hand, the metrics of padded batches, preference pairs
as rows (truncation, the implicit prompt) and the refusals of bad pairs and flags."""

import json
import math
import sys
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from test_clm import tiny_llama_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from flax_lm.data.chat import DEFAULT_CHAT_TEMPLATE
from flax_lm.data.preferences import check_pair, pair_rows
from flax_lm.models import stock_module
from flax_lm.training import lora
from flax_lm.training.train_state import TrainState

sys.path.insert(0, str(REPO_DIR))
import run_dpo_flax  # noqa: E402

# Eight prompts, each with a sensible and a senseless completion.
PAIRS = [
    ("The capital of France is", " Paris.", " a banana."),
    ("Two plus two equals", " four.", " seven hundred and twelve."),
    ("The sky on a clear day is", " blue.", " made of cheese."),
    ("Water freezes at", " zero degrees.", " noon."),
    ("The opposite of hot is", " cold.", " purple."),
    ("A cat says", " meow.", " the stock market fell."),
    ("Grass is usually", " green.", " loud."),
    ("The sun rises in the", " east.", " refrigerator."),
]


def text_pairs() -> list[dict]:
    return [{"prompt": prompt, "chosen": chosen, "rejected": rejected} for prompt, chosen, rejected in PAIRS]


def conversational_pairs() -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": chosen.strip()}],
            "rejected": [{"role": "assistant", "content": rejected.strip()}],
        }
        for prompt, chosen, rejected in PAIRS
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tiny_llama_tokenizer_dir(directory) -> str:
    """`directory` holding a byte-level BPE tokenizer of 512 tokens (BOS <s> first, EOS </s>, the default chat
    template) and tiny_llama_config() of 128 positions: a model directory without weights."""
    directory = str(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(FIXTURES_DIR / "en" / "train.txt")], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", chat_template=DEFAULT_CHAT_TEMPLATE
    ).save_pretrained(directory)
    tiny_llama_config(max_position_embeddings=128).save_pretrained(directory)
    return directory


def log_sigmoid(value):
    return -math.log1p(math.exp(-value))


def test_each_loss_type_is_its_formula():
    chosen, rejected = jnp.array([1.5, -0.5]), jnp.array([0.5, 2.0])  # log-ratios of policy to reference
    tokens = (jnp.array([3.0, 1.0]), jnp.array([2.0, 4.0]))
    beta, smoothing = 0.2, 0.1
    by_hand = {
        "sigmoid": [-log_sigmoid(beta * (c - r)) for c, r in [(1.5, 0.5), (-0.5, 2.0)]],
        "hinge": [max(0.0, 1 - beta * (c - r)) for c, r in [(1.5, 0.5), (-0.5, 2.0)]],
        "ipo": [(1.5 / 3 - 0.5 / 2 - 1 / (2 * beta)) ** 2, (-0.5 / 1 - 2.0 / 4 - 1 / (2 * beta)) ** 2],
        "robust": [
            (-(1 - smoothing) * log_sigmoid(beta * d) + smoothing * log_sigmoid(-beta * d)) / (1 - 2 * smoothing)
            for d in (1.0, -2.5)
        ],
    }
    assert set(by_hand) == set(run_dpo_flax.DPO_LOSSES)
    for name, expected in by_hand.items():
        losses = run_dpo_flax.DPO_LOSSES[name](chosen, rejected, tokens, beta, smoothing)
        np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5, err_msg=name)


def test_the_metrics_average_over_pairs_and_leave_padding_out():
    completion_mask = np.zeros((3, 2, 4), np.int32)
    completion_mask[:2, :, 2:] = 1  # the third pair is padding: no completion tokens
    batch = {"completion_mask": jnp.asarray(completion_mask), "reference_logps": jnp.array([[-4.0, -5.0]] * 3)}
    policy = jnp.array([[-3.0, -6.0], [-5.0, -4.0], [100.0, -100.0]])
    sums = run_dpo_flax.preference_sums(policy, batch, "sigmoid", 0.5, 0.0)
    metrics = run_dpo_flax.preference_metrics({name: float(value) for name, value in sums.items()})
    # Rewards: 0.5 * (policy - reference): pair 1 (0.5, -0.5), pair 2 (-0.5, 0.5).
    assert metrics["rewards/chosen"] == pytest.approx(0.0)
    assert metrics["rewards/margins"] == pytest.approx(0.0)
    assert metrics["rewards/accuracies"] == pytest.approx(0.5)
    assert metrics["logps/chosen"] == pytest.approx(-4.0)
    assert metrics["loss"] == pytest.approx((-log_sigmoid(1.0) - log_sigmoid(-1.0)) / 2, rel=1e-5)


def test_pairs_are_cut_as_truncation_mode_says_and_padded_on_the_right():
    encoded = [([1, 2, 3], [4, 5], [6]), ([7, 8, 9, 10, 11], [12], [13, 14])]
    rows, dropped = pair_rows(encoded, 4, "keep_start", pad_id=0)
    assert dropped == 1  # the second prompt alone fills the 4 tokens
    np.testing.assert_array_equal(rows[0, 0], [[1, 2, 3, 4], [0, 0, 0, 1]])
    np.testing.assert_array_equal(rows[0, 1], [[1, 2, 3, 6], [0, 0, 0, 1]])
    rows, dropped = pair_rows(encoded, 4, "keep_end", pad_id=0)
    assert dropped == 0
    np.testing.assert_array_equal(rows[0, 0], [[2, 3, 4, 5], [0, 0, 1, 1]])
    np.testing.assert_array_equal(rows[1, 1], [[10, 11, 13, 14], [0, 0, 1, 1]])


def test_a_conversation_without_a_prompt_is_split_where_chosen_and_rejected_part():
    question = {"role": "user", "content": "Sky?"}
    pair = check_pair(
        {
            "chosen": [question, {"role": "assistant", "content": "Blue."}],
            "rejected": [question, {"role": "assistant", "content": "Green."}],
        },
        "pairs.jsonl, row 1",
    )
    assert pair == {
        "prompt": [question],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green."}],
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_tokenizer_dir(tmp_path_factory.mktemp("tiny-llama"))


def run_main(monkeypatch, *arguments):
    monkeypatch.setattr(sys, "argv", ["run_dpo_flax.py", *map(str, arguments)])
    run_dpo_flax.main()


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Hi", "chosen": " there"}, r"pairs.jsonl, row 2 has no 'rejected' field"),
        ({"chosen": " a", "rejected": " b"}, r"pairs.jsonl, row 2 has no 'prompt' field"),
        (
            {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant"}], "rejected": []},
            r"pairs.jsonl, row 2: 'chosen' has no text in message 1",
        ),
    ],
)
def test_a_bad_pair_is_refused_naming_file_row_and_field(model_dir, tmp_path, monkeypatch, row, message):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [text_pairs()[0], row])
    with pytest.raises(run_dpo_flax.UsageError, match=message):
        run_main(monkeypatch, "--model_name_or_path", model_dir, "--validation_file", pairs, "--do_eval",
                 "--output_dir", tmp_path / "out", "--report_to", "none")  # fmt: skip
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--label_smoothing", "0.1"], "--label_smoothing applies to --loss_type robust only"),
        (["--loss_type", "robust", "--label_smoothing", "0.5"], r"--label_smoothing 0.5 must be in \[0, 0.5\)"),
        (["--loss_type", "kto"], "--loss_type kto is not one of sigmoid, hinge, ipo, robust"),
        (["--beta", "0"], "--beta 0.0 must be positive"),
    ],
)
def test_bad_dpo_flags_are_refused(model_dir, tmp_path, monkeypatch, flags, message):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", text_pairs())
    with pytest.raises(run_dpo_flax.UsageError, match=message):
        run_main(monkeypatch, "--model_name_or_path", model_dir, "--train_file", pairs, "--output_dir",
                 tmp_path / "out", *flags)  # fmt: skip


def test_dpo_needs_a_starting_model(tmp_path, monkeypatch):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", text_pairs())
    with pytest.raises(run_dpo_flax.UsageError, match="pass --model_name_or_path"):
        run_main(monkeypatch, "--train_file", pairs, "--output_dir", tmp_path / "out")


def test_under_adapters_the_reference_is_the_base_model_without_them():
    """With LoRA's adapters and no other reference, the train step takes the reference's log-probabilities from the
    same weights with the adapters left out: the rewards are beta times (adapted - base) log-probabilities."""
    config = tiny_llama_config(num_hidden_layers=1)
    module = stock_module("llama")
    ids = jnp.asarray(np.random.RandomState(0).randint(2, 512, (2, 2, 10)), jnp.int32)
    model = module.MODEL_CLASS(config)
    base = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids[0])["params"])
    targets = lora.adapter_targets(base, module, ("q_proj", "v_proj"))
    settings = lora.LoraSettings(rank=2, alpha=4.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
    adapted = lora.adapted_model(model, targets, settings, seed=0)
    # Adapters that change the model (new ones start at B = 0, as the base).
    adapters = {(*target.path, "lora_B"): jnp.full((2, target.fan_out), 0.05) for target in targets}
    adapters |= {(*target.path, "lora_A"): jnp.full((target.fan_in, 2), 0.1) for target in targets}
    params = lora.with_adapters(base, adapters)
    completion_mask = jnp.zeros(ids.shape, jnp.int32).at[:, :, 6:].set(1)
    batch = {"input_ids": ids, "completion_mask": completion_mask}
    optimizer = optax.set_to_zero()  # the rewards of the step's batch are what is compared
    losses = {"loss_type": "sigmoid", "beta": 0.5, "label_smoothing": 0.0}
    step = run_dpo_flax.make_train_step(
        adapted, optimizer, optax.constant_schedule(0.0), 0, losses, lora.is_adapter, reference_is_base=True
    )
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    _, metrics = jax.jit(step)(state, jax.tree_util.tree_map(lambda values: values[None], batch))  # one micro-batch
    policy = jax.jit(partial(run_dpo_flax.pair_log_probs, adapted))(params, batch)
    reference = jax.jit(partial(run_dpo_flax.pair_log_probs, model))(base, batch)
    assert float(jnp.max(jnp.abs(policy - reference))) > 1e-3  # the adapters do change the model
    expected = 0.5 * jnp.sum(policy - reference, axis=0)
    np.testing.assert_allclose(metrics["chosen_reward_sum"], expected[0], rtol=1e-4)
    np.testing.assert_allclose(metrics["rejected_reward_sum"], expected[1], rtol=1e-4)
