"""generate_flax.py's HTTP server: the OpenAI completions API (POST /v1/completions, streamed as server-sent
events on request; GET /v1/models), the script's own JSON API (POST /), GET /health and Prometheus metrics
(GET /metrics), in front of flax_lm.batching's engine.

A completion request may give its prompts as texts or token ids, several in one request, and ask for the prompt back
("echo") and the log-probabilities of the tokens ("logprobs", from flax_lm.scoring), with "max_tokens": 0 for the
prompt alone: what lm-evaluation-harness's local-completions backend asks to score a task.

The HTTP side is asynchronous (Starlette on uvicorn): a slow client holds only its own connection, and requests
wait for the decoding thread without holding a thread each. Up to --max_queued_requests wait for a batch; more
are answered 503 with Retry-After. SIGTERM or SIGINT stops the server accepting connections; the requests it has
are answered, then the process logs one line and exits 0.
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import threading
import time
import uuid

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flax_lm.batching import BatchingEngine, Completion, Failed, RowFinished, TextPiece
from flax_lm.errors import UsageError
from flax_lm.sampling import Sampling, shape_bucket
from flax_lm.scoring import SequenceScores

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
# A request nests a few levels (a list of prompts, stream_options); Python's JSON reader gives up near 1,000.
MAX_REQUEST_NESTING = 16
# What nginx answers a client that closed its connection before its request was read; the client never sees it.
CLIENT_LEFT = 499
# Connections the operating system holds for the server before it accepts them (uvicorn's default).
LISTEN_BACKLOG = 2048
SETTING_TYPES = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}
REQUEST_FIELDS = {"prompt", "prompts", *SETTING_TYPES}
REQUEST_EXAMPLE = '{"prompt": "Once", "max_new_tokens": 20, "temperature": 0.8, "top_k": 0, "top_p": 1, "seed": 0}'
# The completions API's fields this server reads; top_k is not OpenAI's, but vLLM's and llama.cpp's servers take it.
COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
    "user", "echo", "logprobs",
}  # fmt: skip
# Fields of the completions API this server has no use for, accepted at the value that asks for nothing.
UNSUPPORTED_COMPLETION_FIELDS = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's
# The most of the likeliest tokens a completion request may ask to see at each position ("logprobs"), as OpenAI allows.
MAX_LOGPROBS = 5


class RequestError(Exception):
    """A request the server refuses, with one line that says why: 400 unless `status` says otherwise; `param` is
    the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Overloaded(Exception):
    """The queue of requests is full: answered 503, with Retry-After."""

    def __init__(self, retry_after: int, max_queued_requests: int):
        super().__init__(f"the server is busy ({max_queued_requests} requests wait); retry in {retry_after} s")
        self.retry_after = retry_after


# ----------------------------------------------------------------------------------------------------
# Requests: reading and checking them
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Limits:
    """What requests may ask, and the settings of what they leave out (the command line's)."""

    defaults: Sampling
    max_new_tokens_limit: int
    batch_size: int


async def read_json(request):
    """The body of `request` as JSON, refusing more than MAX_REQUEST_BYTES (read no further), more than
    MAX_REQUEST_NESTING levels of lists and objects, or a string that is not text (a lone surrogate, which JSON's
    escapes can write and UTF-8 cannot encode)."""
    too_long = f"the body is longer than {MAX_REQUEST_BYTES} bytes, the most the server takes"
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_REQUEST_BYTES:
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
    sampling: Sampling  # max_new_tokens 0: nothing is written, the prompts are only echoed or scored
    stop: list[str]
    stream: bool
    include_usage: bool
    echo: bool  # each choice's text begins with its prompt
    logprobs: int | None  # show the log-probability of each token and of this many of the most likely there


