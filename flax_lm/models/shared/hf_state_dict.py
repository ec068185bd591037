"""A model's Flax parameters as a transformers checkpoint's tensors and back, by a family's naming function `hf_name`
(a Flax parameter path -> the checkpoint's tensor name): every dense kernel, stored (in, out) here, is an nn.Linear
weight (out, in) there, and every other parameter is as it is. The families of Llama's layout use common.py's
functions of the same work, which stay as flax_lm 0.4 shipped them (flax_lm/models/README.md says why); GPT-J,
GPT-NeoX, OPT and T5, whose checkpoints name their tensors otherwise, use these."""

import logging
from collections.abc import Callable

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)


def state_dict_of(params, hf_name: Callable[[tuple], str]) -> dict[str, np.ndarray]:
    """The PyTorch state dict of `params` (float32 numpy, the checkpoint's names and layouts)."""
    return {
        hf_name(path): np.ascontiguousarray(np.asarray(value, np.float32).T if path[-1] == "kernel" else value)
        for path, value in flatten_dict(params).items()
    }


def shapes_of(params, hf_name: Callable[[tuple], str]) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors state_dict_of makes of `params`, from their shapes alone (arrays or
    jax.ShapeDtypeStruct): nothing is read or allocated. It follows state_dict_of; change both together."""
    return {
        hf_name(path): tuple(value.shape[::-1] if path[-1] == "kernel" else value.shape)
        for path, value in flatten_dict(params).items()
    }


def params_of(
    state_dict: dict, abstract_params, hf_name: Callable[[tuple], str], stand_ins: dict | None = None
) -> tuple[dict, list[str]]:
    """(the inverse of state_dict_of, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes and
    placed as they are laid out (their sharding; without one, on the default device), the names of the checkpoint's
    tensors it did not read). The tensors may be of any float dtype (bfloat16, as most checkpoints are published);
    each is read (from a memory-mapped file, see flax_lm.models.huggingface.load_safetensors), converted and placed on
    its own, so that the host never holds a converted copy of all the weights beside the placed one. `stand_ins`:
    {name: the tensor read in its place where the checkpoint has none}, such as a head tied to the embedding."""
    params, used = {}, set()
    for path, expected in flatten_dict(abstract_params).items():
        name = hf_name(path)
        if name not in state_dict and stand_ins and name in stand_ins:
            name = stand_ins[name]
        if name not in state_dict:
            raise UsageError(f"the checkpoint has no tensor {name}; it does not match the model config")
        value = state_dict[name].T if path[-1] == "kernel" else state_dict[name]
        if value.shape != expected.shape:
            raise UsageError(
                f"checkpoint tensor {name} has shape {value.shape} but the config needs {expected.shape}; "
                "pass the config the checkpoint was trained with"
            )
        params[path] = jax.device_put(np.asarray(value, dtype=expected.dtype), getattr(expected, "sharding", None))
        used.add(name)
    return unflatten_dict(params), [name for name in state_dict if name not in used]


def warn_of_unused(names: list[str]):
    """Say which of the checkpoint's tensors the model leaves unread (those its layout does not explain)."""
    if names:
        logger.warning("Ignoring %d checkpoint tensors the model does not use: %s", len(names), ", ".join(names[:5]))
