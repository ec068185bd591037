"""Low-rank adapters (LoRA, Hu et al. 2021) on a model of flax_lm/models, from outside its code, in PEFT's format.

A targeted dense layer computes y = x W + scale * dropout(x) A B, A (in, rank) and B (rank, out), scale alpha / rank:
the base weights W stay as loaded (frozen: no gradient, no optimizer state), A and B train. A and B are parameters of
the layer they adapt, lora_A and lora_B beside its kernel, so that the train state, its checkpoints, resume and the
mesh hold them as any other; the model is a subclass of the family's model class (adapted_model) whose apply adds
the adapters' product through a flax method interceptor, as fp8.py multiplies in FP8: the family's module, its
fingerprint and what its exports claim stay as they are.

Which layer is which of PEFT's target modules (q_proj, c_attn, ...) and its name in the adapter's files come from the
export's mapping (the family's to_hf_state_dict): a layer whose kernel is exactly one tensor of the transformers
model can be adapted, under that tensor's module name. GPT-2's Conv1D layers store their weights (in, out) as a Flax
kernel, PEFT's fan_in_fan_out. The output directory is a PEFT adapter (write_adapter): adapter_config.json and
adapter_model.safetensors, lora_A.weight (rank, in) and lora_B.weight (out, rank) under
base_model.model.<module>, which `peft.PeftModel.from_pretrained(base, directory)` loads."""

import functools
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.experimental import multihost_utils
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from flax_lm.errors import UsageError, naming_a_full_disk
from flax_lm.models.huggingface import check_architecture_fits, export_difference, write_export
from flax_lm.models.model_code import PROBE_TOLERANCE
from flax_lm.models.tokenizer_files import save_tokenizer_files

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The parameters of an adapter, beside the kernel of the layer it adapts.
ADAPTER_LEAVES = ("lora_A", "lora_B")
# PEFT's default target modules (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): the first of these whose
# layers the model has, without --lora_target_modules.
DEFAULT_TARGET_MODULES = (("q_proj", "v_proj"), ("c_attn",), ("query", "value"), ("query_key_value",))


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of a run: --lora_rank, --lora_alpha, --lora_dropout and --lora_target_modules (None: PEFT's
    default), or those of the PEFT adapter --lora_adapter continues; --merge_adapters."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | None
    adapter: str | None = None
    merge: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class AdapterTarget:
    """A layer adapted: the path of its module in the Flax parameters, and its module in the transformers model."""

    path: tuple[str, ...]
    hf_module: str  # model.layers.0.self_attn.q_proj
    fan_in: int
    fan_out: int
    fan_in_fan_out: bool  # the transformers layer stores its weight (in, out): GPT-2's Conv1D


def is_adapter(path, param=None) -> bool:
    """Whether a parameter is an adapter's (the is_trained of a run with adapters: only they train)."""
    last = path[-1]
    return getattr(last, "key", last) in ADAPTER_LEAVES


def decaying_adapters(decay_mask):
    """`decay_mask(params)` (a script's: True where weight decay applies) with LoRA's adapters decayed as well, as
    transformers' Trainer decays a PEFT model's: every trained parameter but biases and norms (its
    get_decay_parameter_names), lora_A and lora_B among them; a script's mask that names kernels alone would leave
    them out. A model without adapters keeps the script's mask as it is."""

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, decayed: decayed or is_adapter(path), decay_mask(params))

    return mask


def without_adapters(params):
    """`params` (or their shapes) without the adapters: the base model's."""
    return unflatten_dict({path: value for path, value in flatten_dict(params).items() if not is_adapter(path)})


def check_lora_settings(settings: LoraSettings):
    """Refuse, in one line, settings no adapter can have."""
    if settings.rank < 1:
        raise UsageError(f"--lora_rank {settings.rank}: an adapter's rank must be at least 1 (8 or 16 are usual)")
    if not settings.alpha > 0:
        raise UsageError(f"--lora_alpha {settings.alpha}: must be above 0 (the adapter's product is alpha / rank)")
    if not 0 <= settings.dropout < 1:
        raise UsageError(f"--lora_dropout {settings.dropout}: must be at least 0 and below 1")


