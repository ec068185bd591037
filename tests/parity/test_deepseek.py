"""DeepSeek-V3 (flax_lm/models/deepseek_v3/) against transformers' DeepseekV3ForCausalLM: the logits on every route
(no cache, prefilled cache, one token at a time) with its checkpoint read as save_pretrained writes it, with the
query latent and without, plain rotary positions and YaRN's, interleaved and not; the export is that checkpoint; a
sharded bfloat16 checkpoint loads and decodes greedily, left-padded, as generate does; the preset's parameter counts
are the published ones and the module refuses what it does not compute."""

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from test_models import random_torch_model

from flax_lm.errors import UsageError
from flax_lm.generation.sampling import generate_ids, make_sampler
from flax_lm.models import config_class, family, model_code, presets, stock_module
from flax_lm.models.deepseek_v3 import model as deepseek
from flax_lm.models.huggingface import read_safetensors_checkpoint
from flax_lm.training.train_state import abstract_model_params

SHAPES = dict(
    vocab_size=120, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=6, v_head_dim=10, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
    num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=64,
    bos_token_id=0, eos_token_id=7, pad_token_id=2, tie_word_embeddings=False, num_mtp_layers=0,
)  # fmt: skip
# One dense layer then one of experts (3 of 8 a token, from 2 of 4 groups, 2 shared experts), values narrower than
# the keys; the query latent, biases on the projections that have them, interleaved rotary pairs and renormalised
# weights in the first; in the second the query projected straight, YaRN (a factor 4 over 16 original positions, its
# attention factor and softmax scale) and rotary halves, the weights as scored.
VARIANTS = {
    "query latent": dict(attention_bias=True),
    "yarn": dict(
        q_lora_rank=None,
        rope_interleave=False,
        norm_topk_prob=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
    ),  # fmt: skip
}


def deepseek_config(**overrides):
    config = transformers.DeepseekV3Config(**{**SHAPES, **overrides})
    config._attn_implementation = "eager"
    return config


def random_deepseek(config):
    """A DeepseekV3ForCausalLM whose every parameter is random, and its correction biases (buffers) too, so that they
    change which experts are chosen."""
    torch_model = random_torch_model(transformers.DeepseekV3ForCausalLM, config)
    with torch.no_grad():
        for name, buffer in torch_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.3)
    return torch_model


def flax_model_and_params(config, checkpoint):
    deepseek.check_model_config(config)
    model = deepseek.MODEL_CLASS(config)
    abstract = abstract_model_params(model, np.zeros((1, 8), np.int32))
    shapes = {name: tensor.shape for name, tensor in checkpoint.items()}
    assert deepseek.hf_shapes(abstract) == deepseek.hf_architecture_shapes(config) == shapes
    return model, deepseek.from_hf_state_dict(checkpoint, abstract)


@pytest.mark.parametrize("variant", VARIANTS)
def test_deepseek_v3_computes_its_transformers_class_on_every_route(variant, tmp_path):
    config = deepseek_config(**VARIANTS[variant])
    torch_model = random_deepseek(config)
    torch_model.save_pretrained(tmp_path)
    checkpoint = load_file(str(tmp_path / "model.safetensors"))
    model, params = flax_model_and_params(config, checkpoint)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 16))
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(expected).max() > 1
    # Without a cache, prefilled into one, and one token at a time from an empty one (relative to the largest logit).
    difference = model_code.routes_difference(model, params, ids, lambda rows: expected, generates_text=True)
    assert difference * np.abs(expected).max() < 1e-4
    # The export: the same tensors, laid out as save_pretrained lays them out, which transformers loads as they are.
    exported = deepseek.to_hf_state_dict(params)
    assert exported.keys() == checkpoint.keys()
    assert all(np.array_equal(exported[name], checkpoint[name]) for name in checkpoint)


def test_a_sharded_bfloat16_checkpoint_decodes_left_padded_prompts_as_generate_does(tmp_path):
    config = deepseek_config(**VARIANTS["yarn"])
    random_deepseek(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len([name for name in tmp_path.iterdir() if name.name.startswith("model-000")]) > 1
    model, params = flax_model_and_params(config, read_safetensors_checkpoint(str(tmp_path), None))
    torch_model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(8, config.vocab_size, size=length).tolist() for length in (3, 9, 5)]
    decoded = generate_ids(make_sampler(model, config.eos_token_id), params, prompts, max_new_tokens=8)
    for prompt, new in zip(prompts, decoded):
        with torch.no_grad():
            expected = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=config.eos_token_id,
                pad_token_id=config.eos_token_id,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert new == expected


def test_the_presets_have_the_published_and_the_pytorch_parameter_counts():
    """deepseek-ai/DeepSeek-V3's model card and paper (arXiv 2412.19437): 671B parameters, 37B active per token,
    its multi-token prediction module apart; the tiny preset: what PyTorch's model of it holds."""
    model_type, values = presets()["deepseek-v3"]
    config = config_class(model_type)(**values)
    deepseek.check_model_config(config)
    assert deepseek.parameter_counts(config) == (671_026_404_352, 37_552_282_624)
    tiny = config_class(model_type)(**presets()["deepseek-v3-tiny"][1])
    torch_model = transformers.DeepseekV3ForCausalLM(tiny)
    assert family("deepseek_v3").count_parameters(tiny) == sum(p.numel() for p in torch_model.parameters())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads 2 must equal num_attention_heads 4"),
        (dict(output_router_logits=True), "output_router_logits: DeepSeek-V3 balances its experts"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters linear"),
        (dict(n_group=8, topk_group=2), "n_group 8 with topk_group 2 and 8 n_routed_experts"),
    ],
)
def test_what_the_module_does_not_compute_is_refused_in_one_line(overrides, message):
    config = deepseek_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(UsageError, match=message):
        stock_module("deepseek_v3").check_model_config(config)
