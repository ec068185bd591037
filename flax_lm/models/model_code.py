"""Which code computes a run's model, and what its exports may claim.

A run's model is computed by a module of flax_lm/models (the one its config's model_type names) or by a model file of
the experiment's own (--model_file, an edited copy of such a module). A fingerprint of that code goes into every
training checkpoint, so a run is never resumed with other model code without a word; and an export names a
transformers architecture in its config.json only where the code is known to compute it:
- the stock modules (each family's model.py), as flax_lm ships them (VERIFIED_FINGERPRINTS: the code their parity
  tests compare with transformers);
- other code whose logits, on a probe batch with random weights, equal those of the transformers class it names
  (PyTorch installed): the run's own config, every layer of it, as few rows as the context's length takes to hold
  every token id of its vocabulary, and for a causal LM the key/value cache's routes as well (probe_difference). Where
  that would ask more than PROBE_MAX_TORCH_FLOPS of PyTorch, nothing is claimed. The probe runs at the first export
  (ModelCode.export_claim), after every check that can refuse the run, and not at all with
  --skip_export_check; and each export it allows is read back and compared with the trained model
  (flax_lm.models.huggingface.export_difference), which withdraws the claim where they differ.
Any other export holds its weights as flax_model.safetensors beside a copy of its model file, which transformers does
not load (it looks for model.safetensors), and which the tools of this repository load with --model_file.
"""

import hashlib
import itertools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.devices.mesh import check_expert_split
from flax_lm.errors import UsageError
from flax_lm.models import model_module
from flax_lm.models.gpt2.model import BLOCK_OPTIONS as GPT2_BLOCK_OPTIONS

logger = logging.getLogger(__name__)

# family -> module_code_fingerprint of its model.py, as tests/parity/test_models.py compares it with transformers. A
# change to a model.py (or to a file of flax_lm/models/shared/ it imports) fails that test until its fingerprint here
# is updated, which its parity tests passing makes right.
VERIFIED_FINGERPRINTS = {
    "deepseek_v3": "fb7c08f2bf496656",
    "gemma": "c7d6428d39311be6",
    "gpt2": "160fed58a940323c",
    "gpt_neox": "512bc35e1c6dc38b",
    "gptj": "b66b2a7d6cbe3962",
    "llama": "c008d80d34dcd6a9",
    "mixtral": "e381cb994ed0894b",
    "olmo2": "09ba662aef0ed72b",
    "olmoe": "d8e65fed5d0429c0",
    "opt": "e0d75633fcee52f9",
    "qwen_moe": "df448de35eac42a5",
    "roberta": "1d60caad7d524b02",
    "smollm3": "304c0e44d23cd281",
    "t5": "aeeebafdcf6db97c",
}
# Fingerprints of earlier stock modules, each verified against the same transformers class by the parity tests of its
# version: a checkpoint they trained resumes with today's verified stock code. (0.4 moved flax_lm's modules into
# subpackages, which changed the models' import lines, and added model families, which left what the earlier configs
# compute as it was: the parity tests compare both with transformers. Gemma's module has since refused Gemma 3's
# attn_logit_softcapping, which Gemma3ForCausalLM ignores, and computes every config it accepts as before. GPT-2's
# module has since taken block options, off by default, which leave every config without them computed as before. Then
# the cuDNN attention took document segments too, through one function shared with RoBERTa; written out, as on a CPU,
# every module computes as before. GPT-2's query/key/value product has since been a method of its own, which --fp8
# computes in FP8; without it, the same product as before. Then each family became a folder, model.py beside its
# registration, and common.py moved, unchanged, to shared/: the models' import lines and the file paths in their
# messages changed, nothing computed. The mixture-of-experts layer has since told the train step what its routers did,
# beside the same logits. GPT-J, GPT-NeoX and OPT have since built their stacks from shared/layer_norm_decoder.py, and
# they and T5 map their checkpoints through shared/hf_state_dict.py: the same parameters and logits, and GPT-J's and
# GPT-NeoX's embedding dropout, which training with a config that set it stopped at before, now computed. Then the
# dropless experts exchanged the tokens over a mesh's expert axis by all-to-all (the same sums, in another order), and
# DeepSeek-V3's router told the train step which experts it chose. T5 has since drawn its dropout masks from 16-bit
# random numbers, two from each 32 random bits, and summed its position bias's gradient over the batch as a product:
# the same logits, other masks.)
EARLIER_VERIFIED_FINGERPRINTS = {
    "deepseek_v3": {"08aa212ac6c437af"},
    "gemma": {"ccb4a731dc070557", "70cb8883ead381c2"},
    "gpt2": {"9235ed61450115e6", "37d74b0550392686", "29b9bcfd3633837a", "272c7f9596cdb77c", "61d3745b8a30cf52"},
    "gpt_neox": {"85e0e433b6fdac15"},
    "gptj": {"f4b9583fd3bfaee3"},
    "llama": {"e66a74462a8dd3d2", "503e53ad0738fa05", "1fbca14013f5fdc6"},
    "mixtral": {"b00fe7bcddc082f0", "2249ec051abe0889"},
    "olmo2": {"b0877faf3731d06d", "15a9ef5e60891667"},
    "olmoe": {"1c7ed7355f88bd89", "0058d68a38e1f1d8"},
    "opt": {"ad4e932f69f9ea35"},
    "qwen_moe": {"cc50f079d79c3611", "cd46b93be4545022"},
    "roberta": {"695c5ddd82d1a2e0", "fdebdf944a44cb5c", "7fbe975d967e2fc4"},
    "t5": {"99a35b4ffc6457a9", "9e16feaa649a3d8d"},
}
# Config fields an earlier verified version read nothing of: it computed as today's code only for a config that leaves
# them unset (GPT-2's block options, which a hand-edited config could hold before create_config.py took them).
GPT2_BEFORE_ITS_BLOCK_OPTIONS = ("9235ed61450115e6", "37d74b0550392686")
FIELDS_EARLIER_CODE_IGNORED = {fingerprint: tuple(GPT2_BLOCK_OPTIONS) for fingerprint in GPT2_BEFORE_ITS_BLOCK_OPTIONS}

