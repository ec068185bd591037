"""run_grpo_flax.py's loss against TRL's GRPOTrainer: the same tiny Llama, the same prompts, completions, advantages
and reference model, the loss and every gradient equal."""

import sys

import jax
import numpy as np
import pytest
import torch
from conftest import REPO_DIR
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flax_lm.command_line.arguments import ModelArguments
from flax_lm.command_line.model_loading import model_loading
from flax_lm.models.llama.model import to_hf_state_dict
from flax_lm.server.generator import load_model

sys.path.insert(0, str(REPO_DIR))
import run_grpo_flax  # noqa: E402

CHARACTERS = "0123456789+= "
BATCH, PROMPT_LENGTH, COMPLETION_LENGTH = 4, 4, 5


def save_tiny_llama(directory, seed: int):
    """A tiny random Llama with a tokenizer of one token a character, written as transformers writes them."""
    vocab = {"<|endoftext|>": 0, **{character: i + 1 for i, character in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=64
    ).save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, eos_token_id=0, bos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def fixed_step(tmp_path_factory):
    """The two models (the policy and another as the reference) and one step's fixed inputs, with ragged
    completions (a mask ending early) and advantages of both signs."""
    policy = save_tiny_llama(tmp_path_factory.mktemp("policy"), 0)
    reference = save_tiny_llama(tmp_path_factory.mktemp("reference"), 1)
    rng = np.random.default_rng(0)
    step = {
        "prompt_ids": rng.integers(1, 14, (BATCH, PROMPT_LENGTH)).astype(np.int32),
        "prompt_mask": np.ones((BATCH, PROMPT_LENGTH), np.float32),
        "completion_ids": rng.integers(0, 14, (BATCH, COMPLETION_LENGTH)).astype(np.int32),
        "completion_mask": np.array([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], np.float32),
        "advantages": np.array([1.2, -0.5, 0.3, -0.4], np.float32),
    }
    return policy, reference, step


def trl_loss_and_gradients(policy, reference, step, loss_type: str, beta: float, temperature: float):
    """GRPOTrainer's _compute_loss on the step's completions, as _generate_and_score_completions hands them over."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(REPO_DIR / "unused"), num_generations=2, per_device_train_batch_size=BATCH,
        max_completion_length=COMPLETION_LENGTH, beta=beta, loss_type=loss_type, temperature=temperature,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda prompts, completions, **_: [0.0] * len(prompts),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1+2="}] * BATCH),
        processing_class=PreTrainedTokenizerFast.from_pretrained(policy),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test does not run
    inputs = {name: torch.tensor(value) for name, value in step.items()}
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        inputs[name] = inputs[name].long()
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    if beta:
        reference_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            trainer.ref_model.load_state_dict(reference_model.state_dict())  # the trainer's copy of the policy
            log_probs = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, COMPLETION_LENGTH)
            inputs["ref_per_token_logps"] = log_probs[0]
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    gradients = {name: parameter.grad.numpy() for name, parameter in trainer.model.named_parameters()}
    return loss.item(), gradients, trainer._metrics["train"]


@pytest.mark.parametrize(("loss_type", "beta", "temperature"), [("grpo", 0.04, 1.0), ("dr_grpo", 0.1, 0.7)])
def test_the_loss_and_its_gradients_equal_trls(fixed_step, loss_type, beta, temperature):
    policy, reference, step = fixed_step
    model, params, _ = load_model(model_loading(ModelArguments(policy)))
    _, ref_params, _ = load_model(model_loading(ModelArguments(reference)))
    settings = run_grpo_flax.LossSettings(temperature, beta, 0.2, 0.2, loss_type, COMPLETION_LENGTH)
    # As the script's Reference adds them to each batch: the reference's log-probabilities of the completions.
    step = step | {"ref_log_probs": run_grpo_flax.batch_log_probs(model, ref_params, step, temperature)}
    loss_and_gradients = jax.value_and_grad(run_grpo_flax.grpo_loss, has_aux=True)
    (loss, metrics), gradients = loss_and_gradients(params, model, step, settings)
    trl_loss, trl_gradients, trl_metrics = trl_loss_and_gradients(
        policy, reference, step, loss_type, beta, temperature
    )
    assert abs(trl_loss) > 1e-3  # a loss that says something: the advantages do not cancel out
    np.testing.assert_allclose(float(loss), trl_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["kl"]), trl_metrics["kl"][-1], rtol=1e-4)
    ours = to_hf_state_dict(jax.tree.map(np.asarray, gradients))
    for name, gradient in trl_gradients.items():
        scale = np.abs(gradient).max()
        np.testing.assert_allclose(ours[name], gradient, atol=1e-5 * scale + 1e-7, err_msg=name)
