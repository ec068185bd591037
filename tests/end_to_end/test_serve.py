"""generate_flax.py --serve (flax_lm/server/app.py and flax_lm/server/request_queue.py): requests that arrive together
share a batch and get what they would get alone, a full queue answers 503, SIGTERM answers the requests in flight and
exits 0, and the OpenAI client gets completions, streamed or not."""

import collections
import contextlib
import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import GPT2LMHeadModel

from flax_lm.generation import sampling
from flax_lm.server import app as serving
from flax_lm.server import request_queue as batching
from flax_lm.server import requests as server_requests

PROMPTS = ["The gardener", "In the morning the old house was quiet and", "A"]
DEFAULTS = sampling.Sampling(max_new_tokens=8)


@contextlib.contextmanager
def running_server(generator, max_queued_requests: int = 64):
    """The server, in this process, on a free port of 127.0.0.1: (its URL, the server)."""
    listener = serving.listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    limits = server_requests.Limits(DEFAULTS, max_new_tokens_limit=32, batch_size=generator.batch_size)
    server = serving.make_server(generator, limits, max_queued_requests)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        wait_until(lambda: server.started)
        yield url, server
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def wait_until(condition, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(generator):
    with running_server(generator) as url_and_server:
        yield url_and_server


@pytest.fixture
def gate(monkeypatch):
    """Holds the next batch the server decodes until the test sets `gate.open`, so that requests queue behind it;
    `gate.reached` is set once that batch waits there."""
    reached, opened = threading.Event(), threading.Event()

    class HeldBatch(batching.DecodingBatch):
        def __init__(self, *args, **kwargs):
            if not reached.is_set():
                reached.set()
                opened.wait(timeout=120)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(batching, "DecodingBatch", HeldBatch)
    yield type("Gate", (), {"reached": reached, "open": opened})
    opened.set()


@pytest.fixture
def generator_free_limits():
    """The server's limits, for the request parsers alone (no model)."""
    return server_requests.Limits(DEFAULTS, max_new_tokens_limit=32, batch_size=4)


def complete(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, **fields}, timeout=120)


def model_id(generator) -> str:
    return generator.model.config.name_or_path


def batches_of_one_and_all(url: str) -> tuple[float, float]:
    """(batches of 1 row, all batches) that the server decoded so far, from its /metrics."""
    metrics = {family.name: family for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    samples = {
        (sample.name, sample.labels.get("le")): sample.value for sample in metrics["flax_lm_batch_rows"].samples
    }
    return samples[("flax_lm_batch_rows_bucket", "1.0")], samples[("flax_lm_batch_rows_count", None)]


def test_32_concurrent_requests_are_all_answered_in_shared_batches(generator, server):
    url, _ = server
    ones_before, all_before = batches_of_one_and_all(url)

    def request(number: int) -> httpx.Response:
        return complete(url, model_id(generator), prompt=f"{PROMPTS[number % 3]} {number}", max_tokens=24)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(request, range(32)))
    assert [answer.status_code for answer in answers] == [200] * 32
    assert all(answer.json()["usage"]["completion_tokens"] >= 1 for answer in answers)
    ones, batches = batches_of_one_and_all(url)
    assert batches - all_before < 32  # some batch had more than one row
    assert batches - all_before > ones - ones_before


def test_a_request_in_a_shared_batch_gets_what_it_gets_alone(generator, server, gate):
    url, running = server
    requests = [
        {"prompt": PROMPTS[0], "max_tokens": 12},
        {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0.9, "top_k": 20, "seed": 3},
        {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 1.1, "top_p": 0.9, "seed": 3, "presence_penalty": 1.5},
        {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0, "seed": 4, "frequency_penalty": 1.0},
    ]
    ones_before, all_before = batches_of_one_and_all(url)
    with ThreadPoolExecutor(len(requests) + 1) as pool:
        first = pool.submit(complete, url, model_id(generator), prompt="A", max_tokens=4)
        assert gate.reached.wait(timeout=120)
        together = [pool.submit(complete, url, model_id(generator), **request) for request in requests]
        wait_until(lambda: running.engine.queued == len(requests))
        gate.open.set()
        assert first.result().status_code == 200
        together = [answer.result().json() for answer in together]
    ones, batches = batches_of_one_and_all(url)
    # The first alone, then the four together, whatever their settings and penalties
    assert (batches - all_before, ones - ones_before) == (2, 1)
    for request, shared in zip(requests, together):
        alone = complete(url, model_id(generator), **request).json()
        assert shared["choices"] == alone["choices"] and shared["usage"] == alone["usage"]
    assert together[1]["choices"][0]["text"] != together[3]["choices"][0]["text"]


