"""What a tensor axis of --mesh_shape cannot split is refused by the model module's check_model_config, in one line
naming the size it does not divide (the runs on meshes: tests/end_to_end/test_tensor_parallel.py)."""

import pytest
from test_clm import tiny_config, tiny_llama_config

from flax_lm.errors import UsageError
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.llama import model as llama
from flax_lm.models.roberta import model as roberta


class TensorAxis:
    """What check_model_config reads of a mesh: the size of each axis."""

    def __init__(self, size: int):
        self.shape = {"data": 1, "fsdp": 1, "tensor": size}


@pytest.mark.parametrize(
    "config, message",
    [
        (tiny_config(n_head=2), "tensor=4 does not divide the attention heads (n_head) 2"),
        (tiny_config(n_head=4, n_inner=66), "tensor=4 does not divide the MLP width (n_inner) 66"),
        (
            tiny_config(n_head=4, vocab_size=1002),
            "tensor=4 does not divide the vocabulary (vocab_size) 1002: choose a tensor size that divides it, or pad "
            "it with create_config.py --pad_vocab_to_multiple_of",
        ),
    ],
)
def test_a_tensor_size_that_does_not_divide_the_split_sizes_is_refused(config, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpt2.check_model_config(config, TensorAxis(4))
    gpt2.check_model_config(config, TensorAxis(1))


def test_a_llama_tensor_size_that_does_not_divide_its_key_value_heads_is_refused():
    config = tiny_llama_config(num_attention_heads=8, num_key_value_heads=2, hidden_size=64, vocab_size=1024)
    message = r"tensor=4 does not divide the key/value heads \(num_key_value_heads\) 2"
    with pytest.raises(UsageError, match=message):
        llama.check_model_config(config, TensorAxis(4))
    llama.check_model_config(config, TensorAxis(2))


def test_a_roberta_tensor_size_that_does_not_divide_its_heads_is_refused():
    from test_mlm_model import tiny_config as roberta_config

    with pytest.raises(UsageError, match=r"tensor=8 does not divide the attention heads \(num_attention_heads\) 4"):
        roberta.check_model_config(roberta_config(), TensorAxis(8))
