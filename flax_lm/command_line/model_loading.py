"""What loading a model takes (flax_lm.models.huggingface.ModelLoading), filled from the scripts' flags (their
ModelArguments): the one place that reads them for flax_lm.models."""

from dataclasses import fields

from flax_lm.models.huggingface import ModelLoading


def model_loading(model_args) -> ModelLoading:
    """The flags of ModelLoading's fields, which the scripts' ModelArguments name alike (--model_name_or_path,
    --cache_dir ...); a field whose flag the script lacks (generate_flax.py has no --config_name) keeps its default."""
    return ModelLoading(
        **{field.name: getattr(model_args, field.name, field.default) for field in fields(ModelLoading)}
    )
