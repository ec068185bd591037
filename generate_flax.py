#!/usr/bin/env python3
"""Generate text with a causal language model (GPT-2, Llama) in JAX/Flax: from prompts on the command line, in a
file or on stdin, or as an HTTP server.

Loads any model directory of a model type run_clm_flax.py trains, with config.json, model.safetensors and tokenizer
files, as run_clm_flax.py and transformers write them (or a hub name); a model of an experiment's own code with
--model_file. Prompts are decoded together in batches, left-padded to a
common length; a key/value cache makes each new token cost one position, and the whole decoding loop is one
compiled XLA program per shape (batch, prompt length and new tokens are rounded up to powers of two, so a
few shapes serve all requests). Decoding is greedy by default (--temperature 0), or draws with a
temperature, top-k and top-p, reproducibly from --seed; it stops at the end-of-text token.

A T5 (an encoder-decoder) answers each prompt with the text its decoder writes for it, printed alone
(flax_lm/generation/seq2seq.py: greedy, drawn or by beam search; no --serve or --chat):

    ./generate_flax.py --model_name_or_path t5-run --prompt "The <extra_id_0> walks in <extra_id_1> park"

    ./generate_flax.py --model_name_or_path gpt2-run --prompt "def main(" --prompt "import " --max_new_tokens 40
    ./generate_flax.py --model_name_or_path gpt2-run --prompt_file prompts.txt --temperature 0.8 --top_p 0.95
    ./generate_flax.py --model_name_or_path gpt2-run --serve --port 8000
    curl -s localhost:8000/v1/completions -H "Content-Type: application/json" \
        -d '{"model": "gpt2-run", "prompt": "def main(", "max_tokens": 40, "temperature": 0.8, "seed": 1}'

The server (flax_lm/server/app.py) speaks the OpenAI completions API, streaming on request, with "echo" and "logprobs"
(so that lm-evaluation-harness's local-completions backend scores tasks against it), and this script's own JSON API;
requests that arrive together are decoded together, each by its own settings.

The models and the sampler are run_clm_flax.py's own (flax_lm.models, flax_lm.generation.sampling): a model trained
there decodes here exactly as it evaluated. The loaded model that answers prompts and requests, Generator, is in
flax_lm/server/generator.py.
"""

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import flax_lm  # noqa: F401  first: where PyTorch is missing, it keeps transformers from warning about it on import

# isort: split

import jax
import transformers
from transformers import HfArgumentParser

from flax_lm.command_line.model_loading import model_loading
from flax_lm.devices.processes import LOG_FORMAT
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.generation.sampling import Sampling
from flax_lm.server.app import listening_socket, serve
from flax_lm.server.generator import Generator, Seq2SeqGenerator, is_encoder_decoder, load_model
from flax_lm.server.requests import Limits

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------


MODEL_FILE_HELP = (
    "The model module of the experiment that trained the model, where it was its own (run_clm_flax.py --model_file): "
    "its export holds a copy of the file, flax_model.safetensors and a config naming it."
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        metadata={
            "help": "A causal LM (GPT-2, Llama) or a T5: a directory with config.json, model.safetensors and "
            "tokenizer files, or a hub name."
        }
    )
    model_file: str | None = field(default=None, metadata={"help": MODEL_FILE_HELP})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype of the weights and the computation: bfloat16 halves the memory, and is fast on TPUs and "
            "recent GPUs (on CPUs usually slower than float32). Logits are always float32.",
            "choices": ["float32", "bfloat16"],
        },
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded models are cached."})
    token: str | None = field(
        default=None, metadata={"help": "Hugging Face hub token for private models. Never logged."}
    )
    mesh_shape: str | None = field(
        default=None,
        metadata={
            "help": "Split the model over devices by attention heads, MLP columns and vocabulary: tensor=N, with N "
            "the number of devices (a model too big for one device's memory); a mixture of experts' experts too: "
            "expert=E or tensor=N,expert=E, with N x E the devices. Default: one device."
        },
    )
    allow_pickle_weights: bool = field(
        default=False,
        metadata={
            "help": "Also load a model that has only pytorch_model.bin (a pickle; needs PyTorch). Only for files "
            "you trust; safetensors needs no such opt-in."
        },
    )