def adapter_settings(settings: LoraSettings) -> LoraSettings:
    """`settings` with those of the PEFT adapter --lora_adapter names (its adapter_config.json), which it continues:
    its rank, alpha, dropout and target modules."""
    if settings.adapter is None:
        return settings
    config = read_adapter_config(settings.adapter)
    targets = config["target_modules"]
    return LoraSettings(
        int(config["r"]),
        float(config["lora_alpha"]),
        float(config.get("lora_dropout", 0.0)),
        tuple(sorted(targets)),
        settings.adapter,
        settings.merge,
    )


def read_adapter_config(directory: str) -> dict:
    """The adapter_config.json of the PEFT adapter in `directory`, refused in one line where it is not one of plain
    LoRA adapters on modules named in a list (what this module computes)."""
    path = os.path.join(directory, ADAPTER_CONFIG)
    try:
        with open(path) as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read the adapter's {path} ({error})") from None
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise UsageError(f"{path} is not of a plain LoRA adapter (peft_type LORA, without rsLoRA or DoRA)")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(name, str) for name in targets):
        raise UsageError(f"{path} names its target_modules by a pattern; a list of module names is needed")
    return config


def adapter_base(directory: str) -> str:
    """The base model of the PEFT adapter in `directory` (its base_model_name_or_path)."""
    base = read_adapter_config(directory).get("base_model_name_or_path")
    if not base:
        raise UsageError(f"{os.path.join(directory, ADAPTER_CONFIG)} names no base_model_name_or_path to adapt")
    return base


def with_adapter_merged(directory: str, params, module):
    """The base parameters `params` of `module` (a family's model module) with the PEFT adapter in `directory`
    merged into them (merged_params): the model the adapter computes, as an ordinary one."""
    settings = adapter_settings(LoraSettings(0, 1.0, 0.0, None, directory))
    targets = adapter_targets(params, module, settings.target_modules)
    adapters = read_adapters(directory, targets, settings.rank, np.float32)
    return merged_params(with_adapters(params, adapters), targets, settings.scale)


def adapter_targets(abstract_params, module, target_modules: tuple[str, ...] | None) -> list[AdapterTarget]:
    """The layers of `abstract_params` (base parameters of `module`, a family's model module) that the target module
    names pick, each mapped onto its tensor of the transformers model by the module's to_hf_state_dict; the names
    PEFT picks by default (DEFAULT_TARGET_MODULES) without any. Refuses a name that picks no layer, and a layer that
    is not one tensor there."""
    kernels = {
        path: value for path, value in flatten_dict(abstract_params).items() if path[-1] == "kernel" and len(path) > 1
    }
    layer_names = sorted({path[-2] for path in kernels})
    if target_modules is None:
        default = next((names for names in DEFAULT_TARGET_MODULES if set(names) <= set(layer_names)), None)
        if default is None:
            raise UsageError(f"--lora_target_modules is needed for this model: name some of {', '.join(layer_names)}")
        target_modules = default
    if unknown := [name for name in target_modules if name not in layer_names]:
        raise UsageError(
            f"--lora_target_modules {unknown[0]}: the model has no layer of that name; its layers are "
            f"{', '.join(layer_names)}"
        )
    targets = []
    for path, kernel in kernels.items():
        if path[-2] not in target_modules:
            continue
        name = "/".join(path[:-1])
        # Where the export puts a kernel of this path: a probe of distinct numbers comes back as it is (GPT-2's
        # Conv1D) or transposed (nn.Linear), else the layer is not one of the transformers model's weights as it is.
        probe = np.arange(6, dtype=np.float32).reshape(2, 3)
        mapped = module.to_hf_state_dict(unflatten_dict({path: probe}))
        (hf_name, weight), = mapped.items() if len(mapped) == 1 else (("", None),)  # fmt: skip
        as_is, transposed = (weight is not None and np.array_equal(weight, layout) for layout in (probe, probe.T))
        if kernel.ndim != 2 or not hf_name.endswith(".weight") or not (as_is or transposed):
            raise UsageError(
                f"--lora_target_modules {path[-2]}: the layer {name} is not one weight matrix of the transformers "
                "model, which PEFT could adapt; leave it out"
            )
        fan_in, fan_out = kernel.shape
        targets.append(AdapterTarget(path[:-1], hf_name[: -len(".weight")], fan_in, fan_out, as_is))
    return targets


