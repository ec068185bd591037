"""The models of flax_lm/models against transformers' PyTorch models, and what an export may claim of them.

Llama's logits equal LlamaForCausalLM's for every variant of its layout, and each family's (Qwen 2 and 3, Mistral,
Gemma 2 and 3, OLMo 2) its transformers class's, sliding windows and soft-capping included (document attention:
tests/unit/test_clm.py); greedy decoding with the key/value cache equals PyTorch's generate for each causal model; the
stock modules are the code these comparisons verified (their fingerprints); the probe that decides whether other code
may name an architecture tells an equal computation from an edited one. (A sharded bfloat16 Hugging Face checkpoint of
each family evaluated, trained on and exported: tests/end_to_end/test_published_checkpoints.py.)
"""

import importlib
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import FIXTURES_DIR, REPO_DIR, stock_code
from test_clm import tiny_config, tiny_llama_config
from test_mlm_model import tiny_config as tiny_roberta_config
from test_t5 import t5_config
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaForCausalLM,
    MistralConfig,
    Olmo2Config,
    OPTConfig,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from flax_lm.generation.sampling import generate_ids, make_sampler
from flax_lm.models import FAMILIES, import_model_file, model_code, stock_module
from flax_lm.models.huggingface import read_exported_params, save_model
from flax_lm.models.llama import model as llama
from flax_lm.training.train_state import abstract_model_params

CORPUS = FIXTURES_DIR / "en"

LLAMA_VARIANTS = {
    "multi-head untied": dict(num_key_value_heads=4),
    "grouped-query tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "grouped-query biases": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "llama3 rope": dict(
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
    ),  # fmt: skip
    "linear rope": dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
}


def llama_config(**overrides):
    return tiny_llama_config(
        **{
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 96,
            "tie_word_embeddings": False,
            **overrides,
        }
    )


# Tiny configs of the families that share Llama's interface, each with what sets it apart switched on, and windows
# shorter than the tests' sequences so that they matter.
FAMILY_SHAPES = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
LAYER_NORM_FAMILY_SHAPES = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
FAMILY_CONFIGS = {
    "qwen2": lambda **overrides: Qwen2Config(
        **{
            **FAMILY_SHAPES,
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 1,
            "tie_word_embeddings": True,
            **overrides,
        }
    ),  # fmt: skip
    "qwen3": lambda **overrides: Qwen3Config(**{**FAMILY_SHAPES, "head_dim": 24, **overrides}),
    "mistral": lambda **overrides: MistralConfig(**{**FAMILY_SHAPES, "sliding_window": 6, **overrides}),
    "gemma2": lambda **overrides: Gemma2Config(
        **{
            **FAMILY_SHAPES,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 5,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            **overrides,
        }
    ),  # fmt: skip
    "gemma3_text": lambda **overrides: Gemma3TextConfig(
        **{
            **FAMILY_SHAPES,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 5,
            "final_logit_softcapping": 3.0,  # Gemma3ForCausalLM caps the logits; its attention takes no cap
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            },
            **overrides,
        }
    ),  # fmt: skip
    "olmo2": lambda **overrides: Olmo2Config(**{**FAMILY_SHAPES, **overrides}),
    # Its second layer without rotary positions (NoPE), and a window there; biases on all four attention projections.
    "smollm3": lambda **overrides: SmolLM3Config(
        **{
            **FAMILY_SHAPES,
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 5,
            "attention_bias": True,
            **overrides,
        }
    ),  # fmt: skip
    # The families of LayerNorm and an MLP of one matrix in and one out: GPT-J's rotary dimensions a part of each head
    # (interleaved), with a tied output layer (its bias apart); Pythia's rotary_pct, parallel residual and base; OPT's
    # norms after the sublayers, with a narrower embedding projected in and out and no biases.
    "gptj": lambda **overrides: GPTJConfig(
        **{**LAYER_NORM_FAMILY_SHAPES, "n_inner": 96, "rotary_dim": 6, "tie_word_embeddings": True, **overrides}
    ),
    "gpt_neox": lambda **overrides: GPTNeoXConfig(
        **{
            **LAYER_NORM_FAMILY_SHAPES,
            "intermediate_size": 96,
            "rotary_pct": 0.5,
            "rotary_emb_base": 500.0,
            **overrides,
        }
    ),  # fmt: skip
    "opt": lambda **overrides: OPTConfig(
        **{
            **LAYER_NORM_FAMILY_SHAPES,
            "ffn_dim": 96,
            "do_layer_norm_before": False,
            "word_embed_proj_dim": 32,
            "enable_bias": False,
            "dropout": 0.0,
            **overrides,
        }
    ),  # fmt: skip
}
LAYER_NORM_FAMILIES = ("gptj", "gpt_neox", "opt")
# The other way of each that has two, for the logits tests.
FAMILY_VARIANTS = {
    "gpt_neox sequential residual": partial(FAMILY_CONFIGS["gpt_neox"], use_parallel_residual=False),
    "opt norms before": partial(FAMILY_CONFIGS["opt"], do_layer_norm_before=True, word_embed_proj_dim=64,
                                enable_bias=True, tie_word_embeddings=False),
    "opt without a final norm": partial(FAMILY_CONFIGS["opt"], do_layer_norm_before=True,
                                        _remove_final_layer_norm=True, layer_norm_elementwise_affine=False),
}  # fmt: skip