# The most work the probe may ask of PyTorch on the CPU (its model's forward pass over the probe batch, about 2 x
# parameters x tokens), which runs before the first step: a minute or two of a laptop's CPU. GPT-2 124M would take
# 13 TFLOP, 25 minutes on two cores (docs/trust.md); an edited copy of a model that size claims nothing, since an edit
# that changes nothing it computes is rare, and its export is read by this repository's tools (--model_file).
PROBE_MAX_TORCH_FLOPS = 5e12
# The float32 logits of the rows compared at a time, per route, at most (a row has length x vocabulary of them).
PROBE_LOGITS_BYTES = 128 * 2**20
# The largest difference of the probe's logits that counts as the same computation: float32 rounding, not a change.
PROBE_TOLERANCE = 1e-4

# config.json keys of an export that claims no architecture: the model file beside it and its fingerprint.
MODEL_FILE_KEY = "flax_lm_model_file"
FINGERPRINT_KEY = "flax_lm_model_fingerprint"
# The weights of such an export, under the Flax parameter paths joined by "/".
FLAX_WEIGHTS_NAME = "flax_model.safetensors"


def module_name(module: ModuleType) -> str:
    """'llama' for flax_lm.models.llama.model, its family: the name VERIFIED_FINGERPRINTS keys it by; a model file's
    own module name for any other module."""
    package, _, name = module.__name__.rpartition(".")
    parent, _, family = package.rpartition(".")
    return family if parent == "flax_lm.models" and name == "model" else module.__name__


def shared_files(module: ModuleType) -> list[str]:
    """The files of flax_lm/models/shared/ that the model module builds on: those it imports, or imports a function or
    class of, and those these build on in turn (the mixture-of-experts decoder builds on moe.py), in the order of
    their names."""
    found, unread = set(), [module]
    while unread:
        values = vars(unread.pop()).values()
        names = {
            value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None) for value in values
        }
        for name in names:
            if isinstance(name, str) and name.startswith("flax_lm.models.shared.") and name not in found:
                found.add(name)
                unread.append(sys.modules[name])
    return [sys.modules[name].__file__ for name in sorted(found)]