def new_adapters(targets: list[AdapterTarget], rank: int, key, dtype) -> dict:
    """Adapters as PEFT initialises them: A uniform in +-1/sqrt(in) (torch's kaiming_uniform_ with a = sqrt(5), of
    lora_A.weight (rank, in)), B zeros, so that the adapted model starts as the base model. {path: value}."""
    adapters = {}
    for number, target in enumerate(targets):
        bound = 1 / math.sqrt(target.fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, number), (target.fan_in, rank), dtype, -bound, bound)
        adapters[(*target.path, "lora_A")] = a
        adapters[(*target.path, "lora_B")] = jnp.zeros((rank, target.fan_out), dtype)
    return adapters


def with_adapters(params, adapters: dict):
    """`params` (a nested dict, boxed or not) with the adapters {path: value} added beside their kernels."""
    flat = flatten_dict(params)
    flat.update(adapters)
    return unflatten_dict(flat)


def adapter_product(layer: nn.Module, inputs, scale: float, dropout: float, deterministic: bool):
    """scale * dropout(inputs) A B of the adapters of `layer` (a bound module with lora_A and lora_B), in the
    layer's dtype: (..., out)."""
    a, b = (nn.meta.unbox(layer.get_variable("params", name)) for name in ADAPTER_LEAVES)
    dtype = getattr(layer, "dtype", None) or inputs.dtype
    if dropout and not deterministic:
        kept = jax.random.bernoulli(layer.make_rng("dropout"), 1.0 - dropout, inputs.shape)
        inputs = jnp.where(kept, inputs / (1.0 - dropout), 0.0)
    rows = inputs.reshape(-1, inputs.shape[-1]).astype(dtype)
    product = (rows @ a.astype(dtype)) @ b.astype(dtype) * jnp.asarray(scale, dtype)
    return product.reshape(*inputs.shape[:-1], -1)


def added_to(output, product, layer_name: str):
    """The layer's `output` plus the adapters' product (..., out): an array (..., out), or a tuple of arrays whose
    columns are the kernel's in order, each with a trailing shape of its own (GPT-2's c_attn: query, key, value)."""
    if not isinstance(output, tuple):
        return output + product.astype(output.dtype)
    parts = jnp.split(product, len(output), axis=-1)
    if any(part.size != piece.size for part, piece in zip(parts, output)):
        raise UsageError(f"the adapted layer {layer_name} returns other than its product; leave it out")
    return tuple(piece + part.reshape(piece.shape).astype(piece.dtype) for piece, part in zip(output, parts))


def adapted_model(model: nn.Module, targets: list[AdapterTarget], settings: LoraSettings, seed: int) -> nn.Module:
    """`model` with adapters on `targets`: its init adds them (new_adapters, drawn from `seed`), its apply computes
    them. Its fields, parameters and methods are `model`'s otherwise."""
    fields = {field.name: getattr(model, field.name) for field in model.__dataclass_fields__.values() if field.init}
    fields.pop("parent"), fields.pop("name")
    adapters = (tuple(targets), settings.rank, settings.scale, settings.dropout, seed)
    return adapted_class(type(model), adapters)(**fields)