def hf_class_of(config):
    return getattr(transformers, stock_module(config.model_type).HF_ARCHITECTURES[config.model_type])


def random_torch_model(hf_class, config):
    """A PyTorch model of `config` whose every parameter is random: norms and biases too, so a wrong mapping shows."""
    torch.manual_seed(0)
    model = hf_class(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            is_norm_weight = tensor.dim() == 1 and not name.endswith("bias")
            tensor.copy_(torch.randn_like(tensor) * 0.2 + (1.0 if is_norm_weight else 0.0))
    return model


def flax_params_of(module, config, torch_model):
    model = module.MODEL_CLASS(config)
    abstract = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32))
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    return model, module.from_hf_state_dict(state_dict, abstract)


@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_llama_logits_equal_pytorch_llama(variant):
    config = llama_config(**LLAMA_VARIANTS[variant])
    torch_model = random_torch_model(LlamaForCausalLM, config)
    model, params = flax_params_of(llama, config, torch_model)
    input_ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 40))
    with torch.no_grad():
        expected = torch_model(torch.tensor(input_ids)).logits.numpy()
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(input_ids)))
    assert np.abs(expected).max() > 1  # logits far from zero: an error of the mapping would show
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", {**FAMILY_CONFIGS, **FAMILY_VARIANTS})
def test_each_family_computes_the_logits_of_its_transformers_class(variant):
    """Without a cache; and, for the families whose attention is new to the cache (partial rotary, OPT's), with the
    rows prefilled into a cache and decoded one token at a time."""
    config = {**FAMILY_CONFIGS, **FAMILY_VARIANTS}[variant]()
    config._attn_implementation = "eager"  # the reference: soft-capping and windows written out
    torch_model = random_torch_model(hf_class_of(config), config)
    model, params = flax_params_of(stock_module(config.model_type), config, torch_model)
    input_ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 24))
    with torch.no_grad():
        expected = torch_model(torch.tensor(input_ids)).logits.numpy()
    assert np.abs(expected).max() > 1
    if config.model_type in LAYER_NORM_FAMILIES:  # the three routes in one compiled program
        relative = model_code.routes_difference(model, params, input_ids, lambda rows: expected, generates_text=True)
        assert relative * np.abs(expected).max() < 1e-4
        return
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(input_ids)))
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


