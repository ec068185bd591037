"""generate_flax.py's HTTP server: the OpenAI completions and chat completions APIs (POST /v1/completions and
/v1/chat/completions, streamed as server-sent events on request; GET /v1/models), the script's own JSON API (POST /),
GET /health and Prometheus metrics (GET /metrics), in front of flax_lm.server.request_queue's engine.

A completion request may give its prompts as texts or token ids, several in one request, and ask for the prompt back
("echo") and the log-probabilities of the tokens ("logprobs", from flax_lm.evaluation.scoring), with "max_tokens": 0
for the prompt alone: what lm-evaluation-harness's local-completions backend asks to score a task. Both APIs take
OpenAI's sampling fields ("presence_penalty", "frequency_penalty", "logit_bias", "stop", "seed", "n"; "best_of" for
completions, "logprobs" and "top_logprobs" for chat); a request's choices are rows of the same batch.

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

from flax_lm.errors import UsageError
from flax_lm.evaluation.scoring import SequenceScores
from flax_lm.generation.sampling import Sampling, shape_bucket
from flax_lm.server.request_queue import BatchingEngine, Completion, Failed, RowFinished, TextPiece
from flax_lm.server.requests import (
    MAX_TOP_LOGPROBS,
    REQUEST_EXAMPLE,
    Limits,
    RequestError,
    parse_chat_request,
    parse_completion_request,
    parse_generate_request,
    read_json,
)

logger = logging.getLogger(__name__)

# Connections the operating system holds for the server before it accepts them (uvicorn's default).
LISTEN_BACKLOG = 2048
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's


class Overloaded(Exception):
    """The queue of requests is full: answered 503, with Retry-After."""

    def __init__(self, retry_after: int, max_queued_requests: int):
        super().__init__(f"the server is busy ({max_queued_requests} requests wait); retry in {retry_after} s")
        self.retry_after = retry_after


# ----------------------------------------------------------------------------------------------------
# Requests through the engine
# ----------------------------------------------------------------------------------------------------


class Submitted:
    """A request handed to the engine, and the events it reports, as they come."""

    def __init__(
        self, engine: BatchingEngine, prompt_ids: list[list[int]], samplings: list[Sampling], stop: list[str]
    ):
        loop, self.events = asyncio.get_running_loop(), asyncio.Queue()

        def report(event):  # on the decoding thread
            loop.call_soon_threadsafe(self.events.put_nowait, event)

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
    if request.url.path.startswith("/v1/"):  # the OpenAI APIs'
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


class ChatAnswer(CompletionAnswer):
    """The parts of an answer of POST /v1/chat/completions, in OpenAI's shape: each choice of the assistant's reply as
    one message, or streamed as chunks of it (the first with its role, then its text as it comes, the last with why
    it ended)."""

    def __init__(self, model_id: str, prompt_tokens: int):
        super().__init__(model_id, prompt_tokens)
        self.head.update(id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion")

    def whole(self, results: list[RowFinished], logprobs: list[dict] | None = None) -> dict:
        choices = [
            {
                "index": result.index,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None if logprobs is None else logprobs[row],
                "finish_reason": FINISH_REASONS[result.finish_reason],
            }
            for row, result in enumerate(results)
        ]
        return {**self.head, "choices": choices, "usage": self.usage(results)}

    def chunk(self, index: int, delta: dict, finish_reason: str | None = None) -> str:
        choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        return server_sent_event({**self.head, "object": "chat.completion.chunk", "choices": choices})

    async def server_sent_events(self, submitted: Submitted, include_usage: bool, on_end):
        """The replies as server-sent events, each piece of text as it comes, then `data: [DONE]`; `on_end(results)`
        once they are done."""
        choices = len(submitted.completion.prompt_ids)
        for index in range(choices):
            yield self.chunk(index, {"role": "assistant", "content": ""})
        sent = [0] * choices  # characters of each reply sent
        results = []
        async for event in submitted.each_event():
            if isinstance(event, Failed):
                yield server_sent_event({"error": {"message": event.message, "type": "server_error"}})
                break
            if isinstance(event, TextPiece):
                sent[event.index] += len(event.text)
                yield self.chunk(event.index, {"content": event.text})
            else:
                results.append(event)
                if rest := event.text[sent[event.index] :]:
                    yield self.chunk(event.index, {"content": rest})
                yield self.chunk(event.index, {}, FINISH_REASONS[event.finish_reason])
        else:
            if include_usage:
                usage = self.usage(results)
                yield server_sent_event(
                    {**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                )
            on_end(results)
        yield "data: [DONE]\n\n"


def chat_logprobs(tokenizer, scores: SequenceScores, prompt_length: int, new_ids: list[int], top_n: int) -> dict:
    """OpenAI's "logprobs" of a chat choice: for each new token, its text, bytes and log-probability, and the top_n
    most likely tokens there with theirs (the completions endpoint's numbers for the same tokens)."""

    def entry(token_id: int, log_prob: float) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}

    content = []
    for offset, token_id in enumerate(new_ids):
        position = prompt_length - 1 + offset  # the row of the scores that predicts this token
        top = zip(scores.top_ids[position, :top_n].tolist(), scores.top_log_probs[position, :top_n].tolist())
        content.append(
            {
                **entry(token_id, float(scores.log_probs[position])),
                "top_logprobs": [entry(top_id, top_log_prob) for top_id, top_log_prob in top],
            }
        )
    return {"content": content, "refusal": None}


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

    async def encode(
        self, prompts: list, max_new_tokens: int, max_new_tokens_name: str, conversations: bool = False
    ) -> list[list[int]]:
        """Token ids of the prompts (or, with `conversations`, of conversations to reply to)."""
        encode = self.generator.encode_conversations if conversations else self.generator.encode
        where, param = ("conversation", "messages") if conversations else ("prompt", "prompt")
        try:
            # On a thread: a long prompt holds up no other request.
            return await asyncio.to_thread(encode, prompts, max_new_tokens, where)
        except ValueError as error:
            raise RequestError(str(error).replace("max_new_tokens", max_new_tokens_name), param) from None

    async def submit(
        self,
        prompts: list,
        sampling: Sampling,
        stop: list[str],
        max_new_tokens_name: str,
        conversations: bool = False,
        max_tokens_given: bool = True,
        choices: int = 1,
    ) -> tuple[Submitted, list[list[int]]]:
        """Hands the prompts (or, with `conversations`, conversations to reply to) to the engine, each `choices`
        times (choice i of prompt p is row p * choices + i, with draws of its own); without `max_tokens_given`, each
        row writes up to the room left in the model's positions, at most the server's limit. Returns the request and
        the prompts' ids."""
        vocab_size = self.generator.model.config.vocab_size
        if outside := [token_id for token_id, _ in sampling.logit_bias if token_id >= vocab_size]:
            raise RequestError(
                f'"logit_bias" names the token id {outside[0]}, outside the model\'s {vocab_size} tokens', "logit_bias"
            )
        at_least = sampling.max_new_tokens if max_tokens_given else 1
        prompt_ids = await self.encode(prompts, at_least, max_new_tokens_name, conversations)
        positions = self.generator.model.config.max_position_embeddings
        rows, samplings = [], []
        for ids in prompt_ids:
            max_new_tokens = (
                sampling.max_new_tokens if max_tokens_given else min(sampling.max_new_tokens, positions - len(ids))
            )
            for _ in range(choices):
                samplings.append(dataclasses.replace(sampling, max_new_tokens=max_new_tokens, prompt_index=len(rows)))
                rows.append(ids)
        submitted = Submitted(self.engine, rows, samplings, stop)
        self.metrics.prompt_tokens.inc(sum(map(len, prompt_ids)))
        return submitted, prompt_ids

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
            submitted, _ = await self.submit(prompts, sampling, [], "max_new_tokens")
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
                submitted, prompt_ids = await self.submit(
                    parsed.prompts,
                    parsed.sampling,
                    parsed.stop,
                    "max_tokens",
                    max_tokens_given=parsed.max_tokens_given,
                    choices=parsed.best_of,
                )
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
        row_prompt_ids = [ids for ids in prompt_ids for _ in range(parsed.best_of if submitted else 1)]
        if parsed.best_of > parsed.n:
            results = await asyncio.to_thread(self.best_choices, row_prompt_ids, results, parsed.best_of, parsed.n)
            row_prompt_ids = [ids for ids in prompt_ids for _ in range(parsed.n)]
        scored = None
        if parsed.echo or parsed.logprobs is not None:
            scored = await asyncio.to_thread(
                self.scored_choices, row_prompt_ids, results, parsed.echo, parsed.logprobs
            )
        self.log_answer("/v1/completions", results, start)
        return JSONResponse(answer.whole(results, scored))

    def best_choices(self, prompt_ids, results: list[RowFinished], best_of: int, n: int) -> list[RowFinished]:
        """Of each prompt's `best_of` choices, the `n` of the highest log-probability per token, best first (OpenAI's
        best_of), numbered as the choices returned."""
        sequences = [ids + result.ids for ids, result in zip(prompt_ids, results)]
        scores = self.generator.scorer.score(self.generator.params, sequences)
        kept = []
        for first in range(0, len(results), best_of):
            rows = range(first, first + best_of)

            def mean_log_prob(row):
                new = scores[row].log_probs[len(prompt_ids[row]) - 1 :]
                return float(new.mean()) if len(new) else -float("inf")

            best = sorted(rows, key=mean_log_prob, reverse=True)[:n]
            kept += [dataclasses.replace(results[row], index=len(kept) + rank) for rank, row in enumerate(best)]
        return kept

    def scored_choices(self, prompt_ids, results: list[RowFinished], echo: bool, logprobs: int | None) -> list:
        """The text of each choice, its prompt's first with `echo`, and its "logprobs" (None without `logprobs`): of
        its prompt's tokens with `echo`, and of its new tokens."""
        tokenizer, scorer = self.generator.tokenizer, self.generator.scorer
        sequences = [ids + result.ids for ids, result in zip(prompt_ids, results)]
        scores = None
        if logprobs is not None:  # always the most tokens a request may see: one compiled program for every request
            scores = scorer.score(self.generator.params, sequences, top_k=MAX_TOP_LOGPROBS)
        choices = []
        for row, (ids, result) in enumerate(zip(prompt_ids, results)):
            text = tokenizer.decode(ids, skip_special_tokens=False) + result.text if echo else result.text
            shown = 0 if echo else len(ids)
            row_logprobs = (
                None if scores is None else openai_logprobs(tokenizer, sequences[row], scores[row], shown, logprobs)
            )
            choices.append((text, row_logprobs))
        return choices

    async def chat_completions(self, request):
        start = time.perf_counter()
        try:
            parsed = parse_chat_request(await read_json(request), self.model_id, self.limits)
            submitted, (prompt_ids,) = await self.submit(
                [parsed.messages],
                parsed.sampling,
                parsed.stop,
                parsed.max_tokens_name,
                conversations=True,
                max_tokens_given=parsed.max_tokens_given,
                choices=parsed.n,
            )
        except RequestError as error:
            error_type = "not_found_error" if error.status == 404 else "invalid_request_error"
            return openai_error(str(error), error_type, error.status, error.param)
        except Overloaded as error:
            return openai_error(str(error), "overloaded_error", 503, headers={"Retry-After": str(error.retry_after)})
        answer = ChatAnswer(self.model_id, len(prompt_ids))
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
        logprobs = None
        if parsed.top_logprobs is not None:
            logprobs = await asyncio.to_thread(self.chat_logprobs, prompt_ids, results, parsed.top_logprobs)
        self.log_answer("/v1/chat/completions", results, start)
        return JSONResponse(answer.whole(results, logprobs))

    def chat_logprobs(self, prompt_ids: list[int], results: list[RowFinished], top_n: int) -> list[dict]:
        sequences = [prompt_ids + result.ids for result in results]
        scores = self.generator.scorer.score(self.generator.params, sequences, top_k=MAX_TOP_LOGPROBS)
        tokenizer = self.generator.tokenizer
        return [
            chat_logprobs(tokenizer, row, len(prompt_ids), result.ids, top_n) for row, result in zip(scores, results)
        ]

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