@functools.cache
def adapted_class(model_class: type, adapters: tuple) -> type:
    """The subclass of `model_class` that adapted_model makes."""
    targets, rank, scale, dropout, seed = adapters

    class LoraAdapted(model_class):
        def init(self, rngs, *args, **kwargs):
            variables = super().init(rngs, *args, **kwargs)
            param_dtype = getattr(self, "param_dtype", jnp.float32)
            adapters = new_adapters(list(targets), rank, adapter_key(seed), param_dtype)
            return {**variables, "params": with_adapters(variables["params"], adapters)}

        def apply(self, variables, *args, **kwargs):
            # The models take it by keyword, as the scripts' train steps pass it: without it, no dropout (evaluation).
            deterministic = kwargs.get("deterministic", True)
            in_call = set()

            def interceptor(next_fun, args, kwargs, context):
                layer = context.module
                if context.method_name != "__call__" or id(layer) in in_call or not args:
                    return next_fun(*args, **kwargs)
                if not layer.has_variable("params", "lora_A"):
                    return next_fun(*args, **kwargs)
                in_call.add(id(layer))  # a subclass's __call__ calls its base's: one product
                try:
                    output = next_fun(*args, **kwargs)
                finally:
                    in_call.discard(id(layer))
                product = adapter_product(layer, args[0], scale, dropout, deterministic)
                return added_to(output, product, "/".join(layer.path))

            with nn.intercept_methods(interceptor):
                return super().apply(variables, *args, **kwargs)

    LoraAdapted.__name__ = LoraAdapted.__qualname__ = f"LoraAdapted{model_class.__name__}"
    return LoraAdapted


def merged_params(params, targets: list[AdapterTarget], scale: float):
    """The base parameters with each adapter merged into its kernel, W + scale * A B (computed in float32): the
    ordinary model that computes as the adapted one."""
    flat = flatten_dict(params)
    for target in targets:
        kernel_path = (*target.path, "kernel")
        a, b = (np.asarray(flat[(*target.path, name)], np.float32) for name in ADAPTER_LEAVES)
        kernel = np.asarray(flat[kernel_path])
        flat[kernel_path] = (kernel.astype(np.float32) + scale * (a @ b)).astype(kernel.dtype)
    return without_adapters(unflatten_dict(flat))


def peft_name(target: AdapterTarget, leaf: str) -> str:
    return f"base_model.model.{target.hf_module}.{leaf}.weight"


def adapter_tensors(params, targets: list[AdapterTarget]) -> dict[str, np.ndarray]:
    """The adapters as PEFT saves them: lora_A.weight (rank, in) and lora_B.weight (out, rank), float32."""
    flat = flatten_dict(params)
    return {
        peft_name(target, leaf): np.ascontiguousarray(np.asarray(flat[(*target.path, leaf)], np.float32).T)
        for target in targets
        for leaf in ADAPTER_LEAVES
    }


def adapter_config(settings: LoraSettings, targets: list[AdapterTarget], base_model: str, task_type) -> dict:
    """adapter_config.json of PEFT's LoraConfig: the fields that say what the adapters compute."""
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted({target.path[-1] for target in targets}),
        "fan_in_fan_out": any(target.fan_in_fan_out for target in targets),
        "bias": "none",
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_adapter(output_dir: str, host_params, targets, settings: LoraSettings, base_model: str, task_type):
    """adapter_config.json and adapter_model.safetensors of the adapters in `host_params`, in `output_dir`."""
    config = adapter_config(settings, targets, base_model, task_type)
    weights = os.path.join(output_dir, ADAPTER_WEIGHTS)
    save_file(adapter_tensors(host_params, targets), f"{weights}.tmp", metadata={"format": "pt"})
    os.replace(f"{weights}.tmp", weights)
    config_path = os.path.join(output_dir, ADAPTER_CONFIG)
    with open(f"{config_path}.tmp", "w") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    os.replace(f"{config_path}.tmp", config_path)


def read_adapters(directory: str, targets: list[AdapterTarget], rank: int, dtype) -> dict:
    """The adapters of the PEFT adapter in `directory` (adapter_model.safetensors), {path: value} in Flax's layout
    (A (in, rank), B (rank, out)), for `targets`; refused in one line where a tensor is missing or of another shape."""
    path = os.path.join(directory, ADAPTER_WEIGHTS)
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise UsageError(f"cannot read the adapter's {path} ({error})") from None
    adapters = {}
    for target in targets:
        for leaf, shape in (("lora_A", (rank, target.fan_in)), ("lora_B", (target.fan_out, rank))):
            name = peft_name(target, leaf)
            if name not in tensors or tensors[name].shape != shape:
                raise UsageError(f"{path} has no {name} of shape {shape}: the adapter is of another model")
            adapters[(*target.path, leaf)] = np.asarray(tensors[name].T, dtype)
    return adapters