def test_a_full_queue_is_answered_503_with_retry_after(generator, gate):
    with running_server(generator, max_queued_requests=2) as (url, running), ThreadPoolExecutor(3) as pool:
        answers = [pool.submit(complete, url, model_id(generator), prompt="A", max_tokens=4)]
        assert gate.reached.wait(timeout=120)
        answers += [
            pool.submit(complete, url, model_id(generator), prompt=prompt, max_tokens=4) for prompt in PROMPTS[:2]
        ]
        wait_until(lambda: running.engine.queued == 2)

        refused = complete(url, model_id(generator), prompt="B", max_tokens=4)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert (
            refused.json()["error"]["message"]
            == f"the server is busy (2 requests wait); retry in {refused.headers['Retry-After']} s"
        )
        refused = httpx.post(url, json={"prompt": "B"}, timeout=60)
        assert refused.status_code == 503 and "the server is busy" in refused.json()["error"]

        gate.open.set()
        assert [answer.result().status_code for answer in answers] == [200] * 3


def test_the_openai_client_gets_a_completion_and_a_streamed_one(generator, server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    assert model.id == model_id(generator)
    expected = generator.generate([PROMPTS[1]], sampling.Sampling(10))[0]

    completion = client.completions.create(model=model.id, prompt=PROMPTS[1], max_tokens=10)
    [choice] = completion.choices
    assert (choice.text, choice.finish_reason) == (expected["text"], "length")
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (expected["prompt_tokens"], 10)

    stream = client.completions.create(
        model=model.id, prompt=PROMPTS[1], max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    pieces = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len([piece for piece in pieces if piece]) > 1  # sent as it was decoded, not at the end
    assert "".join(pieces) == expected["text"]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(generator, server):
    url, _ = server
    text = generator.generate([PROMPTS[1]], sampling.Sampling(24))[0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    request = {"prompt": PROMPTS[1], "max_tokens": 24, "stop": [stop, "never written"]}

    answer = complete(url, model_id(generator), **request).json()
    [choice] = answer["choices"]
    assert (choice["text"], choice["finish_reason"]) == (text[: text.index(stop)], "stop")
    assert answer["usage"]["completion_tokens"] < 24

    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": model_id(generator), "stream": True, **request}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert "".join(chunk["text"] for chunk in chunks) == choice["text"]
    assert [chunk["finish_reason"] for chunk in chunks][-1] == "stop"


def test_penalties_logit_bias_n_best_of_and_seed_with_the_openai_client(generator, server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = model_id(generator)

    def texts(**fields) -> list[str]:
        return [choice.text for choice in client.completions.create(model=model, prompt=PROMPTS[1], **fields).choices]

    def streamed_texts(**fields) -> list[str]:
        chunks = client.completions.create(model=model, prompt=PROMPTS[1], stream=True, **fields)
        pieces = collections.defaultdict(str)
        for chunk in chunks:
            for choice in chunk.choices:
                pieces[choice.index] += choice.text
        return [pieces[index] for index in sorted(pieces)]

    # The penalties as the sampler applies them (OpenAI's definitions: see test_generate), greedy, streamed or not
    penalties = dict(presence_penalty=0.8, frequency_penalty=1.5)
    expected = generator.generate([PROMPTS[1]], sampling.Sampling(16, **penalties))[0]["text"]
    assert texts(max_tokens=16, **penalties) == streamed_texts(max_tokens=16, **penalties) == [expected]
    assert expected != generator.generate([PROMPTS[1]], sampling.Sampling(16))[0]["text"]

    # A bias of 100 makes a token the only choice
    token_id = generator.tokenizer(" garden")["input_ids"][0]
    assert texts(max_tokens=5, logit_bias={str(token_id): 100}) == [generator.tokenizer.decode([token_id] * 5)]

    # n choices of a prompt draw differently, the same again with the same seed, streamed or not
    drawn = dict(max_tokens=8, temperature=1.0, seed=5)
    choices = texts(n=3, **drawn)
    assert len(set(choices)) == 3 and texts(n=3, **drawn) == choices == streamed_texts(n=3, **drawn)

    # best_of writes as many choices (the same draws) and returns those of the highest log-probability per token
    scored = client.completions.create(model=model, prompt=PROMPTS[1], n=3, logprobs=0, **drawn).choices
    mean_log_probs = [np.mean(choice.logprobs.token_logprobs) for choice in scored]
    best = [scored[index].text for index in np.argsort(mean_log_probs)[::-1][:2]]
    assert texts(n=2, best_of=3, **drawn) == best


def test_a_request_without_max_tokens_writes_up_to_the_room_left(generator, server):
    url, _ = server
    prompt = "word " * 20  # 64 positions; the server's limit is 32 new tokens
    prompt_tokens = len(generator.encode([prompt], 1, "prompt")[0])
    answer = complete(url, model_id(generator), prompt=prompt).json()
    assert answer["usage"]["completion_tokens"] == 64 - prompt_tokens < 32
    assert answer["choices"][0]["finish_reason"] == "length"
    answer = complete(url, model_id(generator), prompt="A").json()
    assert answer["usage"]["completion_tokens"] == 32  # the server's limit, not the command line's 8


@pytest.mark.parametrize(
    "fields, status, message",
    [
        ({"n": 0}, 400, '"n" must be at least 1'),
        ({"n": 5}, 400, '"n" 5 times 1 prompts is 5 choices; the server decodes at most 4 together'),
        ({"n": 2, "best_of": 1}, 400, '"best_of" 1 is below "n" 2'),
        ({"best_of": 2, "stream": True}, 400, '"best_of" above "n" with "stream": true'),
        ({"presence_penalty": 2.5}, 400, "presence_penalty must be from -2 to 2"),
        ({"frequency_penalty": -3}, 400, "frequency_penalty must be from -2 to 2"),
        ({"logit_bias": {"5": 101}}, 400, '"logit_bias" must map token ids to numbers from -100 to 100'),
        ({"logit_bias": {"a": 1}}, 400, '"logit_bias" must map token ids'),
        ({"logit_bias": {"100000": 1}}, 400, '"logit_bias" names the token id 100000, outside the model'),
        # Token ids in ASCII digits alone, as OpenAI reads them: str.isdigit takes these, int() refuses or misreads
        ({"logit_bias": {"²": 1}}, 400, """"logit_bias" must map token ids to numbers from -100 to 100, not '²'"""),
        ({"logit_bias": {"٣": 1}}, 400, """"logit_bias" must map token ids to numbers from -100 to 100, not '٣'"""),
        (
            {"logit_bias": {"9" * 5000: 1}},
            400,
            '"logit_bias" names the token id 99999999999999999999... (5000 digits)',
        ),
        ({"logprobs": 6}, 400, '"logprobs" must be from 0 to 5'),
        ({"echo": 1}, 400, '"echo" must be true or false'),
        ({"logprobs": 1, "stream": True}, 400, '"logprobs" and "max_tokens": 0 are not supported with "stream": true'),
        ({"max_tokens": -1}, 400, '"max_tokens" must be 0 (the prompt alone, echoed or scored) or more'),
        ({"max_tokens": 33}, 400, "max_tokens 33 exceeds this server's limit of 32"),
        ({"max_tokens": 30, "prompt": "word " * 40}, 400, "exceeds the model's 64 positions"),
        ({"temperature": -1}, 400, "temperature must be 0 (greedy) or positive"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, '"stop" must be a non-empty string or a list of at most 4'),
        ({"prompt": [[1, 2], "A", 3]}, 400, '"prompt" must be a string, a list of token ids, or a non-empty list'),
        ({"prompt": [1, 10**6]}, 400, "prompt 1 holds the token id 1000000, outside the model's"),
        ({"prompt": ["A"] * 5}, 400, "5 prompts in one request; the server takes at most 4"),
        ({"stream_options": {"include_usage": True}}, 400, '"stream_options" may only be'),
        ({"stream": True, "stream_options": [1]}, 400, '"stream_options" may only be'),
        ({"temperature": 10**400}, 400, '"temperature" is out of range'),
        ({"seed": 2**31}, 400, "seed must be in [0, 2**31)"),
        ({"frequency_penalty_typo": 1}, 400, "unknown field 'frequency_penalty_typo'"),
        ({"model": "gpt-4"}, 404, "the model 'gpt-4' is not served here"),
        # Not text: a surrogate alone (JSON's escapes write it; UTF-8 cannot), in a prompt, a stop or a field's name
        ({"prompt": "A \ud800"}, 400, "the body holds a lone surrogate, \\ud800 (character 3 of 'A \\ud800')"),
        ({"prompt": ["A", "\udfff B"]}, 400, "the body holds a lone surrogate, \\udfff"),
        ({"stop": "\ud800"}, 400, "lone surrogate"),
        ({"\ud800": 1}, 400, "lone surrogate"),
        ({"prompt": [[[[[[[[[[[[[[[[["A"]]]]]]]]]]]]]]]]]}, 400, "the body nests lists or objects deeper than 16"),
        # Below the smallest normal float32, decoding flushes these to 0: top_p 0 kept no token, an empty completion
        ({"temperature": 1, "top_p": 1e-40}, 400, "top_p 1e-40 is below 1.1754944e-38, the smallest float32"),
        ({"temperature": 1e-40}, 400, "temperature 1e-40 is below 1.1754944e-38"),
    ],
)
def test_bad_completion_requests_are_refused_in_openai_error_shape(generator, server, fields, status, message):
    url, _ = server
    request = {"model": model_id(generator), "prompt": "A", **fields}
    # Written as JSON with escapes (httpx's json= writes UTF-8, which has no lone surrogates).
    answer = httpx.post(f"{url}/v1/completions", content=json.dumps(request), timeout=60)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert message in error["message"] and "\n" not in error["message"] and error["type"]


def torch_log_probs(model_dir, ids: list[int]) -> np.ndarray:
    """(len(ids) - 1, vocabulary) log-probabilities of the tiny GPT-2 in PyTorch after each token but the last."""
    torch_model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.log_softmax(torch_model(torch.tensor([ids[:-1]])).logits[0], dim=-1).numpy()


def test_echo_and_logprobs_are_the_model_s_for_the_prompt_and_the_new_tokens(generator, server, tiny_gpt2_dir):
    url, _ = server
    tokenizer = generator.tokenizer
    prompt_ids = tokenizer(PROMPTS[1])["input_ids"]
    # Two prompts, as the requests below decode them: the same compiled programs.
    new_ids, _ = sampling.generate_ids(generator.sampler, generator.params, [prompt_ids] * 2, 6)
    ids = prompt_ids + new_ids
    expected = torch_log_probs(tiny_gpt2_dir, ids)
    request = {"prompt": [PROMPTS[1], prompt_ids], "max_tokens": 6, "echo": True, "logprobs": 3}
    answer = complete(url, model_id(generator), **request).json()
    assert len(answer["choices"]) == 2 and answer["usage"]["completion_tokens"] == 12
    for choice in answer["choices"]:  # the prompt as a text and as its token ids
        logprobs = choice["logprobs"]
        assert choice["text"] == PROMPTS[1] + tokenizer.decode(new_ids)
        assert logprobs["tokens"] == [tokenizer.decode([token]) for token in ids]
        assert logprobs["text_offset"] == [len(tokenizer.decode(ids[:position])) for position in range(len(ids))]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing predicts it
        np.testing.assert_allclose(
            logprobs["token_logprobs"][1:], expected[np.arange(len(ids) - 1), ids[1:]], atol=1e-4
        )
        for position, top in enumerate(logprobs["top_logprobs"][1:]):
            most_likely = np.argsort(-expected[position])[:3]
            expected_top = {tokenizer.decode([token]): expected[position, token] for token in most_likely}
            expected_top[logprobs["tokens"][position + 1]] = expected[position, ids[position + 1]]
            assert top == pytest.approx(expected_top, abs=1e-4)

    # Without echo: the new tokens alone, their offsets counted in the new text.
    answer = complete(url, model_id(generator), prompt=[prompt_ids] * 2, max_tokens=6, logprobs=0).json()
    choice = answer["choices"][1]
    assert choice["text"] == tokenizer.decode(new_ids)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([token]) for token in new_ids]
    assert choice["logprobs"]["text_offset"][0] == 0
    expected_new = expected[np.arange(len(prompt_ids) - 1, len(ids) - 1), new_ids]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], expected_new, atol=1e-4)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # the token itself, none more likely


def test_max_tokens_0_echoes_and_scores_the_prompts_alone(generator, server, tiny_gpt2_dir):
    url, _ = server
    prompts = [generator.tokenizer(prompt)["input_ids"] for prompt in PROMPTS[:2]]
    answer = complete(url, model_id(generator), prompt=prompts, max_tokens=0, echo=True, logprobs=1).json()
    prompt_tokens = sum(map(len, prompts))
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    for ids, choice in zip(prompts, answer["choices"]):
        assert choice["text"] == generator.tokenizer.decode(ids) and choice["finish_reason"] == "length"
        expected = torch_log_probs(tiny_gpt2_dir, ids)[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], expected, atol=1e-4)
    [choice] = complete(url, model_id(generator), prompt="A", max_tokens=0).json()["choices"]
    assert (choice["text"], choice["logprobs"]) == ("", None)


