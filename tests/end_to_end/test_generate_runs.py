"""generate_flax.py run as a user runs it: prompts from the command line and stdin, and the server in a process of
its own."""

import io
import json
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import REPO_DIR, server_process
from test_generate import OFFLINE_ENV, PROMPTS

import generate_flax
from flax_lm.generation import sampling


def run_generate(*args, stdin=None):
    command = [sys.executable, str(REPO_DIR / "generate_flax.py"), *map(str, args)]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, env=OFFLINE_ENV, timeout=300)


def test_command_line_generates_from_prompts_and_stdin(generator, tiny_gpt2_dir, monkeypatch, capsys):
    expected = generator.generate(PROMPTS, sampling.Sampling(10))
    arguments = ["--model_name_or_path", tiny_gpt2_dir, "--max_new_tokens", 10, "--json_output", "--batch_size", 2]
    from_flags = run_generate(*arguments, *[item for prompt in PROMPTS for item in ("--prompt", prompt)])
    assert from_flags.returncode == 0, from_flags.stderr[-3000:]
    lines = [json.loads(line) for line in from_flags.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS
    assert [line["text"] for line in lines] == [result["text"] for result in expected]
    assert all(line["new_tokens"] == 10 and line["finish_reason"] == "length" for line in lines)

    # The same prompts on stdin, in this process (the command line is the same but for where they come from).
    monkeypatch.setattr(sys, "argv", ["generate_flax.py", *map(str, arguments)])
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(PROMPTS) + "\n"))
    generate_flax.main()
    assert capsys.readouterr().out == from_flags.stdout


def post(url, content, timeout=60):
    body = content if isinstance(content, bytes) else json.dumps(content).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_server_answers_requests_and_refuses_bad_ones_with_400(generator, tiny_gpt2_dir, tmp_path):
    arguments = ["--batch_size", 4, "--max_new_tokens", 8, "--max_new_tokens_limit", 32]
    with server_process(tiny_gpt2_dir, tmp_path / "server.log", *arguments) as (_, url, _):
        assert url.startswith("http://127.0.0.1:")

        expected = generator.generate(PROMPTS, sampling.Sampling(8))
        status, answer = post(url, {"prompts": PROMPTS})  # max_new_tokens from the command line
        assert status == 200
        assert answer["texts"] == [result["text"] for result in expected]
        assert answer["new_tokens"] == [8, 8, 8]
        assert answer["prompt_tokens"] == [len(ids) for ids in generator.encode(PROMPTS, 8, "prompt")]

        sampled = {"prompt": PROMPTS[0], "max_new_tokens": 8, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 5}
        status, first = post(url, sampled)
        assert status == 200 and post(url, sampled)[1] == first

        bad_requests = {
            b"not json": "not JSON",
            b'["a list"]': "must be a JSON object",
            json.dumps({"prompt": "A", "max_tokens": 5}).encode(): "unknown field 'max_tokens'",
            json.dumps({"prompt": "A", "max_new_tokens": 33}).encode(): "exceeds this server's limit of 32",
            json.dumps({"prompt": "word " * 60, "max_new_tokens": 8}).encode(): "exceeds the model's 64 positions",
            json.dumps({"prompts": ["A"] * 5}).encode(): "the server takes at most 4",
            json.dumps({"prompt": "A", "temperature": "hot"}).encode(): '"temperature" must be a number',
        }
        for body, reason in bad_requests.items():
            status, answer = post(url, body)
            assert status == 400 and reason in answer["error"] and "\n" not in answer["error"]
        assert post(url, {"prompts": PROMPTS, "max_new_tokens": 8})[1]["texts"] == [r["text"] for r in expected]


def test_sigterm_answers_the_requests_in_flight_and_exits_0(tiny_gpt2_dir, tmp_path):
    arguments = ["--batch_size", 1, "--max_new_tokens", 8, "--max_new_tokens_limit", 48]
    with server_process(tiny_gpt2_dir, tmp_path / "server.log", *arguments) as (server, url, log):
        accepted = threading.Semaphore(0)

        def stream(number: int) -> list[str]:
            request = {"model": str(tiny_gpt2_dir), "prompt": f"A {number}", "max_tokens": 48, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as response:
                accepted.release()  # the answer has begun: the request is in flight
                return [line for line in response.iter_lines() if line]

        with ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(stream, number) for number in range(6)]
            for _ in answers:
                assert accepted.acquire(timeout=120)
            server.send_signal(signal.SIGTERM)
            answers = [answer.result() for answer in answers]
        assert server.wait(timeout=60) == 0
        for events in answers:
            last_choice = json.loads(events[-2].removeprefix("data: "))["choices"][0]
            assert events[-1] == "data: [DONE]" and last_choice["finish_reason"] in ("length", "stop")
        log.seek(0)
        stopped = re.findall(r"Stopped on SIGTERM, after answering the (\d+) requests in flight", log.read())
        assert len(stopped) == 1 and int(stopped[0]) >= 1
