"""Which code computes a run's model, and what its exports may claim.

A run's model is computed by a module of flax_lm/models (the one its config's model_type names) or by a model file of
the experiment's own (--model_file, an edited copy of such a module). A fingerprint of that code goes into every
training checkpoint, so a run is never resumed with other model code without a word; and an export names a
transformers architecture in its config.json only where the code is known to compute it:
- the stock modules, as flax_lm ships them (VERIFIED_FINGERPRINTS: the code their parity tests compare with
  transformers);
- other code whose logits, on a probe batch with random weights, equal those of the transformers class it names
  (PyTorch installed; the probe runs the config cut to PROBE_LAYERS layers).
Any other export holds its weights as flax_model.safetensors beside a copy of its model file, which transformers does
not load (it looks for model.safetensors), and which the tools of this repository load with --model_file.
"""

import copy
import hashlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import flax.linen as nn
import jax
import numpy as np

from flax_lm.errors import UsageError
from flax_lm.models import model_module

logger = logging.getLogger(__name__)

# module name -> module_code_fingerprint of the stock module, as tests/test_models.py compares it with transformers. A
# change to a module (or to flax_lm/models/common.py) fails that test until its fingerprint here is updated, which its
# parity tests passing makes right.
VERIFIED_FINGERPRINTS = {
    "gemma": "ccb4a731dc070557",
    "gpt2": "37d74b0550392686",
    "llama": "503e53ad0738fa05",
    "olmo2": "b0877faf3731d06d",
    "roberta": "fdebdf944a44cb5c",
}
# Fingerprints of earlier stock modules, each verified against the same transformers class by the parity tests of its
# version: a checkpoint they trained resumes with today's verified stock code. (0.4 moved flax_lm's modules into
# subpackages, which changed the models' import lines, and added model families, which left what the earlier configs
# compute as it was: the parity tests compare both with transformers. Gemma's module has since refused Gemma 3's
# attn_logit_softcapping, which Gemma3ForCausalLM ignores, and computes every config it accepts as before.)
EARLIER_VERIFIED_FINGERPRINTS = {
    "gemma": {"08f9763f65c026c0"},
    "gpt2": {"9235ed61450115e6"},
    "llama": {"e66a74462a8dd3d2"},
    "roberta": {"695c5ddd82d1a2e0"},
}

# Layers of the model the probe compares, of the run's config otherwise: enough for every kind of layer to meet
# another, few enough to run at the start of a 7B run.
PROBE_LAYERS = 2
# The largest difference of the probe's logits that counts as the same computation: float32 rounding, not a change.
PROBE_TOLERANCE = 1e-4

# config.json keys of an export that claims no architecture: the model file beside it and its fingerprint.
MODEL_FILE_KEY = "flax_lm_model_file"
FINGERPRINT_KEY = "flax_lm_model_fingerprint"
# The weights of such an export, under the Flax parameter paths joined by "/".
FLAX_WEIGHTS_NAME = "flax_model.safetensors"


def module_name(module: ModuleType) -> str:
    """'llama' for flax_lm.models.llama: the name VERIFIED_FINGERPRINTS keys it by."""
    return module.__name__.rsplit(".", 1)[-1]


def module_code_fingerprint(module: ModuleType) -> str:
    """sha256 of the model module's file and of flax_lm/models/common.py, which the modules build on."""
    common = os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py")
    digest = hashlib.sha256()
    for path in (module.__file__, common):
        with open(path, "rb") as file:
            digest.update(file.read())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ModelCode:
    """The code that computes a run's model, and whether its exports name the transformers architecture."""

    module: ModuleType
    own_file: str | None  # the --model_file, kept in the run directory and beside an export that claims nothing
    fingerprint: str
    claims_architecture: bool
    reason: str  # why the exports name the architecture, or why not

    @property
    def description(self) -> str:
        return self.own_file or f"flax_lm/models/{module_name(self.module)}.py"

    def computes_as(self, recorded_fingerprint: str) -> bool:
        """Whether code with `recorded_fingerprint` computed the model as this code does: the same code, or an
        earlier verified version of the stock module this run uses unedited."""
        if recorded_fingerprint == self.fingerprint:
            return True
        name = module_name(self.module)
        return (
            self.own_file is None
            and VERIFIED_FINGERPRINTS.get(name) == self.fingerprint
            and recorded_fingerprint in EARLIER_VERIFIED_FINGERPRINTS.get(name, ())
        )