def module_code_fingerprint(module: ModuleType) -> str:
    """sha256 of the model module's file and of the files of flax_lm/models/shared/ it builds on (shared_files):
    flax_lm/models/shared/common.py for every family of flax_lm 0.4, as the fingerprints of 0.4 covered the module and
    flax_lm/models/common.py."""
    digest = hashlib.sha256()
    for path in (module.__file__, *shared_files(module)):
        with open(path, "rb") as file:
            digest.update(file.read())
    return digest.hexdigest()[:16]


@dataclass(eq=False)
class ModelCode:
    """The code that computes a run's model, and whether its exports name the transformers architecture."""

    module: ModuleType
    own_file: str | None  # the --model_file, kept in the run directory and beside an export that claims nothing
    fingerprint: str
    config: Any  # the run's config, whose architecture (module.HF_ARCHITECTURES) an export may name
    compares_exports: bool = True  # False for a tool that exports nothing, and with --skip_export_check
    fields_set: frozenset = frozenset()  # the config's fields of FIELDS_EARLIER_CODE_IGNORED it sets
    claim: tuple[bool, str] | None = None  # (claims_architecture, reason), once decided

    @property
    def description(self) -> str:
        return self.own_file or f"flax_lm/models/{module_name(self.module)}/model.py"

    @property
    def is_verified_stock(self) -> bool:
        """Whether this is a stock module as the parity tests compare it with transformers: its exports are not
        compared with the trained model, as there is nothing the comparison could find."""
        return self.own_file is None and VERIFIED_FINGERPRINTS.get(module_name(self.module)) == self.fingerprint

    def export_claim(self) -> tuple[bool, str]:
        """(whether the exports name the architecture, why): decided when first asked, which the scripts leave to
        their first export, after every check that can refuse the run, as it can take a probe (architecture_claim);
        withdrawn where an export did not compute as the trained model (withdraw_claim)."""
        if self.claim is None:
            self.claim = self.decide_claim()
            if self.own_file or not self.claim[0]:
                log = logger.info if self.claim[0] else logger.warning
                log("Model code %s (fingerprint %s): %s", self.description, self.fingerprint, self.claim[1])
        return self.claim

    @property
    def claims_architecture(self) -> bool:
        return self.export_claim()[0]

    @property
    def reason(self) -> str:
        return self.export_claim()[1]

    def decide_claim(self) -> tuple[bool, str]:
        without_probe = claim_without_probe(self.module, self.config, self.fingerprint, self.own_file)
        if without_probe is not None:
            return without_probe
        if not self.compares_exports:
            return False, (
                f"exports do not name {architecture_of(self.module, self.config)}, as --skip_export_check leaves "
                f"the code unchecked; they hold {FLAX_WEIGHTS_NAME} and the model file"
            )
        return architecture_claim(self.module, self.config, self.fingerprint, self.own_file)

    def withdraw_claim(self, reason: str):
        """No export of the run names the architecture from now on, for `reason`."""
        self.claim = (False, reason)
        logger.warning("Model code %s (fingerprint %s): %s", self.description, self.fingerprint, reason)

    def computes_as(self, recorded_fingerprint: str) -> bool:
        """Whether code with `recorded_fingerprint` computed the model as this code does: the same code, or an
        earlier verified version of the stock module this run uses unedited, for a config it read all of."""
        if recorded_fingerprint == self.fingerprint:
            return True
        name = module_name(self.module)
        return (
            self.own_file is None
            and VERIFIED_FINGERPRINTS.get(name) == self.fingerprint
            and recorded_fingerprint in EARLIER_VERIFIED_FINGERPRINTS.get(name, ())
            and not self.fields_ignored_by(recorded_fingerprint)
        )

    def fields_ignored_by(self, recorded_fingerprint: str) -> list[str]:
        """The config fields this run sets that the code of `recorded_fingerprint` read nothing of."""
        return sorted(self.fields_set & set(FIELDS_EARLIER_CODE_IGNORED.get(recorded_fingerprint, ())))