@dataclass
class GenerationArguments:
    prompt: list[str] = field(
        default_factory=list,
        metadata={"help": "A prompt to continue; give it several times for several prompts.", "action": "extend"},
    )
    prompt_file: str | None = field(
        default=None,
        metadata={"help": "A text file of prompts, one per line; - reads them from stdin (as does giving no prompt)."},
    )
    max_new_tokens: int = field(
        default=50,
        metadata={"help": "Tokens to generate after each prompt, at most (fewer at the end-of-text token)."},
    )
    temperature: float = field(
        default=0.0,
        metadata={
            "help": "0 takes the most likely token (greedy decoding); above 0, tokens are drawn, the more "
            "freely the higher."
        },
    )
    top_k: int = field(default=0, metadata={"help": "Draw from the k most likely tokens only; 0 for all of them."})
    top_p: float = field(
        default=1.0,
        metadata={"help": "Draw from the most likely tokens whose probabilities add up to top_p (nucleus sampling)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the draws: the same seed gives the same texts."})
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "Above 1, makes every token of the prompt and of the text so far less likely (transformers' "
            "repetition_penalty: a positive logit divided by it, a negative one multiplied); 1 for none."
        },
    )
    no_repeat_ngram_size: int = field(
        default=0,
        metadata={"help": "Never write an n-gram of this many tokens twice (prompt included); 0 for no such rule."},
    )
    min_new_tokens: int = field(
        default=0, metadata={"help": "Write at least this many tokens before the end-of-text token may come."}
    )
    num_beams: int = field(
        default=1,
        metadata={
            "help": "Beam search: keep this many of the most likely continuations at each step and write the most "
            "likely whole one (with --temperature 0); 1 for none."
        },
    )
    length_penalty: float = field(
        default=1.0,
        metadata={
            "help": "With --num_beams: a finished beam's score is its log-probability over its length to this power; "
            "above 0 favours longer texts, below 0 shorter ones."
        },
    )
    early_stopping: str = field(
        default="false",
        metadata={
            "help": "With --num_beams, when beam search ends (transformers' early_stopping): true, as soon as "
            "num_beams beams are finished; false, once no running beam is likely to beat them; never, once none can.",
            "choices": ["false", "true", "never"],
        },
    )
    stop: list[str] = field(
        default_factory=list,
        metadata={
            "help": "End a text where it writes this string (cut before it); give it several times for several.",
            "action": "extend",
        },
    )
    batch_size: int = field(
        default=8,
        metadata={
            "help": "Prompts decoded together. With --serve: the most rows a batch of requests shares (1 serves "
            "requests one at a time), and the most prompts one request may carry."
        },
    )
    json_output: bool = field(
        default=False,
        metadata={"help": "Print one JSON line per prompt (prompt, text, token counts) instead of the texts."},
    )
    chat: bool = field(
        default=False,
        metadata={
            "help": "Converse with a chat model (one with a chat template, such as run_clm_flax.py fine-tunes on "
            "conversations): each prompt is a user's turn and the output is the assistant's reply, which ends at its "
            "end of turn. A --prompt_file ending in .jsonl holds a conversation per line instead: a JSON list of "
            'messages such as [{"role": "user", "content": "Hi"}], or an object with one under "messages".'
        },
    )