def test_the_sliding_window_is_computed_not_ignored():
    """Mistral's window of 6 over 24 tokens: the same weights with the window switched off compute other logits."""
    config = FAMILY_CONFIGS["mistral"]()
    model, params = flax_params_of(llama, config, random_torch_model(hf_class_of(config), config))
    unwindowed = llama.MODEL_CLASS(FAMILY_CONFIGS["mistral"](sliding_window=None))
    input_ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, size=(1, 24)))
    windowed, full = (np.asarray(m.apply({"params": params}, input_ids)) for m in (model, unwindowed))
    np.testing.assert_allclose(windowed[:, :6], full[:, :6], atol=1e-5)
    assert np.abs(windowed[:, 6:] - full[:, 6:]).max() > 1e-2


# Every dropout rate of each LayerNorm family's config.
LAYER_NORM_DROPOUTS = {
    "gptj": dict(embd_pdrop=0.5, attn_pdrop=0.5, resid_pdrop=0.5),
    "gpt_neox": dict(hidden_dropout=0.5, attention_dropout=0.5),
    "opt": dict(dropout=0.5, attention_dropout=0.5),
}


@pytest.mark.parametrize("model_type", LAYER_NORM_FAMILIES)
def test_a_layer_norm_family_trains_with_the_dropout_its_config_sets(model_type):
    """In training (deterministic=False) the logits differ from those of evaluation: the embedding's dropout
    included, which a stack built in setup holds as a module of its own."""
    config = FAMILY_CONFIGS[model_type](**LAYER_NORM_DROPOUTS[model_type])
    model = stock_module(model_type).MODEL_CLASS(config)
    input_ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 8)))
    params = nn.unbox(model.init(jax.random.PRNGKey(0), input_ids)["params"])
    evaluated = model.apply({"params": params}, input_ids)
    trained = model.apply({"params": params}, input_ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert np.abs(np.asarray(trained) - np.asarray(evaluated)).max() > 1e-3


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention is not implemented"),
        ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)), "rope_type 'yarn'"),
        ("olmo2", dict(attention_dropout=0.1), "attention_dropout 0.1 is not implemented"),
        ("gemma2", dict(layer_types=["chunked_attention"] * 3), "layer_types 'chunked_attention'"),
        ("olmo2", dict(sliding_window=4), "sliding_window is not part of olmo2"),
        ("qwen3", dict(final_logit_softcapping=30.0), "final_logit_softcapping is not part of qwen3"),
        ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping is not part of gemma3_text"),
        ("opt", dict(layerdrop=0.1), "layerdrop 0.1 is not implemented"),
        ("gpt_neox", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "rope_type 'dyn"),
        (
            "gpt_neox",
            dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.2)),
            "turns 3 of the 16 dimensions",
        ),  # fmt: skip
        ("gptj", dict(rotary_dim=7), "rotary_dim 7 is not an even number"),
    ],
)
def test_a_family_feature_the_module_does_not_compute_is_refused(model_type, overrides, message):
    config = FAMILY_CONFIGS[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(model_code.UsageError, match=message):
        stock_module(model_type).check_model_config(config)


def test_llama_export_loads_in_transformers_with_the_same_logits(llama_tokenizer_dir, tmp_path):
    config = llama_config(vocab_size=1000, num_key_value_heads=2)
    model = llama.FlaxLlamaForCausalLM(config)
    params = jax.tree_util.tree_map(
        np.asarray, nn.meta.unbox(model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"])
    )
    save_model(str(tmp_path), params, config, AutoTokenizer.from_pretrained(llama_tokenizer_dir), stock_code(config))
    torch_model, loading_info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert type(torch_model).__name__ == "LlamaForCausalLM"
    assert not any(loading_info.values()), loading_info
    input_ids = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 24))
    with torch.no_grad():
        expected = torch_model.eval()(torch.tensor(input_ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply({"params": params}, input_ids)), expected, atol=1e-4, rtol=0)