def parse_completion_request(request, model_id: str, limits: Limits) -> CompletionRequest:
    """A request to POST /v1/completions, as OpenAI defines it; the command line's settings fill in what it leaves
    out (max_tokens from --max_new_tokens)."""
    if not isinstance(request, dict):
        raise RequestError('the body must be a JSON object such as {"model": "...", "prompt": "Once"}')
    if unknown := sorted(set(request) - COMPLETION_FIELDS - set(UNSUPPORTED_COMPLETION_FIELDS)):
        raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
    for name, accepted in UNSUPPORTED_COMPLETION_FIELDS.items():
        if name in request and request[name] not in accepted:
            raise RequestError(f'"{name}" is not supported by this server; leave it out', name)
    if "model" not in request:
        raise RequestError(f'"model" is missing; this server serves {model_id!r}', "model")
    if request["model"] != model_id:
        raise RequestError(
            f"the model {request['model']!r} is not served here; this server serves {model_id!r}", "model", 404
        )
    if "prompt" not in request:
        raise RequestError('"prompt" is missing: give a string or a list of strings', "prompt")
    prompt = request["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or is_token_ids(prompt) else prompt
    problem = '"prompt" must be a string, a list of token ids, or a non-empty list of strings or of lists of token ids'
    prompts = checked_prompts(prompts, limits, problem, "prompt", token_ids_too=True)
    if number(request, "n", int, 1) != 1:
        raise RequestError('"n" must be 1: this server writes one completion per prompt', "n")
    defaults = limits.defaults
    sampling = Sampling(
        max_new_tokens=number(request, "max_tokens", int, defaults.max_new_tokens),
        temperature=number(request, "temperature", float, defaults.temperature),
        top_k=number(request, "top_k", int, defaults.top_k),
        top_p=number(request, "top_p", float, defaults.top_p),
        seed=number(request, "seed", int, defaults.seed),
    )
    # max_tokens 0 writes nothing: the prompts are only echoed or scored. The other settings are checked all the same.
    if sampling.max_new_tokens < 0:
        raise RequestError('"max_tokens" must be 0 (the prompt alone, echoed or scored) or more', "max_tokens")
    checked_sampling(
        dataclasses.replace(sampling, max_new_tokens=max(sampling.max_new_tokens, 1)), limits, "max_tokens"
    )
    echo = request.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(f'"echo" must be true or false, not {echo!r}', "echo")
    logprobs = number(request, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(
            f'"logprobs" must be from 0 to {MAX_LOGPROBS}: how many of the most likely tokens to show at each token',
            "logprobs",
        )
    stop = request.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(text, str) and text for text in stop):
        raise RequestError('"stop" must be a non-empty string or a list of at most 4 of them', "stop")
    stream = request.get("stream") or False
    options = request.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise RequestError(f'"stream" must be true or false, not {stream!r}', "stream")
    if stream and (echo or logprobs is not None or sampling.max_new_tokens == 0):
        raise RequestError('"echo", "logprobs" and "max_tokens": 0 are not supported with "stream": true', "stream")
    if not (
        isinstance(options, dict)
        and set(options) <= {"include_usage"}
        and isinstance(include_usage := options.get("include_usage", False), bool)
        and (stream or not options)
    ):
        raise RequestError('"stream_options" may only be {"include_usage": true} (or false), with "stream": true')
    return CompletionRequest(prompts, sampling, stop, stream, include_usage, echo, logprobs)


# ----------------------------------------------------------------------------------------------------
# Requests through the engine
# ----------------------------------------------------------------------------------------------------


class Submitted:
    """A request handed to the engine, and the events it reports, as they come."""

    def __init__(self, engine: BatchingEngine, prompt_ids: list[list[int]], sampling: Sampling, stop: list[str]):
        loop, self.events = asyncio.get_running_loop(), asyncio.Queue()

        def report(event):  # on the decoding thread
            loop.call_soon_threadsafe(self.events.put_nowait, event)

        samplings = [dataclasses.replace(sampling, prompt_index=index) for index in range(len(prompt_ids))]
        self.completion = Completion(prompt_ids, samplings, stop, report)
        if not engine.submit(self.completion):
            raise Overloaded(engine.retry_after_seconds(), engine.max_queued_requests)

    async def each_event(self):
        """The request's events up to the end of its last prompt; once the caller stops listening (a client that
        left), the engine decodes no more for it."""
        unfinished = len(self.completion.prompt_ids)
        try:
            while unfinished:
                event = await self.events.get()
                unfinished -= isinstance(event, RowFinished)
                yield event
                if isinstance(event, Failed):
                    return
        finally:
            self.completion.cancelled = True

    async def results(self) -> list[RowFinished]:
        """The end of each prompt, in order; RuntimeError where the engine failed."""
        results = {}
        async for event in self.each_event():
            if isinstance(event, Failed):
                raise RuntimeError(event.message)
            if isinstance(event, RowFinished):
                results[event.index] = event
        return [results[index] for index in range(len(results))]


# ----------------------------------------------------------------------------------------------------
# The application
# ----------------------------------------------------------------------------------------------------


class ServerMetrics:
    """What GET /metrics reports, in Prometheus' text format."""

    def __init__(self, batch_size: int):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "flax_lm_requests", "HTTP requests answered, by path and status", ["path", "status"], registry=registry
        )
        self.prompt_tokens = Counter("flax_lm_prompt_tokens", "Tokens of the prompts of requests", registry=registry)
        self.generated_tokens = Counter(
            "flax_lm_generated_tokens",
            "New tokens written for requests (end-of-text tokens included)",
            registry=registry,
        )
        self.queued_requests = Gauge("flax_lm_queued_requests", "Requests waiting for a batch", registry=registry)
        buckets = [2**power for power in range(shape_bucket(batch_size, 1).bit_length())]
        self.batch_rows = Histogram(
            "flax_lm_batch_rows", "Rows (prompts) of each batch", buckets=buckets, registry=registry
        )
        self.request_seconds = Histogram(
            "flax_lm_request_duration_seconds",
            "Time from a request to its last token, by path",
            ["path"],
            registry=registry,
        )


