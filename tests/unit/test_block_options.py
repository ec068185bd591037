"""GPT-2's block options (flax_lm/models/gpt2/model.py BLOCK_OPTIONS): QK-norm, attention and final-logit soft-capping
and sliding-window layers, each computing what it is defined to, each decoded with the key/value cache as the whole
sequence is, written by create_config.py --set, and exported without claiming GPT2LMHeadModel; off, the model is
GPT-2's bit for bit. Document attention with windows: tests/unit/test_clm.py; resume:
tests/end_to_end/test_resume.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from test_clm import tiny_config
from transformers import GPT2Config

import create_config
from flax_lm.errors import UsageError
from flax_lm.generation.sampling import generate_ids, make_sampler
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.model_code import load_model_code

# Each option with values that matter at tiny sizes: caps small enough that the logits reach them, a window shorter
# than the tests' sequences, on the first of the two layers.
OPTIONS = {
    "qk_norm": dict(qk_norm=True),
    "attention soft-capping": dict(attn_logit_softcapping=0.5),
    "final-logit soft-capping": dict(final_logit_softcapping=0.3),
    "sliding window": dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    "all of them": dict(
        qk_norm=True,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=0.3,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
}
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, vocab_size=128, n_positions=32)


def model_and_params(initializer_range=0.02, **options):
    config = tiny_config(**NO_DROPOUT, initializer_range=initializer_range, **options)
    gpt2.check_model_config(config)
    model = gpt2.FlaxGPT2LMHeadModel(config)
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    # Norm weights away from their initial ones, so that a weight left out of the computation shows.
    params = jax.tree_util.tree_map_with_path(
        lambda path, value: value * 1.5 if "norm" in jax.tree_util.keystr(path) else value, params
    )
    return config, model, params


def hand_attention(config, params, x, window, softcap):
    """GPT-2's attention of one layer written out in numpy: its fused projection split into heads, each query and key
    head RMS-normalized with its weight where qk_norm is set, the scaled products capped at +-softcap, each token
    seeing itself and the earlier tokens less than `window` back."""
    heads, width = config.n_head, config.n_embd
    head_dim = width // heads
    qkv = x @ np.asarray(params["c_attn"]["kernel"]) + np.asarray(params["c_attn"]["bias"])
    query, key, value = (part.reshape(len(x), heads, head_dim) for part in np.split(qkv, 3, axis=-1))
    if getattr(config, "qk_norm", False):

        def rms_norm(heads_of, weight):
            return heads_of / np.sqrt((heads_of**2).mean(-1, keepdims=True) + config.layer_norm_epsilon) * weight

        query = rms_norm(query, np.asarray(params["q_norm"]["weight"]))
        key = rms_norm(key, np.asarray(params["k_norm"]["weight"]))
    logits = np.einsum("qhd,khd->hqk", query, key) / np.sqrt(head_dim)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    distance = np.arange(len(x))[:, None] - np.arange(len(x))[None, :]
    visible = (distance >= 0) & (distance < (window or len(x) + 1))
    logits = np.where(visible, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    output = np.einsum("hqk,khd->qhd", weights, value).reshape(len(x), width)
    return output @ np.asarray(params["c_proj"]["kernel"]) + np.asarray(params["c_proj"]["bias"])


@pytest.mark.parametrize("name", ["none", *OPTIONS])
def test_each_layer_s_attention_equals_the_hand_computation_of_its_options(name):
    config, _, params = model_and_params(**OPTIONS.get(name, {}))
    x = np.random.default_rng(0).normal(size=(1, 10, config.n_embd)).astype(np.float32)
    for layer_index, window in enumerate(gpt2.layer_windows(config)):
        attention = gpt2.CausalSelfAttention(config, layer_index=layer_index)
        layer_params = params["transformer"][f"h_{layer_index}"]["attn"]
        output, _ = attention.apply({"params": layer_params}, jnp.asarray(x), True)
        softcap = getattr(config, "attn_logit_softcapping", None)
        expected = hand_attention(config, layer_params, x[0], window, softcap)
        np.testing.assert_allclose(np.asarray(output[0]), expected, atol=2e-5, rtol=1e-4)


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    """Multiplying the query and key projections by 10 changes GPT-2's logits, not those of its QK-norm'd variant."""
    for options, changes in ((dict(qk_norm=True), False), ({}, True)):
        config, model, params = model_and_params(initializer_range=0.2, **options)
        scaled = jax.tree.map(lambda value: value, params)
        for layer in ("h_0", "h_1"):
            c_attn = scaled["transformer"][layer]["attn"]["c_attn"]
            scale = jnp.concatenate([jnp.full(2 * config.n_embd, 10.0), jnp.ones(config.n_embd)])
            c_attn["kernel"], c_attn["bias"] = c_attn["kernel"] * scale, c_attn["bias"] * scale
        ids = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 12)))
        difference = jnp.abs(model.apply({"params": params}, ids) - model.apply({"params": scaled}, ids)).max()
        assert (difference > 1e-2) if changes else (difference < 1e-4)


def test_the_final_logits_are_capped_smoothly():
    _, model, params = model_and_params(initializer_range=0.5)
    config, capped_model, _ = model_and_params(initializer_range=0.5, final_logit_softcapping=0.3)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 12)))
    uncapped, capped = model.apply({"params": params}, ids), capped_model.apply({"params": params}, ids)
    assert float(jnp.abs(uncapped).max()) > 0.3
    assert float(jnp.abs(capped).max()) <= np.float32(0.3)
    np.testing.assert_allclose(capped, 0.3 * np.tanh(np.asarray(uncapped) / 0.3), atol=1e-6)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_a_window_hides_the_tokens_further_back_than_it(layer_type):
    """One layer of window 4: the last token's logits change with the token 3 back, not with the one 4 back, unless
    the layer is a full-attention one."""
    config = tiny_config(**NO_DROPOUT, n_layer=1, sliding_window=4, layer_types=[layer_type])
    model = gpt2.FlaxGPT2LMHeadModel(config)
    ids = np.random.default_rng(3).integers(0, 128, (1, 10))
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.asarray(ids))["params"])

    def last_logits_with(position):
        changed = ids.copy()
        changed[0, position] = (changed[0, position] + 1) % 128
        return model.apply({"params": params}, jnp.asarray(changed))[0, -1]

    last = model.apply({"params": params}, jnp.asarray(ids))[0, -1]
    assert float(jnp.abs(last_logits_with(9 - 3) - last).max()) > 1e-4
    beyond = float(jnp.abs(last_logits_with(9 - 4) - last).max())
    assert (beyond == 0.0) if layer_type == "sliding_attention" else (beyond > 1e-4)


# The window alone (what the cache must forget) and every option at once: decoding each option alone adds no path.
@pytest.mark.parametrize("name", ["sliding window", "all of them"])
def test_greedy_decoding_with_the_cache_equals_the_argmax_of_the_whole_sequence(name):
    """Prompts of several lengths decoded together (left-padded, with the cache), past the window: each row's tokens
    are those of taking the argmax of the whole sequence's logits again for every new token."""
    config, model, params = model_and_params(initializer_range=0.5, **OPTIONS[name])
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 128, size=length).tolist() for length in (2, 7, 4)]
    decoded = generate_ids(make_sampler(model, 0), params, prompts, max_new_tokens=8)
    # The sequence padded on the right to one length (which changes no earlier position): one compiled program.
    whole_sequence_logits = jax.jit(lambda ids: model.apply({"params": params}, ids))
    for prompt, new in zip(prompts, decoded):
        sequence = list(prompt)
        for _ in range(8):
            padded = jnp.asarray([sequence + [1] * (16 - len(sequence))])
            sequence.append(int(jnp.argmax(whole_sequence_logits(padded)[0, len(sequence) - 1])))
            if sequence[-1] == 0:
                break
        assert new == sequence[len(prompt) :]