def test_an_export_whose_bytes_changed_since_is_refused_by_its_loader_in_one_line(llama_tokenizer_dir, tmp_path):
    config = llama_config(vocab_size=1000, num_key_value_heads=2)
    abstract = abstract_model_params(llama.FlaxLlamaForCausalLM(config), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda leaf: rng.standard_normal(leaf.shape).astype(np.float32), abstract)
    code = stock_code(config)
    save_model(str(tmp_path), params, config, AutoTokenizer.from_pretrained(llama_tokenizer_dir), code)
    read_back = read_exported_params(str(tmp_path), None, code, abstract)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, read_back, params))
    weights = tmp_path / "model.safetensors"
    changed = bytearray(weights.read_bytes())
    changed[-3] ^= 0x10  # a bit of a weight: the file still parses, and one value differs
    weights.write_bytes(changed)
    with pytest.raises(model_code.UsageError, match="does not hold the tensors it was saved with") as refusal:
        read_exported_params(str(tmp_path), None, code, abstract)
    assert str(weights) in str(refusal.value) and "\n" not in str(refusal.value)


CAUSAL_MODELS = {
    "gpt2": lambda: tiny_config(n_embd=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=7),
    "llama": lambda: llama_config(num_key_value_heads=2, eos_token_id=7),
    # Qwen 3 is the Llama module with normalized heads, which its logits test covers; the sharded-checkpoint test
    # below compares its greedy decoding with transformers' too.
    **{
        model_type: partial(make_config, eos_token_id=7)
        for model_type, make_config in FAMILY_CONFIGS.items()
        if model_type != "qwen3"
    },
}


@pytest.mark.parametrize("model_type", CAUSAL_MODELS)
def test_greedy_decoding_equals_pytorch_generate(model_type):
    """Prompts of several lengths, decoded together (left-padded, with the key/value cache) until the end-of-text
    token or 12 new tokens: each row's tokens are those PyTorch's generate gives the prompt alone."""
    module = stock_module(model_type)
    config = CAUSAL_MODELS[model_type]()
    torch_model = random_torch_model(hf_class_of(config), config)
    model, params = flax_params_of(module, config, torch_model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(8, config.vocab_size, size=length).tolist() for length in (3, 9, 5)]
    decoded = generate_ids(make_sampler(model, config.eos_token_id), params, prompts, max_new_tokens=12)
    for prompt, new in zip(prompts, decoded):
        with torch.no_grad():
            expected = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=config.eos_token_id,
                pad_token_id=config.eos_token_id,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert new == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_the_verified_fingerprints_are_those_of_the_stock_modules(name):
    """An export of a stock module names its transformers architecture without a probe because the parity tests
    compare that code: a change to the module (or to shared/common.py) must be compared again, then its fingerprint
    set."""
    fingerprint = model_code.module_code_fingerprint(importlib.import_module(f"flax_lm.models.{name}.model"))
    assert model_code.VERIFIED_FINGERPRINTS[name] == fingerprint, (
        f"flax_lm/models/{name}/model.py or shared/common.py changed: once its parity tests pass, set "
        f'VERIFIED_FINGERPRINTS["{name}"] = "{fingerprint}" in flax_lm/models/model_code.py'
    )


PROBE_CONFIGS = {
    "gpt2": lambda: tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": lambda: llama_config(num_key_value_heads=2),
    "roberta": lambda: tiny_roberta_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "gemma2": FAMILY_CONFIGS["gemma2"],
    "olmo2": FAMILY_CONFIGS["olmo2"],
    # Whose checkpoint's embed_out is the class's lm_head (LOADED_NAMES); a short context, for a short probe.
    "gpt_neox": partial(FAMILY_CONFIGS["gpt_neox"], max_position_embeddings=32),
    # Whose experts, a tensor each in the checkpoint, transformers 5 fuses as it loads one (and the probe with it).
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),  # fmt: skip
}


@pytest.fixture
def probe_row_by_row(monkeypatch):
    """The probe compares one row at a time, so that its loop over the groups of rows runs more than once."""
    monkeypatch.setattr(model_code, "PROBE_LOGITS_BYTES", 1)


