"""Conversations as tokens: the chat template a tokenizer carries (a Jinja template that transformers'
apply_chat_template renders), the default one train_tokenizer.py writes, the checks a conversation must pass, and
the tokens that end a turn, where generation stops.

The default template is ChatML's layout, `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` for each message, after the
tokenizer's beginning-of-text token (GPT-2's <|endoftext|>, Llama's <|begin_of_text|>): two special tokens for any
number of roles, the layout of Qwen's and SmolLM's chat models, which inference servers (vLLM, llama.cpp) recognise.
The assistant's content and its <|im_end|> are inside `{% generation %}` markers, so that
apply_chat_template(..., return_assistant_tokens_mask=True) says which tokens the assistant wrote: those the loss
covers, and <|im_end|> among them, so that the model learns to end its turn. Those markers only transformers parses:
the files written for other tools carry the template without them (exported_chat_template), and training from such
files puts them back (training_chat_template).
"""

import re

import jinja2

TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_SPECIAL_TOKENS = [TURN_START, TURN_END]

# The beginning-of-text token first, as the tokenizers of both model types frame a document (GPT-2's is its
# <|endoftext|>): a conversation starts as every document the model was pretrained on does.
DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Either marker, with its whitespace control: {%- generation -%}, {% endgeneration %}, ...
GENERATION_TAG = re.compile(r"\{%(?P<before>-?)\s*(?P<end>end)?generation\s*(?P<after>-?)%\}")

# A conversation as the messages say it should be: each message's role and content are checked, its other fields (a
# name, tool calls) go to the template as they are.
MESSAGE_EXAMPLE = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's (default) chat template, or None where it has none."""
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # transformers' answer for a tokenizer without a template
        return None


def marks_assistant_tokens(template: str) -> bool:
    """Whether the template marks the assistant's tokens with {% generation %}, which return_assistant_tokens_mask
    needs (without them transformers returns a mask of zeros)."""
    return bool(GENERATION_MARKER.search(template))


def exported_chat_template(template: str) -> str:
    """The template as a model's export carries it, for the engines that render chat templates in Jinja2 or minijinja
    themselves, which refuse the {% generation %} tag transformers added for training: each marker becomes an `if`
    that always holds, with the same whitespace control, so every engine renders the text training rendered."""

    def unmarked(tag):
        statement = "endif" if tag["end"] else "if true"
        return f"{{%{tag['before']} {statement} {tag['after']}%}}"

    return GENERATION_TAG.sub(unmarked, template)


def training_chat_template(template: str) -> str:
    """The template to train with: the default one with its markers where an export carries it without them (a model
    exported here and trained on again), else the template as it is."""
    return DEFAULT_CHAT_TEMPLATE if template == exported_chat_template(DEFAULT_CHAT_TEMPLATE) else template


def conversation_problem(messages) -> str | None:
    """What is wrong with a conversation (a list of messages, each with a string role and string content), in words
    that follow "the conversation ...", or None."""
    if not isinstance(messages, list) or not messages:
        return f"is not a non-empty list of messages such as {MESSAGE_EXAMPLE}"
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return f"has a message {number} that is not an object with a role and content"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"has no role in message {number} (its 'role' is missing, empty or not a string)"
        if not isinstance(content, str):
            return f"has no text in message {number} (its 'content' is missing or not a string)"
    return None


def fields_not_rendered(tokenizer, messages: list[dict]) -> str | None:
    """The first field of a message beside its role and content ('tool_calls', 'tool_call_id', 'name', ...) that
    the chat template leaves out of the rendered text, in words ("message 2 has 'tool_calls'"); None where every such
    field changes the text, or there is none. Read as a table, messages of other rows give such a field as None: that
    is no field."""
    for number, message in enumerate(messages, 1):
        for field in sorted(message):
            if field in ("role", "content") or message[field] is None:
                continue
            without = [*messages[: number - 1], {**message, field: None}, *messages[number:]]
            try:
                same = tokenizer.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
                    without, tokenize=False
                )
            except jinja2.TemplateError:
                continue  # render_conversation says what the template refuses
            if same:
                return f"message {number} has '{field}'"
    return None


def render_conversation(tokenizer, messages: list[dict], add_generation_prompt: bool, assistant_mask: bool) -> dict:
    """apply_chat_template's token ids of the conversation ("input_ids") and, with `assistant_mask`, which of them the
    assistant wrote ("assistant_masks"): what transformers gives the same conversation. ValueError where the template
    refuses the conversation (raise_exception in it, or a Jinja error)."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_mask,
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"cannot be rendered: the chat template refuses it ({error})") from None


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template ends an assistant's turn with, where a reply ends (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>): the special token right after the assistant's content in a rendered conversation; None where the
    tokenizer has no template or the template puts no special token there."""
    if chat_template_of(tokenizer) is None:
        return None
    content = "Reply."
    conversation = [{"role": "user", "content": "Ask."}, {"role": "assistant", "content": content}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except jinja2.TemplateError:
        return None
    if content not in text:
        return None
    after = tokenizer(text[text.rindex(content) + len(content) :], add_special_tokens=False)["input_ids"]
    special_ids = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    return after[0] if after and after[0] in special_ids else None


def stop_token_ids(tokenizer, eos_token_id: int | None) -> list[int]:
    """The tokens generation stops at: the end-of-text token and, where the chat template has one, the end of a turn
    (what an export's generation_config.json lists as eos_token_id, so that transformers stops there too)."""
    ids = [eos_token_id, end_of_turn_id(tokenizer)]
    return list(dict.fromkeys(token_id for token_id in ids if token_id is not None))


def conversation_prompt_ids(tokenizer, messages) -> list[int]:
    """The token ids that ask the model for the assistant's next turn after `messages`, as apply_chat_template with
    add_generation_prompt gives them. ValueError, in words that follow "the conversation", for a tokenizer without a
    chat template or a conversation it cannot render."""
    if chat_template_of(tokenizer) is None:
        raise ValueError(
            "cannot be rendered: the model's tokenizer has no chat template (train_tokenizer.py --chat_template "
            "writes one); prompt it with plain text instead"
        )
    if problem := conversation_problem(messages):
        raise ValueError(problem)
    return render_conversation(tokenizer, messages, add_generation_prompt=True, assistant_mask=False)["input_ids"]
