"""The requests of generate_flax.py's server, read and checked: the OpenAI completions API's (prompts as texts or
token ids, several in one request, several choices of each, "echo", "logprobs", "max_tokens": 0, the penalties and
"logit_bias"), the chat completions API's and the script's own JSON API's. A request the
server cannot answer as asked is refused with one line (RequestError), before it reaches the decoding engine."""

import dataclasses
import json
import re

from starlette.requests import ClientDisconnect

from flax_lm.generation.sampling import Sampling

MAX_REQUEST_BYTES = 1 << 20
# A request nests a few levels (a list of prompts, stream_options); Python's JSON reader gives up near 1,000.
MAX_REQUEST_NESTING = 16
# What nginx answers a client that closed its connection before its request was read; the client never sees it.
CLIENT_LEFT = 499
SETTING_TYPES = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}
REQUEST_FIELDS = {"prompt", "prompts", *SETTING_TYPES}
REQUEST_EXAMPLE = '{"prompt": "Once", "max_new_tokens": 20, "temperature": 0.8, "top_k": 0, "top_p": 1, "seed": 0}'
# The completions API's fields this server reads; top_k is not OpenAI's, but vLLM's and llama.cpp's servers take it.
COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
    "user", "echo", "logprobs", "best_of", "presence_penalty", "frequency_penalty", "logit_bias",
}  # fmt: skip
# Fields of the completions API this server has no use for, accepted at the value that asks for nothing.
UNSUPPORTED_COMPLETION_FIELDS = {"suffix": (None, "")}
# The most of the likeliest tokens a completion request may ask to see at each position ("logprobs"), as OpenAI allows;
# and a chat request ("top_logprobs"). The scorer always finds the larger: one compiled program for both.
MAX_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds of a token's bias ("logit_bias"); a number as OpenAI's token ids and HTTP's lengths are written.
MAX_LOGIT_BIAS = 100
ASCII_DIGITS = re.compile(r"[0-9]+")
# The largest token id of any model: ids are int32 wherever they are read and decoded.
MAX_TOKEN_ID = 2**31 - 1