@pytest.mark.parametrize(
    "vocab_size, length, group_bytes, rows", [(1000, 64, 2**27, 16), (1000, 64, 4 * 64 * 1000 * 5, 20)]
)
def test_the_probe_s_rows_are_as_few_as_hold_every_token_id(vocab_size, length, group_bytes, rows, monkeypatch):
    """Every token id in as few rows of the context's length as hold them; more only to fill the last of several
    groups (of PROBE_LOGITS_BYTES of logits, here 5 rows), never a group's worth where one group holds them all."""
    monkeypatch.setattr(model_code, "PROBE_LOGITS_BYTES", group_bytes)
    ids = model_code.probe_ids(vocab_size, length)
    assert ids.shape == (rows, length)
    assert set(ids.reshape(-1).tolist()) == set(range(vocab_size))


@pytest.mark.parametrize("model_type", PROBE_CONFIGS)
def test_the_probe_finds_each_stock_module_equal_to_its_architecture(model_type, probe_row_by_row):
    module = stock_module(model_type)
    config = PROBE_CONFIGS[model_type]()
    difference = model_code.probe_difference(module, config, hf_class_of(config))
    assert difference <= model_code.PROBE_TOLERANCE


def edited_module(tmp_path, name: str, replacements: dict, model_type: str = "llama"):
    text = (REPO_DIR / "flax_lm" / "models" / model_type / "model.py").read_text()
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (tmp_path / name).write_text(text)
    return import_model_file(str(tmp_path / name))


def test_a_model_file_s_claim_is_probed_at_the_first_export_and_not_at_all_with_skip_export_check(
    tmp_path, monkeypatch
):
    """Loading the code runs no probe (a run refused later pays nothing for it); asking the claim, as the first export
    does, runs it; --skip_export_check runs none, and the exports claim nothing."""
    config, probed = llama_config(num_key_value_heads=2), []
    monkeypatch.setattr(model_code, "probe_difference", lambda *arguments: probed.append(arguments) or 0.0)
    edited_module(tmp_path, "same.py", {"The Llama family in Flax": "The Llama family in Flax (a copy)"})
    code = model_code.load_model_code(config, str(tmp_path / "same.py"), True, "run_clm_flax.py")
    assert not probed and code.claim is None
    assert code.claims_architecture and len(probed) == 1
    unchecked = model_code.load_model_code(config, str(tmp_path / "same.py"), True, "x", compare_exports=False)
    assert not unchecked.claims_architecture and "--skip_export_check" in unchecked.reason and len(probed) == 1


def test_the_probe_tells_an_edited_computation_from_a_refactoring(tmp_path, probe_row_by_row):
    config = llama_config(num_key_value_heads=2)
    # The same computation written another way, and attention scaled otherwise.
    same = edited_module(tmp_path, "same.py", {"scale = 1 / math.sqrt(head_dim)": "scale = head_dim**-0.5"})
    other = edited_module(
        tmp_path, "other.py", {"scale = 1 / math.sqrt(head_dim)": "scale = 0.5 / math.sqrt(head_dim)"}
    )
    claims_same, reason_same = model_code.architecture_claim(
        same, config, model_code.module_code_fingerprint(same), "same.py"
    )
    claims_other, reason_other = model_code.architecture_claim(other, config, "x", "other.py")
    assert claims_same, reason_same
    assert not claims_other and "logits differ" in reason_other, reason_other


def test_an_edited_t5_claims_its_architecture_only_where_its_encoder_and_cached_decoder_compute_as_before(tmp_path):
    """An edited copy of the encoder-decoder is probed as the causal families are (its exports were refused at the
    first save before): a refactoring keeps the claim; an edit of the cached decoding alone, which the teacher-forced
    logits do not show, loses it."""
    config = t5_config()
    refactored = {"visible = (positions[:, None] >= jnp.arange(slots)[None, :])[None]": (
        "visible = (jnp.arange(slots)[None, :] <= positions[:, None])[None]"
    )}  # fmt: skip
    cached_otherwise = {"return self.logits(hidden), cache.replace(": "return 2 * self.logits(hidden), cache.replace("}
    for name, edit, claimed in [("same.py", refactored, True), ("other.py", cached_otherwise, False)]:
        module = edited_module(tmp_path, name, edit, "t5")
        claims, reason = model_code.architecture_claim(
            module, config, model_code.module_code_fingerprint(module), name
        )
        assert claims == claimed, reason
        assert ("with and without the key/value cache" in reason) if claimed else ("logits differ" in reason)


