"""generate_flax.py's HTTP server: the OpenAI completions and chat completions APIs (POST /v1/completions and
/v1/chat/completions, streamed as server-sent events on request; GET /v1/models), the script's own JSON API (POST /),
GET /health and Prometheus metrics (GET /metrics), in front of flax_lm.batching's engine.

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
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flax_lm.batching import BatchingEngine, Completion, Failed, RowFinished, TextPiece
from flax_lm.errors import UsageError
from flax_lm.sampling import Sampling, shape_bucket

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
# Connections the operating system holds for the server before it accepts them (uvicorn's default).
LISTEN_BACKLOG = 2048
SETTING_TYPES = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}
REQUEST_FIELDS = {"prompt", "prompts", *SETTING_TYPES}
REQUEST_EXAMPLE = '{"prompt": "Once", "max_new_tokens": 20, "temperature": 0.8, "top_k": 0, "top_p": 1, "seed": 0}'
# The completions API's fields this server reads; top_k is not OpenAI's, but vLLM's and llama.cpp's servers take it.
COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
    "user",
}  # fmt: skip
# Fields of the completions API this server has no use for, accepted at the value that asks for nothing.
UNSUPPORTED_COMPLETION_FIELDS = {
    "echo": (False,),
    "logprobs": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's
# The chat completions API's fields this server reads (max_tokens is the older name of max_completion_tokens), and
# those it has no use for, accepted at the value that asks for nothing.
CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stream", "stream_options", "n", "user",
}  # fmt: skip
UNSUPPORTED_CHAT_FIELDS = {
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
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
    """The body of `request` as JSON, refusing more than MAX_REQUEST_BYTES (read no further)."""
    too_long = f"the body is longer than {MAX_REQUEST_BYTES} bytes, the most the server takes"
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_REQUEST_BYTES:
        raise RequestError(too_long)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BYTES:
            raise RequestError(too_long)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not JSON: {error}") from None


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


def checked_prompts(prompts, limits: Limits, problem: str, param: str) -> list[str]:
    """`prompts` if it is a non-empty list of at most batch_size strings; else `problem` refuses the request."""
    if not isinstance(prompts, list) or not prompts or not all(isinstance(prompt, str) for prompt in prompts):
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
    prompts: list[str]
    sampling: Sampling
    stop: list[str]
    stream: bool
    include_usage: bool


def parse_completion_request(request, model_id: str, limits: Limits) -> CompletionRequest:
    """A request to POST /v1/completions, as OpenAI defines it; the command line's settings fill in what it leaves
    out (max_tokens from --max_new_tokens)."""
    example = '{"model": "...", "prompt": "Once"}'
    check_openai_fields(request, model_id, COMPLETION_FIELDS, UNSUPPORTED_COMPLETION_FIELDS, example)
    if "prompt" not in request:
        raise RequestError('"prompt" is missing: give a string or a list of strings', "prompt")
    prompts = [request["prompt"]] if isinstance(request["prompt"], str) else request["prompt"]
    prompts = checked_prompts(prompts, limits, '"prompt" must be a string or a non-empty list of strings', "prompt")
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
    stop = stop_strings(request)
    stream, include_usage = stream_settings(request)
    return CompletionRequest(prompts, checked_sampling(sampling, limits, "max_tokens"), stop, stream, include_usage)


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
    stop: list[str]
    stream: bool
    include_usage: bool


def parse_chat_request(request, model_id: str, limits: Limits) -> ChatRequest:
    """A request to POST /v1/chat/completions, as OpenAI defines it: a conversation ("messages"), answered with the
    assistant's next turn; the command line's settings fill in what it leaves out (max_completion_tokens, or
    max_tokens, from --max_new_tokens). The conversation is checked when it is rendered."""
    example = '{"model": "...", "messages": [{"role": "user", "content": "Hi"}]}'
    check_openai_fields(request, model_id, CHAT_FIELDS, UNSUPPORTED_CHAT_FIELDS, example)
    if "messages" not in request:
        raise RequestError('"messages" is missing: give the conversation, a list of messages', "messages")
    if number(request, "n", int, 1) != 1:
        raise RequestError('"n" must be 1: this server writes one reply per conversation', "n")
    defaults = limits.defaults
    max_tokens_name = "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
    sampling = Sampling(
        max_new_tokens=number(request, max_tokens_name, int, defaults.max_new_tokens),
        temperature=number(request, "temperature", float, defaults.temperature),
        top_k=number(request, "top_k", int, defaults.top_k),
        top_p=number(request, "top_p", float, defaults.top_p),
        seed=number(request, "seed", int, defaults.seed),
    )
    stop = stop_strings(request)
    stream, include_usage = stream_settings(request)
    sampling = checked_sampling(sampling, limits, max_tokens_name)
    return ChatRequest(request["messages"], sampling, max_tokens_name, stop, stream, include_usage)


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
    """ASGI middleware counting each answer by path (the server's own paths; "other" for the rest) and status."""

    def __init__(self, app, metrics: ServerMetrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def openai_error(message: str, error_type: str, status: int, param: str | None = None, headers=None) -> JSONResponse:
    content = {"error": {"message": message, "type": error_type, "param": param, "code": None}}
    return JSONResponse(content, status, headers=headers)


def server_sent_event(content) -> str:
    return f"data: {json.dumps(content)}\n\n"


class CompletionAnswer:
    """The parts of an answer of POST /v1/completions, in OpenAI's shape."""

    def __init__(self, model_id: str, prompt_tokens: int):
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        self.head["model"] = model_id
        self.prompt_tokens = prompt_tokens

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        finish_reason = None if finish_reason is None else FINISH_REASONS[finish_reason]
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def usage(self, results: list[RowFinished]) -> dict:
        new_tokens = sum(result.new_tokens for result in results)
        total_tokens = self.prompt_tokens + new_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": new_tokens, "total_tokens": total_tokens}

    def whole(self, results: list[RowFinished]) -> dict:
        choices = [self.choice(result.index, result.text, result.finish_reason) for result in results]
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


class ChatAnswer(CompletionAnswer):
    """The parts of an answer of POST /v1/chat/completions, in OpenAI's shape: the assistant's reply as one message,
    or streamed as chunks of it (the first with its role, then its text as it comes, the last with why it ended)."""

    def __init__(self, model_id: str, prompt_tokens: int):
        super().__init__(model_id, prompt_tokens)
        self.head.update(id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion")

    def whole(self, results: list[RowFinished]) -> dict:
        (result,) = results
        message = {"role": "assistant", "content": result.text}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": FINISH_REASONS[result.finish_reason],
        }
        return {**self.head, "choices": [choice], "usage": self.usage(results)}

    def chunk(self, delta: dict, finish_reason: str | None = None) -> str:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        return server_sent_event({**self.head, "object": "chat.completion.chunk", "choices": choices})

    async def server_sent_events(self, submitted: Submitted, include_usage: bool, on_end):
        """The reply as server-sent events, each piece of text as it comes, then `data: [DONE]`; `on_end(results)`
        once it is done."""
        yield self.chunk({"role": "assistant", "content": ""})
        sent = 0  # characters of the reply sent
        async for event in submitted.each_event():
            if isinstance(event, Failed):
                yield server_sent_event({"error": {"message": event.message, "type": "server_error"}})
                break
            if isinstance(event, TextPiece):
                sent += len(event.text)
                yield self.chunk({"content": event.text})
            else:
                result = event
                if rest := event.text[sent:]:
                    yield self.chunk({"content": rest})
                yield self.chunk({}, FINISH_REASONS[event.finish_reason])
        else:
            if include_usage:
                usage = self.usage([result])
                yield server_sent_event(
                    {**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                )
            on_end([result])
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
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    async def submit(
        self, prompts: list, sampling: Sampling, stop: list[str], max_new_tokens_name: str, conversations=False
    ) -> Submitted:
        """Hands the prompts (or, with `conversations`, conversations to reply to) to the engine."""
        encode = self.generator.encode_conversations if conversations else self.generator.encode
        where, param = ("conversation", "messages") if conversations else ("prompt", "prompt")
        try:
            # On a thread: a long prompt holds up no other request.
            prompt_ids = await asyncio.to_thread(encode, prompts, sampling.max_new_tokens, where)
        except ValueError as error:
            raise RequestError(str(error).replace("max_new_tokens", max_new_tokens_name), param) from None
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
            submitted = await self.submit(parsed.prompts, parsed.sampling, parsed.stop, "max_tokens")
        except RequestError as error:
            error_type = "not_found_error" if error.status == 404 else "invalid_request_error"
            return openai_error(str(error), error_type, error.status, error.param)
        except Overloaded as error:
            return openai_error(str(error), "overloaded_error", 503, headers={"Retry-After": str(error.retry_after)})
        answer = CompletionAnswer(self.model_id, submitted.completion.prompt_tokens)
        if parsed.stream:
            events = answer.server_sent_events(
                submitted, parsed.include_usage, lambda results: self.log_answer("/v1/completions", results, start)
            )
            # No proxy may hold the events back.
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            results = await submitted.results()
        except RuntimeError as error:
            return openai_error(str(error), "server_error", 500)
        self.log_answer("/v1/completions", results, start)
        return JSONResponse(answer.whole(results))

    async def chat_completions(self, request):
        start = time.perf_counter()
        try:
            parsed = parse_chat_request(await read_json(request), self.model_id, self.limits)
            sampling, stop = parsed.sampling, parsed.stop
            submitted = await self.submit([parsed.messages], sampling, stop, parsed.max_tokens_name, True)
        except RequestError as error:
            error_type = "not_found_error" if error.status == 404 else "invalid_request_error"
            return openai_error(str(error), error_type, error.status, error.param)
        except Overloaded as error:
            return openai_error(str(error), "overloaded_error", 503, headers={"Retry-After": str(error.retry_after)})
        answer = ChatAnswer(self.model_id, submitted.completion.prompt_tokens)
        if parsed.stream:
            events = answer.server_sent_events(
                submitted,
                parsed.include_usage,
                lambda results: self.log_answer("/v1/chat/completions", results, start),
            )
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            results = await submitted.results()
        except RuntimeError as error:
            return openai_error(str(error), "server_error", 500)
        self.log_answer("/v1/chat/completions", results, start)
        return JSONResponse(answer.whole(results))

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
    return Starlette(routes=routes, middleware=[counting], lifespan=lifespan)


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
