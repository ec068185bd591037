"""The tokenizer files every tool and tokenizer directory of this repository writes, readable beyond transformers 5:
by transformers 4 (which many serving and training stacks still pin), by `tokenizers` alone from tokenizer.json, and,
for the chat template, by the engines that render it themselves in Jinja2 or minijinja.

transformers 5 saves names only it knows: the list of extra special tokens as `extra_special_tokens` (a mapping of
names in transformers 4, which fails on a list) and the plain fast tokenizer as `TokenizersBackend` (transformers 4's
`PreTrainedTokenizerFast`). Both versions read the older names, so those are written. The chat template is written
without the `{% generation %}` markers, which only transformers parses (chat.exported_chat_template), into
chat_template.jinja and tokenizer_config.json, where transformers 5 and 4 and the engines look for it.
"""

import json
import os

from flax_lm.data.chat import exported_chat_template
from flax_lm.errors import UsageError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def portable_tokenizer_class(class_name: str) -> str:
    """The class name both transformers 4 and 5 load the fast tokenizer from: transformers 5's plain backend is
    transformers 4's PreTrainedTokenizerFast; a model's class is named by its fast variant, which transformers 5 maps
    back to its own."""
    if class_name == "TokenizersBackend":
        return "PreTrainedTokenizerFast"
    return class_name if class_name.endswith("Fast") else f"{class_name}Fast"


def check_chat_template(path: str | None):
    """Refuse a --chat_template_path whose template does not parse, before any work: it would be exported all the
    same, and fail only at its first use. Compiled as transformers compiles it for apply_chat_template (with its own
    {% generation %} tag), so that what passes here renders there."""
    if not path:
        return
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from flax_lm.models.huggingface import read_chat_template  # which imports this module

    try:
        _compile_jinja_template(read_chat_template(path))
    except jinja2.TemplateSyntaxError as error:
        raise UsageError(
            f"--chat_template_path {path}: the template does not parse (line {error.lineno}: {error.message}); fix "
            "it, or leave the flag out to keep the tokenizer's"
        ) from None


def save_tokenizer_files(tokenizer, directory: str) -> list[str]:
    """tokenizer.save_pretrained(directory), with tokenizer_config.json and the chat template in the form every reader
    takes (see the module's docstring); returns the names of the files written."""
    written = tokenizer.save_pretrained(directory)
    config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    with open(config_path, encoding="utf-8") as file:
        config = json.load(file)
    if "tokenizer_class" in config:
        config["tokenizer_class"] = portable_tokenizer_class(config["tokenizer_class"])
    extra_special_tokens = config.pop("extra_special_tokens", None)
    if isinstance(extra_special_tokens, dict) and extra_special_tokens:  # named ones, which both versions read
        config["extra_special_tokens"] = extra_special_tokens
    elif extra_special_tokens:
        config["additional_special_tokens"] = extra_special_tokens
    template = tokenizer.chat_template
    if isinstance(template, str):
        config["chat_template"] = exported_chat_template(template)
        with open(os.path.join(directory, CHAT_TEMPLATE_FILE), "w", encoding="utf-8") as file:
            file.write(config["chat_template"])
    with open(config_path, "w", encoding="utf-8") as file:
        file.write(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return sorted({os.path.basename(path) for path in written})