def load_model_code(
    config,
    model_file: str | None,
    generates_text: bool,
    tool: str,
    mesh=None,
    exports: bool = True,
    compare_exports: bool = True,
    encoder_decoder: bool = False,
) -> ModelCode:
    """The code of `config`'s model for `tool`: the module of --model_file or of config.model_type, its config checked
    (against the tensor axis of `mesh` too), its fingerprint, and what its exports may claim. Where that takes a probe
    (code other than a verified stock module), it is decided at the first export (ModelCode.export_claim); for
    a tool that `exports` nothing, or without `compare_exports` (--skip_export_check), no probe runs and exports of
    such code claim nothing. A tool of encoder-decoders (run_t5_mlm_flax.py) passes `encoder_decoder`."""
    module = model_module(config.model_type, model_file, generates_text, tool, encoder_decoder)
    module.check_model_config(config, mesh)
    if mesh is not None and not hasattr(config, "num_experts_per_tok"):  # an MoE module checks its experts itself
        check_expert_split(mesh, None)
    fingerprint = module_code_fingerprint(module)
    fields_set = frozenset(
        name
        for name in itertools.chain(*FIELDS_EARLIER_CODE_IGNORED.values())
        if getattr(config, name, None) not in (None, False)
    )
    code = ModelCode(module, model_file, fingerprint, config, exports and compare_exports, fields_set)
    if not exports:
        code.claim = (False, f"{tool} exports nothing")
    elif claim_without_probe(module, config, fingerprint, model_file) is not None:
        code.export_claim()  # decided, and said, at the start where that takes no probe
    return code


def architecture_of(module, config) -> str:
    """The transformers class an export of `module`'s model of `config` may name."""
    return module.HF_ARCHITECTURES[config.model_type]


def claim_without_probe(module, config, fingerprint: str, model_file: str | None) -> tuple[bool, str] | None:
    """(whether exports name the architecture, why) where no probe is needed to say: a config of options the
    architecture lacks, a verified stock module, or no PyTorch to probe with; None otherwise."""
    architecture = architecture_of(module, config)
    # A config of options the architecture lacks (flax_lm/models/gpt2/model.py's block options): its weights, loaded
    # there, would be computed as another model.
    if refusal := getattr(module, "export_refusal", lambda config: None)(config):
        return False, (
            f"exports do not name {architecture}: {refusal}; they hold {FLAX_WEIGHTS_NAME} and the model file, "
            "which this repository's tools load and transformers does not"
        )
    if VERIFIED_FINGERPRINTS.get(module_name(module)) == fingerprint:
        return True, f"the code the parity tests compare with transformers' {architecture}"
    if model_file and fingerprint in VERIFIED_FINGERPRINTS.values():  # an unedited copy: the same bytes
        return True, f"an unedited copy of the code the parity tests compare with transformers' {architecture}"
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False, (
            f"exports do not name {architecture}, as PyTorch is not installed to check that this code computes it; "
            f"they hold {FLAX_WEIGHTS_NAME} and the model file, which transformers cannot load"
        )
    return None


def architecture_claim(module, config, fingerprint: str, model_file: str | None) -> tuple[bool, str]:
    """(whether exports of `module`'s model of `config` name its architecture, why): claim_without_probe's answer,
    else that of a probe against transformers' class (probe_difference)."""
    if (claim := claim_without_probe(module, config, fingerprint, model_file)) is not None:
        return claim
    import transformers

    architecture = architecture_of(module, config)
    difference = probe_difference(module, config, getattr(transformers, architecture))
    if isinstance(difference, str):
        return False, f"exports do not name {architecture}: {difference}; transformers cannot load them"
    if difference > PROBE_TOLERANCE:
        return False, (
            f"exports do not name {architecture}: on a probe batch its logits differ from this code's by up to "
            f"{difference:.2g}, so transformers would compute another model; they hold {FLAX_WEIGHTS_NAME} and the "
            "model file"
        )
    cached = module.GENERATES_TEXT or getattr(module, "ENCODER_DECODER", False)
    routes = ", with and without the key/value cache," if cached else ""
    return True, (
        f"on a probe of every layer, position and token id{routes} its logits equal those of transformers' "
        f"{architecture} (within {difference:.1g}); each export is compared with the trained model"
    )