@dataclass(frozen=True)
class Adapters:
    """A run's adapters: their settings, the layers they adapt, the base model they adapt (--model_name_or_path) and
    what reads its weights ((model_code, abstract base params) -> params), and PEFT's task type of the model."""

    settings: LoraSettings
    targets: tuple[AdapterTarget, ...]
    base_model: str
    read_base: Callable
    task_type: str | None = "CAUSAL_LM"

    def describe(self, abstract_params) -> str:
        trained = sum(value.size for path, value in flatten_dict(abstract_params).items() if is_adapter(path))
        total = sum(value.size for value in flatten_dict(abstract_params).values())
        names = ", ".join(sorted({target.path[-1] for target in self.targets}))
        return (
            f"LoRA adapters of rank {self.settings.rank} (alpha {self.settings.alpha:g}) on {len(self.targets)} "
            f"layers ({names}): {trained:,} of {total:,} parameters train ({100 * trained / total:.2f}%)"
        )

    def start_params(self, model_code, abstract_params, seed: int):
        """The parameters a run starts from: the base model's weights, and the adapters of --lora_adapter or new ones
        (new_adapters, as the adapted model's init draws them from `seed`)."""
        base = self.read_base(model_code, without_adapters(abstract_params))
        dtype = next(value.dtype for path, value in flatten_dict(abstract_params).items() if is_adapter(path))
        if self.settings.adapter:
            adapters = read_adapters(self.settings.adapter, list(self.targets), self.settings.rank, dtype)
        else:
            adapters = new_adapters(list(self.targets), self.settings.rank, adapter_key(seed), dtype)
        return with_adapters(base, adapters)

    def read_export(self, output_dir: str, model_code, abstract_params):
        """The parameters of the adapter exported to `output_dir`, on the base model's weights."""
        base = self.read_base(model_code, without_adapters(abstract_params))
        dtype = next(value.dtype for path, value in flatten_dict(abstract_params).items() if is_adapter(path))
        return with_adapters(base, read_adapters(output_dir, list(self.targets), self.settings.rank, dtype))

    def save(self, output_dir: str, params, config, tokenizer, model_code, max_shard_size: str | None):
        """The export of a run with adapters: the PEFT adapter (write_adapter) and the tokenizer in `output_dir`;
        with --merge_adapters also the merged model in output_dir/merged, an ordinary export, which is read back
        and compared with the adapted model (the trust check of exports: flax_lm/models/model_code.py) before it is
        kept. Every process gathers the parameters; process 0 writes."""
        host_params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return
        with naming_a_full_disk("--output_dir", output_dir):
            write_adapter(output_dir, host_params, self.targets, self.settings, self.base_model, self.task_type)
            save_tokenizer_files(tokenizer, output_dir)
        if self.settings.merge:
            self.save_merged(os.path.join(output_dir, MERGED_DIR), host_params, config, tokenizer, model_code)

    def save_merged(self, merged_dir: str, host_params, config, tokenizer, model_code):
        merged = merged_params(host_params, list(self.targets), self.settings.scale)
        check_architecture_fits(merged, config, model_code.module)
        os.makedirs(merged_dir, exist_ok=True)
        write_export(merged_dir, merged, config, tokenizer, model_code, None)
        adapted = adapted_model(model_code.module.MODEL_CLASS(config), list(self.targets), self.settings, 0)
        float32_params = jax.tree.map(lambda value: np.asarray(value, np.float32), host_params)
        difference = export_difference(merged_dir, adapted, float32_params)
        if not (isinstance(difference, float) and difference <= PROBE_TOLERANCE):
            found = difference if isinstance(difference, str) else f"its logits differ by up to {difference:.2g}"
            raise UsageError(f"the merged export in {merged_dir} is not the adapted model that trained ({found})")
        logger.info("The merged model in %s computes the adapted model (within %.1g)", merged_dir, difference)


# The subfolder of the output directory that --merge_adapters writes the merged model to.
MERGED_DIR = "merged"


def adapter_key(seed: int):
    """The key new adapters are drawn from: the run's seed's, whatever drew the base model's weights."""
    return jax.random.fold_in(jax.random.key(seed), 1)
