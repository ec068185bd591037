"""What a version of transformers reads from model directories: run inside the tests' environment and, as a script,
inside one with transformers 4, so that the same reading is compared across versions. It imports nothing of this
repository.

    python read_with_transformers.py < request.json > readings.json

The request: {"directories": [...], "texts": [...], "conversation": [...], "token_ids": [...]}, and optionally
{"attn_implementation": {directory: name}} for a model to be read with an attention other than the default. For each
directory,
its tokenizer's class, special tokens and ids of each text (and of each pair of texts), the chat prompt its template
renders (where it has one), and the model's logits on the token ids.
"""

import json
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoTokenizer


def read_directory(directory: str, request: dict) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = request["texts"]
    reading = {
        "transformers": transformers.__version__,
        "tokenizer_class": type(tokenizer).__name__,
        "special_tokens": sorted(tokenizer.all_special_tokens),
        "eos_token": tokenizer.eos_token,
        "model_max_length": tokenizer.model_max_length,
        "ids": [tokenizer(text)["input_ids"] for text in texts],
        "ids_without_special_tokens": [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts],
        "pair_ids": tokenizer(texts[0], texts[1])["input_ids"],
        "decoded": [tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts],
        "chat_prompt": None,
    }
    if tokenizer.chat_template is not None:
        reading["chat_prompt"] = tokenizer.apply_chat_template(
            request["conversation"], tokenize=False, add_generation_prompt=True
        )
    config = AutoConfig.from_pretrained(directory)
    if config.is_encoder_decoder:
        model_class = AutoModelForSeq2SeqLM
    else:
        model_class = AutoModelForMaskedLM if config.model_type == "roberta" else AutoModelForCausalLM
    attention = request.get("attn_implementation", {}).get(directory)
    model, loading_info = model_class.from_pretrained(
        directory, output_loading_info=True, **({"attn_implementation": attention} if attention else {})
    )
    reading["model_class"] = type(model).__name__
    reading["loading_problems"] = {kind: sorted(names) for kind, names in loading_info.items() if names}
    with torch.no_grad():
        ids = torch.tensor([request["token_ids"]])  # an encoder-decoder's decoder reads them too
        logits = model.eval()(ids, **({"decoder_input_ids": ids} if config.is_encoder_decoder else {})).logits
    reading["logits"] = logits[0].tolist()
    return reading


def read_directories(request: dict) -> dict:
    return {directory: read_directory(directory, request) for directory in request["directories"]}


if __name__ == "__main__":
    json.dump(read_directories(json.load(sys.stdin)), sys.stdout)
