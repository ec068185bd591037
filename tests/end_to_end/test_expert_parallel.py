"""Expert parallelism (the expert axis of --mesh_shape): the experts of a mixture of experts split over devices, the
tokens exchanged by all-to-all, compute what one device does, a checkpoint saved on an expert mesh resumes on a mesh
without one, and generation on an expert mesh decodes one device's tokens. checks/expert_parallel_check.py does the
work in a process of its own with 8 forced CPU devices."""

import numpy as np
import pytest
from test_tensor_parallel import check_results


@pytest.fixture(scope="module")
def results():
    return check_results("expert_parallel_check.py")


@pytest.mark.parametrize("mesh_shape, devices", [("expert=4", 4), ("fsdp=2,expert=2,tensor=2", 8)])
def test_experts_split_over_devices_exchange_tokens_by_all_to_all_and_compute_as_one_device(
    results, mesh_shape, devices
):
    mesh = results[mesh_shape]
    assert mesh["devices"] == devices and mesh["all_to_all"]
    assert mesh["loss_difference"] < 1e-5 and mesh["largest_gradient_difference"] < 1e-5


def test_a_checkpoint_saved_on_an_expert_mesh_resumes_on_a_data_mesh_with_the_same_losses(results):
    """Saved at step 2 of data=2,expert=4, resumed on data=4: step 3, computed without the exchange, has the loss
    and ends with the weights of the uninterrupted run's."""
    resumed = results["resumed"]
    saved_on, resumed_on = resumed["data=2,expert=4"], resumed["data=4"]
    assert saved_on["all_to_all"] and not resumed_on["all_to_all"]
    np.testing.assert_allclose(resumed_on["losses"], saved_on["losses"][2:], rtol=1e-5)
    assert resumed["largest_weight_difference"] < 1e-5


def test_generation_with_the_experts_split_over_an_expert_axis_decodes_the_tokens_of_one_device(results):
    """generate_flax.py's sampler on expert=2,tensor=2, the rows whole on every device: the prefill exchanges the
    tokens by all-to-all, and greedy decoding gives one device's tokens."""
    assert results["generation"] == {"all_to_all": True, "same_tokens": True}