@dataclass
class ServerArguments:
    serve: bool = field(
        default=False,
        metadata={"help": "Answer HTTP requests instead of reading prompts; see the module docstring."},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on; 0.0.0.0 for every interface."})
    port: int = field(default=8000, metadata={"help": "Port to listen on; 0 picks a free one (printed)."})
    max_new_tokens_limit: int = field(
        default=256, metadata={"help": "The most new tokens a request may ask for per prompt."}
    )
    max_queued_requests: int = field(
        default=64,
        metadata={
            "help": "Requests that may wait for a batch while others decode; more are answered 503 with Retry-After."
        },
    )


def parse_generate_arguments() -> tuple[ModelArguments, GenerationArguments, ServerArguments]:
    parser = HfArgumentParser((ModelArguments, GenerationArguments, ServerArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        if not os.path.isfile(sys.argv[1]):
            raise UsageError(f"arguments file {sys.argv[1]} does not exist")
        try:
            return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
        except (ValueError, json.JSONDecodeError) as error:
            raise UsageError(f"arguments file {sys.argv[1]}: {error}") from None
    *arguments, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise UsageError(f"unknown argument {unknown[0]}; see --help for the arguments this script takes")
    return tuple(arguments)


def sampling_of(generation_args) -> Sampling:
    names = (
        "max_new_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty", "no_repeat_ngram_size",
        "min_new_tokens", "num_beams", "length_penalty",
    )  # fmt: skip
    early_stopping = {"false": False, "true": True}.get(generation_args.early_stopping, generation_args.early_stopping)
    return Sampling(**{name: getattr(generation_args, name) for name in names}, early_stopping=early_stopping)


def check_arguments(generation_args, server_args):
    if problem := sampling_of(generation_args).problem("--"):
        raise UsageError(problem)
    if generation_args.batch_size < 1:
        raise UsageError("--batch_size must be at least 1")
    if generation_args.num_beams > 1 and generation_args.stop:
        raise UsageError(
            "--num_beams with --stop: beam search here ends at the end-of-text token or --max_new_tokens; leave out "
            "--stop, or pass --num_beams 1"
        )
    if not all(generation_args.stop):
        raise UsageError("--stop takes a non-empty string")
    if server_args.serve:
        if generation_args.prompt or generation_args.prompt_file:
            raise UsageError("--serve takes its prompts from HTTP requests; leave out --prompt and --prompt_file")
        if generation_args.chat:
            raise UsageError("--serve answers conversations on POST /v1/chat/completions as it is; leave out --chat")
        defaults = GenerationArguments()
        per_request = ["num_beams", "length_penalty", "early_stopping", "repetition_penalty", "no_repeat_ngram_size"]
        per_request += ["min_new_tokens", "stop"]
        if given := [name for name in per_request if getattr(generation_args, name) != getattr(defaults, name)]:
            raise UsageError(
                f"--serve with --{given[0]}: the server decodes each request by its own fields (OpenAI's), not by "
                f"this flag; leave out --{given[0]}"
            )
        if not 0 <= server_args.port < 65536:
            raise UsageError(f"--port {server_args.port} is not a port number; use 1 to 65535, or 0 for any free one")
        if server_args.max_new_tokens_limit < generation_args.max_new_tokens:
            raise UsageError("--max_new_tokens (the default of requests) exceeds --max_new_tokens_limit; lower it")
        if server_args.max_queued_requests < 1:
            raise UsageError("--max_queued_requests must be at least 1")
    elif generation_args.prompt and generation_args.prompt_file:
        raise UsageError("give prompts with --prompt or --prompt_file, not both")


def read_prompts(generation_args) -> list[str]:
    if generation_args.prompt:
        return generation_args.prompt
    if generation_args.prompt_file in (None, "-"):
        if generation_args.prompt_file is None and sys.stdin.isatty():
            raise UsageError("no prompts: pass --prompt TEXT, --prompt_file FILE, or pipe prompts in, one per line")
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(generation_args.prompt_file, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read --prompt_file {generation_args.prompt_file}: {error}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError("the prompts are empty: write one prompt per line")
    return prompts


def read_conversations(generation_args) -> list:
    """With --chat: each prompt as a conversation of one user's turn, or the conversations of a .jsonl --prompt_file
    (checked when they are rendered)."""
    prompts = read_prompts(generation_args)
    if not (generation_args.prompt_file or "").endswith(".jsonl"):
        return [[{"role": "user", "content": prompt}] for prompt in prompts]
    conversations = []
    for number, line in enumerate(prompts, 1):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(
                f"conversation {number} of --prompt_file {generation_args.prompt_file} is not JSON ({error}); write "
                'one conversation per line, such as [{"role": "user", "content": "Hi"}]'
            ) from None
        conversations.append(value.get("messages") if isinstance(value, dict) else value)
    return conversations


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def main():
    model_args, generation_args, server_args = parse_generate_arguments()
    check_arguments(generation_args, server_args)
    logging.basicConfig(format=LOG_FORMAT, level=logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    # JAX logs at INFO each accelerator backend it fails to find (libtpu on every GPU or CPU machine).
    logging.getLogger("jax").setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    if server_args.serve:
        prompts = None
    else:
        prompts = read_conversations(generation_args) if generation_args.chat else read_prompts(generation_args)
    # Taken before the model loads, so that an address in use is said at once.
    listener = listening_socket(server_args.host, server_args.port) if server_args.serve else None

    model_file, mesh_shape = model_args.model_file, model_args.mesh_shape
    model, params, tokenizer = load_model(model_loading(model_args), mesh_shape, model_file, model_args.dtype)
    generator_class = Seq2SeqGenerator if is_encoder_decoder(model) else Generator
    generator = generator_class(model, params, tokenizer, generation_args.batch_size)
    if not generator.continues_prompt and (server_args.serve or generation_args.chat):
        raise UsageError(f"--{'serve' if server_args.serve else 'chat'} is for causal LMs; a T5 answers --prompt")
    logger.info(
        "Loaded %s: %.1fM parameters in %s on %s",
        model_args.model_name_or_path,
        sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)) / 1e6,
        model_args.dtype,
        jax.devices()[0] if model.mesh is None else f"a mesh of {dict(model.mesh.shape)}",
    )
    sampling = sampling_of(generation_args)
    if server_args.serve:
        # Compile the most common shape before the first request arrives.
        generator.generate([""], sampling)
        limits = Limits(sampling, server_args.max_new_tokens_limit, generation_args.batch_size)
        serve(generator, limits, server_args.max_queued_requests, listener)
        return

    start = time.perf_counter()
    where = "--prompt" if generation_args.prompt else "line"
    try:
        if generation_args.chat:
            where = "conversation" if generation_args.prompt_file else where
            results = generator.reply(prompts, sampling, where, generation_args.stop)
        else:
            results = generator.generate(prompts, sampling, where, generation_args.stop)
    except ValueError as error:
        raise UsageError(str(error)) from None
    new_tokens = sum(result["new_tokens"] for result in results)
    elapsed = time.perf_counter() - start
    logger.info(
        "%d new tokens in %.2f s (%.1f tokens/s, compilation included)", new_tokens, elapsed, new_tokens / elapsed
    )
    for prompt, result in zip(prompts, results):
        if generation_args.json_output:
            print(json.dumps({"messages" if generation_args.chat else "prompt": prompt, **result}))
        elif generation_args.chat:
            print(result["text"], end="\n\n")  # the reply
        else:  # a causal LM's continuation, or what an encoder-decoder writes for the prompt
            print((prompt if generator.continues_prompt else "") + result["text"], end="\n\n")


if __name__ == "__main__":
    call_with_one_line_errors(main)
