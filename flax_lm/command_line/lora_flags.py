"""The flags of low-rank adapters (LoRA: flax_lm/training/lora.py), which a script that trains adapters takes beside
its own, their checks, and the adapted model and Adapters they make of a run's model."""

import logging
from dataclasses import dataclass, field

import jax.numpy as jnp

from flax_lm.errors import UsageError
from flax_lm.training.lora import (
    Adapters,
    LoraSettings,
    adapted_model,
    adapter_settings,
    adapter_targets,
    check_lora_settings,
)
from flax_lm.training.train_state import abstract_model_params

logger = logging.getLogger(__name__)


@dataclass
class LoraArguments:
    lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "Train low-rank adapters of this rank (LoRA; 8 or 16 are usual) on the layers of "
            "--lora_target_modules, the weights of --model_name_or_path frozen; the output directory is a PEFT "
            "adapter (docs/adapting.md). TRL's --lora_r."
        },
    )
    lora_alpha: float = field(
        default=16.0, metadata={"help": "The adapters' product is scaled by lora_alpha / lora_rank (PEFT's)."}
    )
    lora_dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the adapters' input, in training (PEFT's lora_dropout)."}
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "The layers adapted, by PEFT's module names: q_proj k_proj v_proj o_proj gate_proj up_proj "
            "down_proj (Llama and the families like it), c_attn c_proj c_fc (GPT-2), query key value dense (RoBERTa). "
            "Default: PEFT's (q_proj v_proj; GPT-2's c_attn; RoBERTa's query value).",
            "nargs": "+",
        },
    )
    lora_adapter: str | None = field(
        default=None,
        metadata={
            "help": "A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to continue "
            "training, on --model_name_or_path; its rank, alpha, dropout and target modules are the run's."
        },
    )
    merge_adapters: bool = field(
        default=False,
        metadata={
            "help": "Also export the model with the adapters merged into its weights, an ordinary model directory, "
            "in OUTPUT_DIR/merged."
        },
    )

    def lora_settings(self) -> LoraSettings | None:
        """The adapters' settings (those of --lora_adapter where it names one); None without adapters."""
        if self.lora_rank is None and self.lora_adapter is None:
            return None
        targets = tuple(sorted(set(self.lora_target_modules))) if self.lora_target_modules else None
        settings = LoraSettings(
            self.lora_rank or 0, self.lora_alpha, self.lora_dropout, targets, self.lora_adapter, self.merge_adapters
        )
        return adapter_settings(settings) if self.lora_adapter else settings


def check_lora_flags(model_args, arguments: LoraArguments):
    """Refuse, each in one line, adapter flags that cannot apply. `arguments`: the script's training arguments."""
    settings = arguments.lora_settings()
    if settings is None:
        if arguments.lora_target_modules or arguments.merge_adapters:
            raise UsageError("--lora_target_modules and --merge_adapters apply to adapters: add --lora_rank")
        return
    if arguments.lora_adapter and arguments.lora_rank is not None:
        raise UsageError("--lora_adapter's adapter_config.json sets the rank: leave --lora_rank out")
    check_lora_settings(settings)
    if model_args.model_file:
        raise UsageError(
            "--lora_rank: adapters train on the layers of a stock model, which PEFT loads; --model_file's model is "
            "of your own: add the adapters to it there, or leave --model_file out"
        )
    if not model_args.model_name_or_path:
        raise UsageError("--lora_rank: adapters train on a trained model's weights; name it with --model_name_or_path")
    if getattr(arguments, "fp8", False):
        raise UsageError("--fp8 does not multiply adapters in FP8; leave --fp8 out for a run with adapters")


def adapted(
    model, model_code, model_args, arguments: LoraArguments, row_length: int, seed: int, task_type="CAUSAL_LM"
) -> tuple:
    """(the model a run trains, its Adapters): `model` itself and None without adapters; else adapted_model's of it,
    its adapters on the layers --lora_target_modules names. `task_type`: PEFT's of the model (None: its PeftModel
    class, as for a masked language model, of which PEFT has no task type)."""
    settings = arguments.lora_settings()
    if settings is None:
        return model, None
    abstract_params = abstract_model_params(model, jnp.zeros((1, row_length), jnp.int32))
    targets = adapter_targets(abstract_params, model_code.module, settings.target_modules)
    base_model, read_base = model_args.model_name_or_path, model_args.pretrained_weights()
    adapters = Adapters(settings, tuple(targets), base_model, read_base, task_type)
    return adapted_model(model, targets, settings, seed), adapters
