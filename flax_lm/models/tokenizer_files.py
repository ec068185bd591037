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

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def portable_tokenizer_class(class_name: str) -> str:
    """The class name both transformers 4 and 5 load the fast tokenizer from: transformers 5's plain backend is
    transformers 4's PreTrainedTokenizerFast; a model's class is named by its fast variant, which transformers 5 maps
    back to its own."""
    if class_name == "TokenizersBackend":
        return "PreTrainedTokenizerFast"
    return class_name if class_name.endswith("Fast") else f"{class_name}Fast"


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