def test_a_body_over_1_mib_or_not_json_is_refused_with_400(server):
    url, _ = server
    nested = b"[" * 100_000 + b"]" * 100_000  # beyond what Python's JSON reader follows
    for body, message in [
        (b"x" * (server_requests.MAX_REQUEST_BYTES + 1), "longer than 1048576 bytes"),
        (b"{", "not JSON"),
        (nested, "the body nests lists or objects deeper than 16 levels"),
    ]:
        answer = httpx.post(f"{url}/v1/completions", content=body, timeout=60)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"]


def requests_answered(url: str, path: str, status: int) -> float:
    metrics = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    requests = next(family for family in metrics if family.name == "flax_lm_requests")
    labels = {"path": path, "status": str(status)}
    return sum(sample.value for sample in requests.samples if sample.labels == labels)


@pytest.mark.parametrize(
    "path, encode, fields",
    [
        ("/v1/completions", "encode", {"prompt": "A"}),
        ("/v1/chat/completions", "encode_conversations", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_a_failure_in_the_server_is_a_500_in_openai_error_shape_and_is_counted(
    generator, server, monkeypatch, path, encode, fields
):
    url, _ = server
    before = requests_answered(url, path, 500)

    def failing_encode(*arguments):
        raise RuntimeError("a bug")

    monkeypatch.setattr(generator, encode, failing_encode)
    answer = httpx.post(f"{url}{path}", json={"model": model_id(generator), "max_tokens": 3, **fields}, timeout=60)
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "server_error" and "RuntimeError" in answer.json()["error"]["message"]
    assert requests_answered(url, path, 500) == before + 1


@pytest.mark.parametrize(
    "token_id",
    ["²", "¹", "٣", "9" * 5000, "100000"],
    ids=["superscript two", "superscript one", "Arabic-Indic three", "5000 digits", "past the vocabulary"],
)
def test_a_logit_bias_of_no_token_id_is_a_400_in_openai_error_shape_on_the_chat_endpoint(generator, server, token_id):
    """As on /v1/completions: a key of digits that are not ASCII, or past the vocabulary, is the client's mistake."""
    url, _ = server
    request = {"model": model_id(generator), "messages": [{"role": "user", "content": "Hi"}]}
    answer = httpx.post(f"{url}/v1/chat/completions", json={**request, "logit_bias": {token_id: 1}}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "logit_bias") and "\n" not in error["message"]


def test_a_client_that_leaves_in_the_middle_of_its_body_is_counted_without_a_traceback(server, caplog):
    url, _ = server
    before = requests_answered(url, "/v1/completions", server_requests.CLIENT_LEFT)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        time.sleep(0.2)  # the server has begun reading the body
    wait_until(lambda: requests_answered(url, "/v1/completions", server_requests.CLIENT_LEFT) == before + 1)
    assert "Traceback" not in caplog.text and not [
        record for record in caplog.records if record.levelno >= logging.ERROR
    ]


def test_health_models_and_metrics_answer(generator, server):
    url, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == model_id(generator)
    complete(url, model_id(generator), prompt="A", max_tokens=3)
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    names = {family.name for family in text_string_to_metric_families(metrics.text)}
    assert {
        "flax_lm_requests",
        "flax_lm_generated_tokens",
        "flax_lm_prompt_tokens",
        "flax_lm_queued_requests",
        "flax_lm_batch_rows",
        "flax_lm_request_duration_seconds",
    } <= names
    assert 'flax_lm_requests_total{path="/v1/completions",status="200"}' in metrics.text


# Values a client may send in any field, of every JSON type: out of range, of the wrong type, not finite, not text,
# digits that are not ASCII ("²", "٣"), numbers of thousands of digits, and the fields' own good values.
HOSTILE_ATOMS = [
    None, True, False, 0, 1, -1, 3, 5, 100, 101, -101, 2**31, -(2**63), 10**400, 0.5, -0.0, 1e-40, 1e308,
    float("nan"), float("inf"), float("-inf"), "", "A", "²", "¹", "٣", "３", "+3", " 3", "0x10", "9" * 5000, "\ud800",
    "gpt-4", "user", "assistant", "text", "none", "include_usage",
]  # fmt: skip
DIGIT_LIKE = "0123456789²³¹٠١٢٣٤۴५০๑０１"


def hostile_value(draw, depth: int = 0):
    """A random JSON value (what json.loads can give) built of HOSTILE_ATOMS, lists and objects, whose keys are field
    names or token ids as a client may write them (DIGIT_LIKE, or thousands of digits)."""
    kind = draw.random()
    if depth > 3 or kind < 0.5:
        return draw.choice(HOSTILE_ATOMS)
    if kind < 0.7:
        return [hostile_value(draw, depth + 1) for _ in range(draw.randrange(6))]
    keys = [
        "".join(draw.choices(DIGIT_LIKE, k=draw.randrange(1, 4))),
        "".join(draw.choices(DIGIT_LIKE[:10], k=draw.choice([1, 2, 10, 11, 5000]))),
        draw.choice([atom for atom in HOSTILE_ATOMS if isinstance(atom, str)]),
    ]
    numbers = [atom for atom in HOSTILE_ATOMS if type(atom) in (int, float)]  # a bias, a setting
    return {
        draw.choice(keys): draw.choice(numbers) if draw.random() < 0.5 else hostile_value(draw, depth + 1)
        for _ in range(draw.randrange(1, 4))
    }


def test_the_request_parsers_answer_any_json_with_a_request_error_or_a_request(generator_free_limits):
    """A seeded fuzz of the three parsers: requests of 1 to 3 random fields (those the endpoint reads, or any other),
    each of a random hostile value, around a good request so that the later checks are reached, and now and then a
    body that is no object. Each parser returns, or refuses with RequestError (a 400 in the endpoint's error shape);
    any other exception would be a 500. What a parser returns holds token ids that are ids (within int32)."""
    draw = random.Random(0)
    limits = generator_free_limits
    endpoints = {  # a good request, its fields, and its parser
        "/": ({"prompt": "A"}, server_requests.REQUEST_FIELDS, server_requests.parse_generate_request),
        "/v1/completions": (
            {"model": "tiny", "prompt": "A"},
            server_requests.COMPLETION_FIELDS | set(server_requests.UNSUPPORTED_COMPLETION_FIELDS),
            lambda request, limits: server_requests.parse_completion_request(request, "tiny", limits),
        ),
        "/v1/chat/completions": (
            {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
            server_requests.CHAT_FIELDS | set(server_requests.UNSUPPORTED_CHAT_FIELDS),
            lambda request, limits: server_requests.parse_chat_request(request, "tiny", limits),
        ),
    }
    every_field = sorted(set().union(*(fields for _, fields, _ in endpoints.values())))
    answered = collections.Counter()
    for path, (good, fields, parse) in endpoints.items():
        # Each field alone, then a few together (the endpoint's or any), now and then a body that is no object.
        draws = [[name] for name in sorted(fields) for _ in range(120)]
        draws += [draw.sample(sorted(fields) if draw.random() < 0.9 else every_field, 3) for _ in range(600)]
        for names in draws:
            request = {**good, **{name: hostile_value(draw) for name in names}}
            if draw.random() < 0.01:
                request = hostile_value(draw)
            try:
                server_requests.check_json_value(request)
                parsed = parse(request, limits)
            except server_requests.RequestError:
                answered[path, "refused"] += 1
                continue
            answered[path, "parsed"] += 1
            # A token id is named in ASCII digits, as OpenAI reads it (not "٣" for 3), and is an id (within int32).
            assert all(key.isascii() and key.isdigit() for key in request.get("logit_bias") or {}), request
            sampling_of = parsed[1] if isinstance(parsed, tuple) else parsed.sampling
            for token_id, bias in sampling_of.logit_bias:
                assert type(token_id) is int and 0 <= token_id < 2**31 and -100 <= bias <= 100, request
    # The fuzz reached both outcomes on every endpoint (else it tested less than it says).
    assert all(answered[path, outcome] >= 50 for path in endpoints for outcome in ("refused", "parsed")), answered
