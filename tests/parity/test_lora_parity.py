"""LoRA adapters against PEFT's: the adapter directory a run writes (flax_lm/training/lora.py), loaded by
`peft.PeftModel.from_pretrained(base, directory)` on the base model in PyTorch, computes the logits of our adapted
model, for Llama's seven projections, GPT-2's Conv1D layers (PEFT's fan_in_fan_out) and RoBERTa's (run_mlm_flax.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from peft import PeftModel
from test_clm import tiny_config, tiny_llama_config
from test_mlm_model import tiny_config as tiny_roberta_config

from flax_lm.models import stock_module
from flax_lm.training import lora

IDS = np.random.RandomState(0).randint(3, 100, (2, 16))  # ids of every tiny vocabulary, none a padding token
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(
    "config, target_modules",
    [
        (tiny_llama_config(tie_word_embeddings=False), LLAMA_TARGETS),
        (tiny_config(), ("c_attn", "c_proj", "c_fc")),
        (tiny_roberta_config(), ("query", "key", "value", "dense")),
    ],
    ids=["llama", "gpt2", "roberta"],
)
def test_peft_loads_the_adapters_and_computes_our_adapted_model(config, target_modules, tmp_path):
    module = stock_module(config.model_type)
    model = module.MODEL_CLASS(config)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), IDS)["params"])
    targets = lora.adapter_targets(shapes, module, target_modules)
    settings = lora.LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=target_modules)
    adapted = lora.adapted_model(model, targets, settings, seed=0)
    params = nn.meta.unbox(jax.jit(adapted.init)(jax.random.key(0), IDS)["params"])
    # Trained adapters: B away from its zeros, so that every adapter changes the logits.
    params = jax.tree_util.tree_map_with_path(
        lambda path, value: (
            value + 0.1 * jax.random.normal(jax.random.key(len(path)), value.shape)
            if path[-1].key == "lora_B"
            else value
        ),
        params,
    )
    logits = np.asarray(jax.jit(adapted.apply)({"params": params}, jnp.asarray(IDS)))
    base = getattr(transformers, module.HF_ARCHITECTURES[config.model_type])(config).eval()
    state_dict = {
        name: torch.tensor(value) for name, value in module.to_hf_state_dict(lora.without_adapters(params)).items()
    }
    base.load_state_dict(state_dict, strict=False)  # a tied lm_head is the embedding
    task_type = "CAUSAL_LM" if module.GENERATES_TEXT else None  # PEFT has no task type of masked language models
    lora.write_adapter(str(tmp_path), params, targets, settings, "base", task_type)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    with torch.no_grad():
        peft_logits = peft_model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(peft_logits, logits, atol=1e-4)
    assert peft_model.peft_config["default"].fan_in_fan_out == (config.model_type == "gpt2")
    assert len([name for name, _ in peft_model.named_modules() if name.endswith(".lora_A")]) == len(targets)
