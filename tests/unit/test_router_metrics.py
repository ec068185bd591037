"""What the train step shows of a mixture of experts' routers (moe.router_metric_sums): each layer's expert load
counts the experts the router chose, which for DeepSeek-V3 are not the top-k of its logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from flax_lm.models.deepseek_v3 import model as deepseek
from flax_lm.models.shared.moe import router_metric_sums

# 8 experts in 4 groups of 2, a token taking 3 from the 2 best groups.
DEEPSEEK = transformers.DeepseekV3Config(
    hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2
)


def test_deepseek_s_expert_load_counts_the_experts_its_biased_group_limited_routing_chose():
    """A correction bias that outweighs every score sends each token to experts 0, 1 and 2 (groups 0 and 1), whatever
    its logits: a third of the pairs each, none to the others; the top-3 of the logits spread wider."""
    router = deepseek.Router(DEEPSEEK)
    rows = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32)
    params = router.init(jax.random.key(0), rows)["params"]
    params["e_score_correction_bias"] = jnp.zeros(8).at[:3].set(10.0)
    _, state = router.apply({"params": params}, rows, mutable=["intermediates"])
    # Where the router of the second decoder layer sows them.
    intermediates = {"model": {"layers_1": {"mlp": {"gate": state["intermediates"]}}}}
    sums = router_metric_sums(intermediates, top_k=3, token_count=16.0)
    assert sums["moe/layer_1/expert_load_max"] / 16 == pytest.approx(1 / 3)
    assert sums["moe/layer_1/expert_load_min"] == 0
    top_3_of_logits = jax.lax.top_k(state["intermediates"]["router_logits"][0], 3)[1]
    assert not np.isin(np.asarray(top_3_of_logits), [0, 1, 2]).all()