def test_options_set_off_compute_gpt2_bit_for_bit():
    """Every option written out as off: the same parameters and the very same logits as a config without the fields,
    with and without the cache."""
    off = dict(qk_norm=False, attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=None)
    _, plain, params = model_and_params()
    _, explicit, explicit_params = model_and_params(**off)
    assert flatten_dict(params).keys() == flatten_dict(explicit_params).keys()
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 128, (2, 12)))
    assert jnp.array_equal(plain.apply({"params": params}, ids), explicit.apply({"params": params}, ids))
    cache = plain.empty_cache(jnp.ones(ids.shape, bool), 0)
    with_cache = [model.apply({"params": params}, ids, cache=cache)[0] for model in (plain, explicit)]
    assert jnp.array_equal(*with_cache)


@pytest.mark.parametrize("field", gpt2.BLOCK_OPTIONS)
def test_an_export_of_an_option_does_not_claim_gpt2_and_names_the_family_that_has_it(field):
    options = OPTIONS["all of them"] if field == "layer_types" else OPTIONS[
        {"qk_norm": "qk_norm", "attn_logit_softcapping": "attention soft-capping", "sliding_window": "sliding window",
         "final_logit_softcapping": "final-logit soft-capping"}[field]
    ]  # fmt: skip
    config = tiny_config(**NO_DROPOUT, **options)
    code = load_model_code(config, None, True, "run_clm_flax.py")
    assert not code.claims_architecture
    family = gpt2.BLOCK_OPTIONS[field if field != "layer_types" else "qk_norm"][1]
    assert "GPT2LMHeadModel" in code.reason and family in code.reason
    assert len(code.reason.splitlines()) == 1


def test_create_config_sets_each_option_and_refuses_a_wrong_one_in_one_line(monkeypatch, tmp_path):
    options = [
        "qk_norm=true", "attn_logit_softcapping=50.0", "final_logit_softcapping=30.0", "sliding_window=64",
        'layer_types=["sliding_attention", "full_attention"]',
    ]  # fmt: skip
    monkeypatch.setattr(
        "sys.argv", ["create_config.py", "--preset", "gpt2-tiny", "--output_dir", str(tmp_path), "--set", *options]
    )
    create_config.main()
    config = GPT2Config.from_pretrained(tmp_path)
    assert (config.qk_norm, config.attn_logit_softcapping, config.final_logit_softcapping) == (True, 50.0, 30.0)
    assert gpt2.layer_windows(config) == [64, None]
    for wrong, message in (
        # transformers' GPT2Config counts the layer types itself.
        ('layer_types=["sliding_attention"]', "number of `layer_types`"),
        ('layer_types=["sliding_attention", "full_attention"]', "layer_types is set but sliding_window is not"),
        ("sliding_window=0", "sliding_window must be a positive number"),
        ("final_logit_softcapping=-1", "final_logit_softcapping must be a positive number"),
    ):
        monkeypatch.setattr(
            "sys.argv",
            ["create_config.py", "--preset", "gpt2-tiny", "--output_dir", str(tmp_path / "wrong"), "--set", wrong],
        )
        with pytest.raises(UsageError, match=message) as refusal:
            create_config.main()
        assert len(str(refusal.value).splitlines()) == 1
        assert not (tmp_path / "wrong" / "config.json").exists()