# Edits of gpt2.py that change what it computes only somewhere a small probe does not look: positions 40 and beyond,
# the last of 3 layers, the token ids 1 and 2, decoding with the key/value cache.
NARROW_EDITS = {
    "refactored": {
        'self.look_up(self.wpe, "positions", positions)': 'self.look_up(self.wpe, "positions", +positions)'
    },
    "late positions": {
        'self.look_up(self.wpe, "positions", positions)': (
            'self.look_up(self.wpe, "positions", positions) * jnp.where(positions >= 40, 3.0, 1.0)[..., None]'
        )
    },
    "one layer": {
        'x = x + self.child(MLP, "mlp")(self.layer_norm("ln_2")(x), deterministic)': (
            'x = x + self.child(MLP, "mlp")(self.layer_norm("ln_2")(x), deterministic) * (1 + (self.layer_index == 2))'
        )
    },
    "rare token ids": {
        'self.look_up(self.wte, "vocab", input_ids)': (
            'self.look_up(self.wte, "vocab", jnp.where(input_ids < 3, 0, input_ids))'
        )
    },
    "cached decoding": {
        "query, key, value, scale, cache, self.layer_index, self.mesh, window, softcap\n            )": (
            "query, key, value, scale, cache, self.layer_index, self.mesh, window, softcap\n            )\n"
            "            y = 1.5 * y"
        )
    },
}


@pytest.mark.parametrize("edit", NARROW_EDITS)
def test_an_edit_anywhere_in_the_context_the_layers_the_vocabulary_or_the_cache_loses_the_claim(
    tmp_path, edit, probe_row_by_row
):
    """The probe compares every layer, every position of the context, every token id and the cached routes: an
    export names GPT2LMHeadModel only for the copy whose edit computes as before."""
    config = tiny_config(vocab_size=256, n_layer=3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    module = edited_module(tmp_path, "narrow.py", NARROW_EDITS[edit], "gpt2")
    claims, reason = model_code.architecture_claim(
        module, config, model_code.module_code_fingerprint(module), "narrow.py"
    )
    if edit == "refactored":
        assert claims, reason
        assert "every layer, position and token id, with and without the key/value cache" in reason
    else:
        assert not claims and "logits differ" in reason, reason


def test_a_probe_too_costly_for_pytorch_makes_no_claim(tmp_path, monkeypatch):
    """Past the limit of the probe's work, an export names no architecture rather than one checked in part."""
    config = tiny_config(vocab_size=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    module = edited_module(tmp_path, "same.py", {"GPT-2 in Flax": "GPT-2 in Flax (a copy)"}, "gpt2")
    monkeypatch.setattr(model_code, "PROBE_MAX_TORCH_FLOPS", 1e6)
    claims, reason = model_code.architecture_claim(
        module, config, model_code.module_code_fingerprint(module), "same.py"
    )
    assert not claims and "over the probe's limit" in reason, reason


def test_an_unedited_copy_of_a_stock_module_claims_its_architecture_without_a_probe(tmp_path, monkeypatch):
    """A --model_file whose bytes are a stock module's is the verified code: no probe, whatever --skip_export_check."""
    config, probed = llama_config(num_key_value_heads=2), []
    monkeypatch.setattr(model_code, "probe_difference", lambda *arguments: probed.append(arguments) or 0.0)
    edited_module(tmp_path, "copy.py", {})
    for compare_exports in (True, False):
        code = model_code.load_model_code(
            config, str(tmp_path / "copy.py"), True, "x", compare_exports=compare_exports
        )
        assert code.claims_architecture and "an unedited copy" in code.reason, code.reason
    assert not probed