def load_model_code(config, model_file: str | None, generates_text: bool, tool: str, mesh=None) -> ModelCode:
    """The code of `config`'s model for `tool`: the module of --model_file or of config.model_type, its config checked
    (against the tensor axis of `mesh` too), its fingerprint, and whether exports may name its architecture."""
    module = model_module(config.model_type, model_file, generates_text, tool)
    module.check_model_config(config, mesh)
    fingerprint = module_code_fingerprint(module)
    claims, reason = architecture_claim(module, config, fingerprint, model_file)
    code = ModelCode(module, model_file, fingerprint, claims, reason)
    if model_file or not claims:
        log = logger.info if claims else logger.warning
        log("Model code %s (fingerprint %s): %s", code.description, fingerprint, reason)
    return code


def architecture_claim(module, config, fingerprint: str, model_file: str | None) -> tuple[bool, str]:
    architecture = module.HF_ARCHITECTURES[config.model_type]
    if not model_file and VERIFIED_FINGERPRINTS.get(module_name(module)) == fingerprint:
        return True, f"the code the parity tests compare with transformers' {architecture}"
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return False, (
            f"exports do not name {architecture}, as PyTorch is not installed to check that this code computes it; "
            f"they hold {FLAX_WEIGHTS_NAME} and the model file, which transformers cannot load"
        )
    difference = probe_difference(module, config, getattr(transformers, architecture))
    if isinstance(difference, str):
        return False, f"exports do not name {architecture}: {difference}; transformers cannot load them"
    if difference > PROBE_TOLERANCE:
        return False, (
            f"exports do not name {architecture}: on a probe batch its logits differ from this code's by up to "
            f"{difference:.2g}, so transformers would compute another model; they hold {FLAX_WEIGHTS_NAME} and the "
            "model file"
        )
    return True, f"on a probe batch its logits equal those of transformers' {architecture} (within {difference:.1g})"


def probe_difference(module, config, hf_class) -> float | str:
    """The largest difference between the logits of `module`'s model and of the transformers class `hf_class` with
    the same random weights, on a batch of random tokens, the config cut to PROBE_LAYERS layers; or why the weights
    do not map onto the class."""
    import torch

    probe_config = copy.deepcopy(config)
    probe_config.num_hidden_layers = min(config.num_hidden_layers, PROBE_LAYERS)
    if getattr(probe_config, "layer_types", None) is not None:
        probe_config.layer_types = probe_config.layer_types[:PROBE_LAYERS]
    model = module.MODEL_CLASS(probe_config)
    length = min(16, probe_config.max_position_embeddings)
    ids = np.random.default_rng(0).integers(3, probe_config.vocab_size, (2, length)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        params = nn.meta.unbox(model.init(jax.random.key(0), ids)["params"])
        exported, expected = module.hf_shapes(params), module.hf_architecture_shapes(probe_config)
        differing = sorted(
            name for name in exported.keys() | expected.keys() if exported.get(name) != expected.get(name)
        )
        if differing:
            name = differing[0]
            return (
                f"its export's tensor {name} has shape {exported.get(name)}, the architecture's {expected.get(name)}"
            )
        flax_logits = np.asarray(model.apply({"params": params}, ids))
    state_dict = {name: torch.from_numpy(np.array(value)) for name, value in module.to_hf_state_dict(params).items()}
    torch_model = hf_class(probe_config).eval()
    missing, unexpected = torch_model.load_state_dict(state_dict, strict=False)
    tied = {name for name in missing if name.endswith(("lm_head.weight", "lm_head.decoder.weight", "decoder.bias"))}
    if unexpected or set(missing) - tied:
        return f"the architecture has no tensor {(unexpected or sorted(set(missing) - tied))[0]}"
    with torch.no_grad():
        torch_logits = torch_model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    return float(np.max(np.abs(flax_logits - torch_logits)))


def check_model_file_of(directory_config, model_code: ModelCode, source: str):
    """Refuse to load the weights of `source` (a model directory, of config `directory_config`) with other model code
    than the code it was exported with, where that was code of its own (its config names a model file)."""
    model_file = getattr(directory_config, MODEL_FILE_KEY, None)
    if model_file is None:
        return
    if getattr(directory_config, FINGERPRINT_KEY, None) != model_code.fingerprint:
        raise UsageError(
            f"{source} holds a model of its own code ({model_file}, fingerprint "
            f"{getattr(directory_config, FINGERPRINT_KEY, None)}), not of {model_code.description} (fingerprint "
            f"{model_code.fingerprint}); pass --model_file {os.path.join(source, model_file)} (it is Python code: "
            "read it first if you did not write it)"
        )