def loaded_as_a_checkpoint(hf_class, config, state_dict: dict) -> tuple[Any, list[str], list[str]]:
    """(the PyTorch model of `hf_class` with `state_dict`, the tensors it lacks, those it does not hold) read as
    from_pretrained reads a checkpoint directory, with the conversions transformers makes on load: transformers 5
    fuses the experts of a mixture of experts, each a tensor of its own in the checkpoints (and in exports), into
    3-D tensors of all."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        save_file({name: tensor.contiguous() for name, tensor in state_dict.items()}, f"{directory}/model.safetensors")
        model, loading = hf_class.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    return model.eval(), loading["missing_keys"], loading["unexpected_keys"]


def probe_difference(module, config, hf_class) -> float | str:
    """The largest difference between the logits of `module`'s model and of the transformers class `hf_class` with
    the same random weights, or why the weights do not map onto the class (or why the probe would cost too much).

    The probe batch (probe_ids) holds every token id of the vocabulary, in rows as long as the context, so that
    every embedding row, every position and every layer takes part; a causal LM's logits are compared three ways:
    without a cache, with the rows prefilled into a cache at once (as a prompt is), and decoded one token at a time
    from an empty cache (as generation is)."""
    import torch

    model = module.MODEL_CLASS(config)
    length = probe_length(module, config)
    if length < 1:
        return f"the config leaves no positions to probe (max_position_embeddings {config.max_position_embeddings})"
    ids = probe_ids(config.vocab_size, length)
    abstract = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), ids[:1])["params"])
    exported, expected = module.hf_shapes(abstract), module.hf_architecture_shapes(config)
    differing = sorted(name for name in exported.keys() | expected.keys() if exported.get(name) != expected.get(name))
    if differing:
        name = differing[0]
        return f"its export's tensor {name} has shape {exported.get(name)}, the architecture's {expected.get(name)}"
    parameters = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(abstract))
    torch_work = 2 * parameters * ids.size
    if torch_work > PROBE_MAX_TORCH_FLOPS:
        return (
            f"comparing every layer, position and token id with PyTorch would take {torch_work / 1e12:.0f} TFLOP "
            f"on the CPU, over the probe's limit of {PROBE_MAX_TORCH_FLOPS / 1e12:.0f}"
        )
    with jax.default_matmul_precision("highest"):
        params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids[:1])["params"])
    # Under the names the PyTorch model holds them by, where the checkpoint's differ (module.LOADED_NAMES).
    loaded_names = getattr(module, "LOADED_NAMES", {})
    state_dict = {
        loaded_names.get(name, name): torch.from_numpy(np.array(value))
        for name, value in module.to_hf_state_dict(params).items()
    }
    torch_model = hf_class(config).eval()
    missing, unexpected = torch_model.load_state_dict(state_dict, strict=False)
    tied = {name for name in missing if name.endswith(("lm_head.weight", "lm_head.decoder.weight", "decoder.bias"))}
    if unexpected or set(missing) - tied:  # a layout the class converts as it loads a checkpoint, or none it reads
        torch_model, missing, unexpected = loaded_as_a_checkpoint(hf_class, config, state_dict)
    if unexpected or set(missing) - tied:
        return f"the architecture has no tensor {(unexpected or sorted(set(missing) - tied))[0]}"
    del state_dict

    encoder_decoder = getattr(module, "ENCODER_DECODER", False)

    def torch_logits(rows):
        rows = torch.from_numpy(rows.astype(np.int64))
        with torch.no_grad():  # an encoder-decoder's decoder reads the rows its encoder read
            return torch_model(rows, decoder_input_ids=rows if encoder_decoder else None).logits.numpy()

    return routes_difference(model, params, ids, torch_logits, module.GENERATES_TEXT, encoder_decoder)


def routes_difference(
    model,
    params,
    ids: np.ndarray,
    expected_logits: Callable[[np.ndarray], np.ndarray],
    generates_text: bool,
    encoder_decoder: bool = False,
) -> float:
    """The largest difference between the logits `expected_logits` gives for rows of `ids` and those of `model` with
    `params` (float32) on each route it computes them by, relative to the largest logit where that is over 1: without a
    cache and, for a causal LM (`generates_text`), with the rows prefilled into a cache at once (as a prompt is) and
    decoded one token at a time from an empty cache (as generation is); an encoder-decoder reads the rows into its
    encoder and its decoder, at once and one token at a time from the cache of the encoder's output. The rows go
    probe_group_rows at a time, the matrix products in float32."""

    def uncached(params, rows):
        return model.apply({"params": params}, rows)

    def prefilled(params, rows):  # the whole rows at once into a cache, as a prompt is
        cache = model.empty_cache(jnp.ones(rows.shape, bool), 0)
        return model.apply({"params": params}, rows, cache=cache)[0]

    def decoded(params, rows):  # one token at a time from an empty cache, as generation is
        def step(cache, column):
            logits, cache = model.apply({"params": params}, column[:, None], cache=cache)
            return cache, logits[:, 0]

        cache = model.empty_cache(jnp.ones((rows.shape[0], 0), bool), rows.shape[1])
        return jnp.swapaxes(jax.lax.scan(step, cache, rows.T)[1], 0, 1)

    def decoded_after_encoding(params, rows):  # as an encoder-decoder generates: the encoder once, then the decoder
        variables = {"params": params}
        encoder_output = model.apply(variables, rows, method="encode")
        cache = model.apply(variables, encoder_output, None, rows.shape[1], method="start_decoding")

        def step(cache, column):
            logits, cache = model.apply(variables, column[:, None], cache, method="decode")
            return cache, logits[:, 0]

        return jnp.swapaxes(jax.lax.scan(step, cache, rows.T)[1], 0, 1)

    if encoder_decoder:
        routes = [uncached, decoded_after_encoding]
    else:
        routes = [uncached, prefilled, decoded] if generates_text else [uncached]

    @jax.jit
    def largest_difference(params, rows, expected):  # one compiled program for every route
        difference = jnp.max(jnp.stack([jnp.max(jnp.abs(route(params, rows) - expected)) for route in routes]))
        return difference / jnp.maximum(1.0, jnp.max(jnp.abs(expected)))

    difference = 0.0
    with jax.default_matmul_precision("highest"):
        group = min(len(ids), probe_group_rows(ids.shape[1], model.config.vocab_size))
        for rows in np.split(ids, len(ids) // group):
            difference = max(difference, float(largest_difference(params, rows, expected_logits(rows))))
    return difference


def probe_length(module, config) -> int:
    """The positions a row of the model's input may have: the config's max_position_embeddings, less, for a masked
    LM, the pad_token_id + 1 that RoBERTa's numbering of positions leaves unused; for a model of relative positions
    only (an encoder-decoder such as T5), the module's probe_length: rows long enough for every distance it tells
    apart."""
    if hasattr(module, "probe_length"):
        return module.probe_length(config)
    if module.GENERATES_TEXT:
        return config.max_position_embeddings
    return config.max_position_embeddings - (config.pad_token_id + 1)


def probe_ids(vocab_size: int, length: int) -> np.ndarray:
    """(rows, length) int32 token ids holding every id of the vocabulary once, shuffled, the rest drawn at random: as
    few rows as that takes, in groups of one shape (probe_group_rows, or all the rows where they are fewer)."""
    rng = np.random.default_rng(0)
    rows = -(-vocab_size // length)
    group = min(rows, probe_group_rows(length, vocab_size))
    rows = -(-rows // group) * group
    ids = np.concatenate([rng.permutation(vocab_size), rng.integers(0, vocab_size, rows * length - vocab_size)])
    return ids.reshape(rows, length).astype(np.int32)


def probe_group_rows(length: int, vocab_size: int) -> int:
    """Rows compared at a time, at most: as many as keep one route's logits within PROBE_LOGITS_BYTES."""
    return max(1, PROBE_LOGITS_BYTES // (4 * length * vocab_size))


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
