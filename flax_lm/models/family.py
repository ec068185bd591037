"""What a model family registers with the tools: the FAMILY that its package's __init__.py defines (see
flax_lm/models/README.md). Plain data, so that create_config.py and train_tokenizer.py read every family without
importing JAX; the family's model itself is its model.py."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenizerConventions:
    """How train_tokenizer.py makes a tokenizer for one --model_type of the family."""

    # The special tokens by role (bos_token, eos_token, unk_token, pad_token, mask_token), in the order of their ids:
    # the distinct tokens get ids 0, 1, ... in this order.
    special_tokens: Mapping[str, str]
    # The default --model_max_length: the longest input the family's presets take, in tokens.
    model_max_length: int
    # The transformers class the tokenizer is saved as, which AutoTokenizer loads it as: GPT2Tokenizer,
    # PreTrainedTokenizerFast (Llama 3's tokenizers), RobertaTokenizer (<s> A </s> around each text) or T5Tokenizer.
    tokenizer_class: str = "GPT2Tokenizer"
    # Whether the beginning-of-text token goes before every text encoded (Llama's tokenizers).
    bos_before_each_text: bool = False
    # The roles the model tells apart by the token's id alone, which need a token of their own.
    distinct_roles: tuple[str, ...] = ("mask_token",)
    # Whether --chat_template is offered: a causal LM that converses.
    converses: bool = True
    # T5's sentinel tokens <extra_id_0>, <extra_id_1>, ..., at the end of the vocabulary (<extra_id_0> last), which
    # span corruption puts in place of the spans it drops. A tokenizer with them is T5's: a unigram model
    # (flax_lm/models/t5/tokenizer.py) saved as T5Tokenizer, which ends every text with its end-of-text token.
    sentinel_tokens: int = 0


@dataclass(frozen=True)
class ModelFamily:
    """A family of models one module computes: flax_lm/models/NAME/model.py."""

    name: str  # the folder, flax_lm/models/NAME/
    title: str  # the family's name in messages: "RoBERTa"
    # model_type -> the transformers config class (its name) of each config.model_type that model.py computes: the
    # keys of model.py's HF_ARCHITECTURES, which names the transformers model class of each.
    config_classes: Mapping[str, str]
    # create_config.py --preset NAME -> (model_type, the config values), in the order --help lists them.
    presets: Mapping[str, tuple[str, Mapping]] = field(default_factory=dict)
    # train_tokenizer.py --model_type NAME -> its tokenizer conventions.
    tokenizers: Mapping[str, TokenizerConventions] = field(default_factory=dict)
    # The model types whose attention heads have the config's head_dim as their width, apart from hidden_size over
    # the heads (Qwen 3, Gemma): for the others, the heads must divide hidden_size.
    head_dim_apart: tuple[str, ...] = ()
    # Whether the positions are numbered from pad_token_id + 1 (RoBERTa), which leaves that many positions unused
    # and needs a padding token.
    positions_after_pad_id: bool = False
    # The parameters of the transformers model of a config, for create_config.py to print; None: those of the tensors
    # of model.py's hf_architecture_shapes(config), which GPT-2 and RoBERTa count otherwise (block options, an untied
    # masked-LM head).
    count_parameters: Callable[[Any], int] | None = None
    # Whether the model is an encoder-decoder (T5): neither a causal LM (run_clm_flax.py) nor a masked one
    # (run_mlm_flax.py), it is trained by run_t5_mlm_flax.py and decoded by flax_lm/generation/seq2seq.py.
    encoder_decoder: bool = False

    @property
    def module_name(self) -> str:
        """The model module, which `--model_file` copies."""
        return f"flax_lm.models.{self.name}.model"