# The chat completions API's fields this server reads (max_tokens is the older name of max_completion_tokens), and
# those it has no use for, accepted at the value that asks for nothing.
CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stream", "stream_options", "n", "user", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "logit_bias",
}  # fmt: skip
UNSUPPORTED_CHAT_FIELDS = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class RequestError(Exception):
    """A request the server refuses, with one line that says why: 400 unless `status` says otherwise; `param` is
    the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Limits:
    """What requests may ask, and the settings of what they leave out (the command line's; but the OpenAI APIs'
    max_tokens, which is the room left in the model's positions, up to max_new_tokens_limit)."""

    defaults: Sampling
    max_new_tokens_limit: int
    batch_size: int


async def read_json(request):
    """The body of `request` as JSON, refusing more than MAX_REQUEST_BYTES (read no further), more than
    MAX_REQUEST_NESTING levels of lists and objects, or a string that is not text (a lone surrogate, which JSON's
    escapes can write and UTF-8 cannot encode)."""
    too_long = f"the body is longer than {MAX_REQUEST_BYTES} bytes, the most the server takes"
    length = request.headers.get("content-length", "")
    if ASCII_DIGITS.fullmatch(length) and (len(length) > 20 or int(length) > MAX_REQUEST_BYTES):
        raise RequestError(too_long)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_REQUEST_BYTES:
                raise RequestError(too_long)
    except ClientDisconnect:
        raise RequestError("the client left before sending the whole body", status=CLIENT_LEFT) from None
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not JSON: {error}") from None
    except RecursionError:  # nested deeper than Python's reader follows
        raise RequestError(f"the body nests lists or objects deeper than {MAX_REQUEST_NESTING} levels") from None
    check_json_value(value)
    return value


def check_json_value(value):
    """Refuse a JSON value that nests deeper than MAX_REQUEST_NESTING, or holds a string that is not text. Walked
    without recursion: the value may nest as deep as Python's reader allows."""
    unchecked = [(value, 1)]
    while unchecked:
        item, depth = unchecked.pop()
        if isinstance(item, (list, dict)) and depth > MAX_REQUEST_NESTING:
            raise RequestError(f"the body nests lists or objects deeper than {MAX_REQUEST_NESTING} levels")
        if isinstance(item, dict):
            unchecked.extend((part, depth + 1) for pair in item.items() for part in pair)
        elif isinstance(item, list):
            unchecked.extend((part, depth + 1) for part in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                surrogate = item[error.start]
                raise RequestError(
                    f"the body holds a lone surrogate, \\u{ord(surrogate):04x} (character {error.start + 1} of "
                    f"{item[:40]!r}), which is not text: send text as UTF-8, or surrogates in pairs"
                ) from None


def number(request: dict, name: str, kind: type, default):
    """The field `name` of `request`, an int or float as `kind` says; `default` where it is left out or null."""
    value = request.get(name)
    if value is None:
        return default
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise RequestError(f'"{name}" must be {"an integer" if kind is int else "a number"}, not {value!r}', name)
    try:
        return kind(value)
    except OverflowError:  # an integer too large for a float
        raise RequestError(f'"{name}" is out of range', name) from None


def is_token_ids(value) -> bool:
    """Whether `value` is a prompt given as token ids: a non-empty list of integers."""
    return isinstance(value, list) and bool(value) and all(type(item) is int for item in value)


def checked_prompts(prompts, limits: Limits, problem: str, param: str, token_ids_too: bool = False) -> list:
    """`prompts` if it is a non-empty list of at most batch_size strings (or, `token_ids_too`, lists of token ids);
    else `problem` refuses the request."""

    def is_prompt(prompt) -> bool:
        return isinstance(prompt, str) or (token_ids_too and is_token_ids(prompt))

    if not isinstance(prompts, list) or not prompts or not all(map(is_prompt, prompts)):
        raise RequestError(problem, param)
    if len(prompts) > limits.batch_size:
        raise RequestError(
            f"{len(prompts)} prompts in one request; the server takes at most {limits.batch_size}", param
        )
    return prompts


def checked_sampling(sampling: Sampling, limits: Limits, max_new_tokens_name: str) -> Sampling:
    if problem := sampling.problem(""):
        raise RequestError(problem.replace("max_new_tokens", max_new_tokens_name))
    if sampling.max_new_tokens > limits.max_new_tokens_limit:
        raise RequestError(
            f"{max_new_tokens_name} {sampling.max_new_tokens} exceeds this server's limit of "
            f"{limits.max_new_tokens_limit}",
            max_new_tokens_name,
        )
    return sampling


def parse_generate_request(request, limits: Limits) -> tuple[list[str], Sampling]:
    """The prompts and settings of a request to POST /, the command line's settings filling in what it leaves
    out."""
    if not isinstance(request, dict):
        raise RequestError(f"the body must be a JSON object such as {REQUEST_EXAMPLE}")
    if unknown := sorted(set(request) - REQUEST_FIELDS):
        raise RequestError(f"unknown field {unknown[0]!r}; the fields are {', '.join(sorted(REQUEST_FIELDS))}")
    if ("prompt" in request) == ("prompts" in request):
        raise RequestError('give either "prompt" (a string) or "prompts" (a list of strings)')
    prompts = [request["prompt"]] if "prompt" in request else request["prompts"]
    problem = '"prompt" must be a string and "prompts" a non-empty list of strings'
    prompts = checked_prompts(prompts, limits, problem, "prompts")
    settings = {
        name: number(request, name, kind, getattr(limits.defaults, name)) for name, kind in SETTING_TYPES.items()
    }
    return prompts, checked_sampling(Sampling(**settings), limits, "max_new_tokens")


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]  # texts, or token ids
    # max_new_tokens 0: nothing is written, the prompts are only echoed or scored; None: the room left in the model's
    # positions after each prompt, up to the server's limit
    sampling: Sampling
    max_tokens_given: bool
    stop: list[str]
    stream: bool
    include_usage: bool
    echo: bool  # each choice's text begins with its prompt
    logprobs: int | None  # show the log-probability of each token and of this many of the most likely there
    n: int  # choices returned per prompt
    best_of: int  # choices written per prompt, of which the n most likely per token are returned


def openai_sampling(request: dict, limits: Limits, max_tokens_name: str) -> Sampling:
    """The Sampling an OpenAI request asks for (its max_new_tokens the server's limit where it gives none), checked
    as far as it can be without its prompts."""
    defaults = limits.defaults
    max_tokens = number(request, max_tokens_name, int, None)
    sampling = Sampling(
        max_new_tokens=limits.max_new_tokens_limit if max_tokens is None else max_tokens,
        temperature=number(request, "temperature", float, defaults.temperature),
        top_k=number(request, "top_k", int, defaults.top_k),
        top_p=number(request, "top_p", float, defaults.top_p),
        seed=number(request, "seed", int, defaults.seed),
        presence_penalty=number(request, "presence_penalty", float, 0.0),
        frequency_penalty=number(request, "frequency_penalty", float, 0.0),
        logit_bias=logit_bias(request),
    )
    # max_tokens 0 writes nothing (a completion's prompt echoed or scored); the rest is checked all the same
    checked_sampling(
        dataclasses.replace(sampling, max_new_tokens=max(sampling.max_new_tokens, 1)), limits, max_tokens_name
    )
    return sampling


def logit_bias(request: dict) -> tuple[tuple[int, float], ...]:
    """The "logit_bias" of an OpenAI request: token ids (as strings, JSON's keys, of the ASCII digits alone, as
    OpenAI reads them: str.isdigit would take "²", which int() refuses, and "٣" for 3) to a bias from -100 to 100.
    The ids are checked against the model's vocabulary where the request is answered; one past any vocabulary (token
    ids are int32) is refused here, before int() reads thousands of digits."""
    biases = request.get("logit_bias") or {}
    problem = f'"logit_bias" must map token ids to numbers from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}'
    if not isinstance(biases, dict):
        raise RequestError(problem, "logit_bias")
    pairs = []
    for token_id, bias in biases.items():
        is_number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not (ASCII_DIGITS.fullmatch(token_id) and is_number and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            shown = token_id if len(token_id) <= 20 else f"{token_id[:20]}... ({len(token_id)} characters)"
            raise RequestError(f"{problem}, not {shown!r}: {bias!r}", "logit_bias")
        if len(token_id.lstrip("0")) > len(str(MAX_TOKEN_ID)) or int(token_id) > MAX_TOKEN_ID:
            shown = token_id if len(token_id) <= 20 else f"{token_id[:20]}... ({len(token_id)} digits)"
            raise RequestError(f'"logit_bias" names the token id {shown}, past any vocabulary', "logit_bias")
        pairs.append((int(token_id), float(bias)))
    return tuple(pairs)


def choices_per_prompt(request: dict, prompts: int, limits: Limits, best_of_too: bool) -> tuple[int, int]:
    """(n, best_of) of an OpenAI request; refused where best_of is below n, or where the choices of all its prompts
    would not fit in one batch."""
    n = number(request, "n", int, 1)
    best_of = number(request, "best_of", int, n) if best_of_too else n
    if n < 1:
        raise RequestError('"n" must be at least 1', "n")
    if best_of < n:
        raise RequestError(
            f'"best_of" {best_of} is below "n" {n}: it writes best_of choices and returns the n best', "best_of"
        )
    if prompts * best_of > limits.batch_size:
        name = "best_of" if best_of > n else "n"
        raise RequestError(
            f'"{name}" {best_of} times {prompts} prompts is {prompts * best_of} choices; the server decodes at most '
            f"{limits.batch_size} together",
            name,
        )
    return n, best_of


def parse_completion_request(request, model_id: str, limits: Limits) -> CompletionRequest:
    """A request to POST /v1/completions, as OpenAI defines it; the command line's settings fill in what it leaves
    out (but max_tokens: the room left after each prompt, up to the server's limit)."""
    example = '{"model": "...", "prompt": "Once"}'
    check_openai_fields(request, model_id, COMPLETION_FIELDS, UNSUPPORTED_COMPLETION_FIELDS, example)
    if "prompt" not in request:
        raise RequestError('"prompt" is missing: give a string or a list of strings', "prompt")
    prompt = request["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or is_token_ids(prompt) else prompt
    problem = '"prompt" must be a string, a list of token ids, or a non-empty list of strings or of lists of token ids'
    prompts = checked_prompts(prompts, limits, problem, "prompt", token_ids_too=True)
    sampling = openai_sampling(request, limits, "max_tokens")
    if sampling.max_new_tokens < 0:
        raise RequestError('"max_tokens" must be 0 (the prompt alone, echoed or scored) or more', "max_tokens")
    n, best_of = choices_per_prompt(request, len(prompts), limits, best_of_too=True)
    echo = request.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(f'"echo" must be true or false, not {echo!r}', "echo")
    logprobs = number(request, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(
            f'"logprobs" must be from 0 to {MAX_LOGPROBS}: how many of the most likely tokens to show at each token',
            "logprobs",
        )
    stop = stop_strings(request)
    stream, include_usage = stream_settings(request)
    if stream and (echo or logprobs is not None or sampling.max_new_tokens == 0):
        raise RequestError('"echo", "logprobs" and "max_tokens": 0 are not supported with "stream": true', "stream")
    if stream and best_of > n:
        raise RequestError('"best_of" above "n" with "stream": true: the best are known only at the end', "best_of")
    max_tokens_given = request.get("max_tokens") is not None
    return CompletionRequest(
        prompts, sampling, max_tokens_given, stop, stream, include_usage, echo, logprobs, n, best_of
    )


def check_openai_fields(request, model_id: str, fields: set, unsupported: dict, example: str):
    """Refuse a request to an OpenAI API that is not an object, has a field the API does not define (`fields`: those
    read; `unsupported`: those accepted only at the values that ask for nothing) or names another model."""
    if not isinstance(request, dict):
        raise RequestError(f"the body must be a JSON object such as {example}")
    if unknown := sorted(set(request) - fields - set(unsupported)):
        raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
    for name, accepted in unsupported.items():
        if name in request and request[name] not in accepted:
            raise RequestError(f'"{name}" is not supported by this server; leave it out', name)
    if "model" not in request:
        raise RequestError(f'"model" is missing; this server serves {model_id!r}', "model")
    if request["model"] != model_id:
        raise RequestError(
            f"the model {request['model']!r} is not served here; this server serves {model_id!r}", "model", 404
        )


def stop_strings(request: dict) -> list[str]:
    """The "stop" field of a request to the OpenAI APIs: up to 4 strings."""
    stop = request.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(text, str) and text for text in stop):
        raise RequestError('"stop" must be a non-empty string or a list of at most 4 of them', "stop")
    return stop


def stream_settings(request: dict) -> tuple[bool, bool]:
    """Whether a request to the OpenAI APIs asks for server-sent events, and for a last one of usage."""
    stream = request.get("stream") or False
    options = request.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise RequestError(f'"stream" must be true or false, not {stream!r}', "stream")
    if not (
        isinstance(options, dict)
        and set(options) <= {"include_usage"}
        and isinstance(include_usage := options.get("include_usage", False), bool)
        and (stream or not options)
    ):
        raise RequestError('"stream_options" may only be {"include_usage": true} (or false), with "stream": true')
    return stream, include_usage


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: list
    sampling: Sampling
    max_tokens_name: str  # the field the request gave, max_completion_tokens or max_tokens
    max_tokens_given: bool  # else: the room left after the conversation, up to the server's limit
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int
    top_logprobs: int | None  # with "logprobs": true, the most likely tokens to show at each (None: no logprobs)


def parse_chat_request(request, model_id: str, limits: Limits) -> ChatRequest:
    """A request to POST /v1/chat/completions, as OpenAI defines it: a conversation ("messages"), answered with the
    assistant's next turn; the command line's settings fill in what it leaves out (max_completion_tokens, or
    max_tokens: the room left after the conversation, up to the server's limit). The conversation is checked when it
    is rendered."""
    example = '{"model": "...", "messages": [{"role": "user", "content": "Hi"}]}'
    check_openai_fields(request, model_id, CHAT_FIELDS, UNSUPPORTED_CHAT_FIELDS, example)
    if "messages" not in request:
        raise RequestError('"messages" is missing: give the conversation, a list of messages', "messages")
    max_tokens_name = "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
    sampling = openai_sampling(request, limits, max_tokens_name)
    if sampling.max_new_tokens < 1:
        raise RequestError(f'"{max_tokens_name}" must be at least 1', max_tokens_name)
    n, _ = choices_per_prompt(request, 1, limits, best_of_too=False)
    stop = stop_strings(request)
    stream, include_usage = stream_settings(request)
    logprobs = request.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError(f'"logprobs" must be true or false, not {logprobs!r}', "logprobs")
    top_logprobs = number(request, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise RequestError('"top_logprobs" needs "logprobs": true', "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f'"top_logprobs" must be from 0 to {MAX_TOP_LOGPROBS}', "top_logprobs")
    if logprobs and stream:
        raise RequestError('"logprobs" is not supported with "stream": true', "logprobs")
    top_logprobs = (top_logprobs or 0) if logprobs else None
    max_tokens_given = request.get(max_tokens_name) is not None
    return ChatRequest(
        request["messages"], sampling, max_tokens_name, max_tokens_given, stop, stream, include_usage, n, top_logprobs
    )