class CountRequests:
    """ASGI middleware counting each answer by path (the server's own paths; "other" for the rest) and status: an
    error that escapes the endpoint is counted as the 500 that Starlette then answers (answer_server_error)."""

    def __init__(self, app, metrics: ServerMetrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"
        answered = False

        async def counting_send(message):
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not answered:
                self.metrics.requests.labels(path, "500").inc()
            raise


async def answer_server_error(request, error: Exception) -> JSONResponse:
    """A request that failed in the server (a bug: uvicorn logs its traceback), answered in the endpoint's error
    shape rather than as plain text."""
    message = f"the server failed to answer ({type(error).__name__}); its log has the details"
    if request.url.path == "/v1/completions":
        return openai_error(message, "server_error", 500)
    return JSONResponse({"error": message}, 500)


def openai_error(message: str, error_type: str, status: int, param: str | None = None, headers=None) -> JSONResponse:
    content = {"error": {"message": message, "type": error_type, "param": param, "code": None}}
    return JSONResponse(content, status, headers=headers)


def openai_logprobs(tokenizer, ids: list[int], scores: SequenceScores, shown: int, top_n: int) -> dict:
    """OpenAI's "logprobs" of a choice that shows the tokens ids[shown:]: each token's text, its log-probability given
    the tokens before it (null for the first of the sequence, which nothing predicts), the top_n most likely tokens
    there with theirs (and the token itself, as OpenAI adds it), and where its text starts in the choice's text."""

    def text(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=False)

    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for position in range(shown, len(ids)):
        token = text(ids[position : position + 1])
        logprobs["tokens"].append(token)
        logprobs["text_offset"].append(len(text(ids[shown:position])))
        if position == 0:
            logprobs["token_logprobs"].append(None)
            logprobs["top_logprobs"].append(None)
            continue
        log_prob = float(scores.log_probs[position - 1])
        top_ids, top_log_probs = scores.top_ids[position - 1, :top_n], scores.top_log_probs[position - 1, :top_n]
        # Tokens whose texts are the same (pieces of one character) keep the likeliest's.
        top = {}
        for top_id, top_log_prob in zip(top_ids.tolist(), top_log_probs.tolist()):
            top.setdefault(text([top_id]), top_log_prob)
        top.setdefault(token, log_prob)
        logprobs["token_logprobs"].append(log_prob)
        logprobs["top_logprobs"].append(top)
    return logprobs


def server_sent_event(content) -> str:
    return f"data: {json.dumps(content)}\n\n"


class CompletionAnswer:
    """The parts of an answer of POST /v1/completions, in OpenAI's shape."""

    def __init__(self, model_id: str, prompt_tokens: int):
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        self.head["model"] = model_id
        self.prompt_tokens = prompt_tokens

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        finish_reason = None if finish_reason is None else FINISH_REASONS[finish_reason]
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def usage(self, results: list[RowFinished]) -> dict:
        new_tokens = sum(result.new_tokens for result in results)
        total_tokens = self.prompt_tokens + new_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": new_tokens, "total_tokens": total_tokens}

    def whole(self, results: list[RowFinished], scored: list[tuple[str, dict | None]] | None = None) -> dict:
        """The answer; `scored`: each choice's text and logprobs, where "echo" or "logprobs" asked for them."""
        scored = scored or [(result.text, None) for result in results]
        choices = [
            self.choice(result.index, text, result.finish_reason, logprobs)
            for result, (text, logprobs) in zip(results, scored)
        ]
        return {**self.head, "choices": choices, "usage": self.usage(results)}

    async def server_sent_events(self, submitted: Submitted, include_usage: bool, on_end):
        """The answer as server-sent events, each piece of text as it comes, then `data: [DONE]`; `on_end(results)`
        once every prompt is done."""
        sent = [0] * len(submitted.completion.prompt_ids)  # characters of each text sent
        results = []
        async for event in submitted.each_event():
            if isinstance(event, Failed):
                yield server_sent_event({"error": {"message": event.message, "type": "server_error"}})
                break
            if isinstance(event, TextPiece):
                text, finish_reason = event.text, None
            else:
                text, finish_reason = event.text[sent[event.index] :], event.finish_reason
                results.append(event)
            sent[event.index] += len(text)
            yield server_sent_event({**self.head, "choices": [self.choice(event.index, text, finish_reason)]})
        else:
            if include_usage:
                yield server_sent_event({**self.head, "choices": [], "usage": self.usage(results)})
            on_end(results)
        yield "data: [DONE]\n\n"


class Endpoints:
    """What the server answers on each path."""

    def __init__(self, generator, engine: BatchingEngine, metrics: ServerMetrics, limits: Limits):
        self.generator, self.engine, self.metrics, self.limits = generator, engine, metrics, limits
        self.model_id = generator.model.config.name_or_path

    def routes(self) -> list[Route]:
        return [
            Route("/", self.usage, methods=["GET"]),
            Route("/", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    async def encode(self, prompts: list, max_new_tokens: int, max_new_tokens_name: str) -> list[list[int]]:
        try:
            # On a thread: a long prompt holds up no other request.
            return await asyncio.to_thread(self.generator.encode, prompts, max_new_tokens, "prompt")
        except ValueError as error:
            raise RequestError(str(error).replace("max_new_tokens", max_new_tokens_name), "prompt") from None

    async def submit(self, prompts: list, sampling: Sampling, stop: list[str], max_new_tokens_name: str) -> Submitted:
        prompt_ids = await self.encode(prompts, sampling.max_new_tokens, max_new_tokens_name)
        submitted = Submitted(self.engine, prompt_ids, sampling, stop)
        self.metrics.prompt_tokens.inc(submitted.completion.prompt_tokens)
        return submitted

    def log_answer(self, path: str, results: list[RowFinished], start: float):
        seconds = time.perf_counter() - start
        self.metrics.request_seconds.labels(path).observe(seconds)
        new_tokens = sum(result.new_tokens for result in results)
        logger.info("%s: %d prompts, %d new tokens in %.2f s", path, len(results), new_tokens, seconds)

    async def usage(self, request):
        return JSONResponse({"model": self.model_id, "usage": f"POST {REQUEST_EXAMPLE}, or POST /v1/completions"})

    async def generate(self, request):
        start = time.perf_counter()
        try:
            prompts, sampling = parse_generate_request(await read_json(request), self.limits)
            submitted = await self.submit(prompts, sampling, [], "max_new_tokens")
            results = await submitted.results()
        except RequestError as error:
            return JSONResponse({"error": str(error)}, error.status)
        except Overloaded as error:
            return JSONResponse({"error": str(error)}, 503, headers={"Retry-After": str(error.retry_after)})
        except RuntimeError as error:
            return JSONResponse({"error": str(error)}, 500)
        self.log_answer("/", results, start)
        return JSONResponse(
            {
                "texts": [result.text for result in results],
                "prompt_tokens": list(map(len, submitted.completion.prompt_ids)),
                "new_tokens": [result.new_tokens for result in results],
                "finish_reasons": [result.finish_reason for result in results],
            }
        )

    async def completions(self, request):
        start = time.perf_counter()
        try:
            parsed = parse_completion_request(await read_json(request), self.model_id, self.limits)
            if parsed.sampling.max_new_tokens:
                submitted = await self.submit(parsed.prompts, parsed.sampling, parsed.stop, "max_tokens")
                prompt_ids = submitted.completion.prompt_ids
            else:  # nothing to write: the engine has no part in it
                submitted, prompt_ids = None, await self.encode(parsed.prompts, 0, "max_tokens")
                self.metrics.prompt_tokens.inc(sum(map(len, prompt_ids)))
        except RequestError as error:
            error_type = "not_found_error" if error.status == 404 else "invalid_request_error"
            return openai_error(str(error), error_type, error.status, error.param)
        except Overloaded as error:
            return openai_error(str(error), "overloaded_error", 503, headers={"Retry-After": str(error.retry_after)})
        answer = CompletionAnswer(self.model_id, sum(map(len, prompt_ids)))
        if parsed.stream:
            events = answer.server_sent_events(
                submitted, parsed.include_usage, lambda results: self.log_answer("/v1/completions", results, start)
            )
            # No proxy may hold the events back.
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            results = (
                await submitted.results()
                if submitted
                else [RowFinished(row, "", 0, "length", []) for row in range(len(prompt_ids))]
            )
        except RuntimeError as error:
            return openai_error(str(error), "server_error", 500)
        scored = None
        if parsed.echo or parsed.logprobs is not None:
            scored = await asyncio.to_thread(self.scored_choices, prompt_ids, results, parsed.echo, parsed.logprobs)
        self.log_answer("/v1/completions", results, start)
        return JSONResponse(answer.whole(results, scored))

    def scored_choices(self, prompt_ids, results: list[RowFinished], echo: bool, logprobs: int | None) -> list:
        """The text of each choice, its prompt's first with `echo`, and its "logprobs" (None without `logprobs`): of
        its prompt's tokens with `echo`, and of its new tokens."""
        tokenizer, scorer = self.generator.tokenizer, self.generator.scorer
        sequences = [ids + result.ids for ids, result in zip(prompt_ids, results)]
        scores = None
        if logprobs is not None:  # always the most tokens a request may see: one compiled program for every request
            scores = scorer.score(self.generator.params, sequences, top_k=MAX_LOGPROBS)
        choices = []
        for row, (ids, result) in enumerate(zip(prompt_ids, results)):
            text = tokenizer.decode(ids, skip_special_tokens=False) + result.text if echo else result.text
            shown = 0 if echo else len(ids)
            row_logprobs = (
                None if scores is None else openai_logprobs(tokenizer, sequences[row], scores[row], shown, logprobs)
            )
            choices.append((text, row_logprobs))
        return choices

    async def models(self, request):
        model = {"id": self.model_id, "object": "model", "created": int(time.time()), "owned_by": "flax-lm"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def make_app(generator, engine: BatchingEngine, metrics: ServerMetrics, limits: Limits) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        # uvicorn has answered every request it accepted: the engine has none left.
        await asyncio.to_thread(engine.stop)

    routes = Endpoints(generator, engine, metrics, limits).routes()
    counting = Middleware(CountRequests, metrics=metrics, paths={route.path for route in routes})
    return Starlette(
        routes=routes, middleware=[counting], exception_handlers={Exception: answer_server_error}, lifespan=lifespan
    )


# ----------------------------------------------------------------------------------------------------
# Serving
# ----------------------------------------------------------------------------------------------------


class Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or SIGINT stops accepting connections and answers the requests it has;
    where uvicorn then raises the signal again (ending the process with the signal's status), this one returns,
    noting the signal and how many requests were in flight."""

    def __init__(self, config: uvicorn.Config, engine: BatchingEngine):
        super().__init__(config)
        self.engine = engine
        self.stopped_by: tuple[str, int] | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
            yield
            return
        previous = {number: signal.signal(number, self.handle_exit) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def handle_exit(self, sig, frame):
        if self.stopped_by is None:
            self.stopped_by = (signal.Signals(sig).name, self.engine.unanswered)
        super().handle_exit(sig, frame)


def listening_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, protocol)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
    except OSError as error:
        raise UsageError(f"cannot listen on --host {host} --port {port}: {error}") from None
    return listener


def make_server(generator, limits: Limits, max_queued_requests: int) -> Server:
    metrics = ServerMetrics(limits.batch_size)
    engine = BatchingEngine(generator, max_queued_requests, metrics)
    metrics.queued_requests.set_function(lambda: engine.queued)
    app = make_app(generator, engine, metrics, limits)
    # Our own log lines only: uvicorn's access log would repeat each request's.
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, backlog=LISTEN_BACKLOG)
    return Server(config, engine)


def serve(generator, limits: Limits, max_queued_requests: int, listener: socket.socket):
    """Serves on `listener` (see listening_socket) until SIGTERM or SIGINT, then answers the requests in flight and
    returns."""
    server = make_server(generator, limits, max_queued_requests)
    bound_host, bound_port = listener.getsockname()[:2]
    print(f"Serving {generator.model.config.name_or_path} on http://{bound_host}:{bound_port}", flush=True)
    server.run(sockets=[listener])
    if server.stopped_by is not None:
        name, in_flight = server.stopped_by
        logger.info("Stopped on %s, after answering the %d requests in flight", name, in_flight)
