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

    ./generate_flax.py --model_name_or_path gpt2-run --prompt "def main(" --prompt "import " --max_new_tokens 40
    ./generate_flax.py --model_name_or_path gpt2-run --prompt_file prompts.txt --temperature 0.8 --top_p 0.95
    ./generate_flax.py --model_name_or_path gpt2-run --serve --port 8000
    curl -s localhost:8000/v1/completions -H "Content-Type: application/json" \
        -d '{"model": "gpt2-run", "prompt": "def main(", "max_tokens": 40, "temperature": 0.8, "seed": 1}'

The server (flax_lm/server/app.py) speaks the OpenAI completions API, streaming on request, with "echo" and "logprobs"
(so that lm-evaluation-harness's local-completions backend scores tasks against it), and this script's own JSON API;
requests that arrive together are decoded together, each by its own settings.

The models and the sampler are run_clm_flax.py's own (flax_lm.models, flax_lm.generation.sampling): a model trained
there decodes here exactly as it evaluated.
"""

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace

import flax_lm  # noqa: F401  first: where PyTorch is missing, it keeps transformers from warning about it on import

# isort: split

import flax.linen as nn
import jax
import jax.numpy as jnp
import transformers
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

from flax_lm.command_line.model_loading import model_loading
from flax_lm.data.chat import conversation_prompt_ids, stop_token_ids
from flax_lm.data.texts import ids_around_documents
from flax_lm.devices.mesh import create_mesh
from flax_lm.devices.processes import LOG_FORMAT
from flax_lm.errors import UsageError, call_with_one_line_errors, first_line
from flax_lm.evaluation.scoring import Scorer
from flax_lm.generation.sampling import DecodingBatch, Sampling, decode_rows, make_sampler
from flax_lm.models.huggingface import check_config_values, check_local_model_directory, read_exported_params
from flax_lm.models.model_code import load_model_code
from flax_lm.server.app import listening_socket, serve
from flax_lm.server.request_queue import STEPS_PER_CHUNK, RowFinished, RowText
from flax_lm.server.requests import Limits
from flax_lm.training.train_state import abstract_model_params, parameter_shardings

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
            "help": "A causal LM (GPT-2, Llama): a directory with config.json, model.safetensors and tokenizer "
            "files, or a hub name."
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
            "the number of devices (a model too big for one device's memory). Default: one device."
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
# Model and generation
# ----------------------------------------------------------------------------------------------------


def load_model(model_args):
    """(model, parameters on the default device, tokenizer) of a model directory or hub name."""
    source = model_args.model_name_or_path
    check_local_model_directory("--model_name_or_path", source)

    def load(loader):
        try:
            return loader.from_pretrained(source, cache_dir=model_args.cache_dir, token=model_args.token)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load --model_name_or_path {source}: {first_line(error)}") from None

    config, tokenizer = load(AutoConfig), load(AutoTokenizer)
    check_config_values(config, f"--model_name_or_path {source}")
    mesh = generation_mesh(model_args.mesh_shape)
    model_code = load_model_code(config, model_args.model_file, True, "generate_flax.py", mesh, exports=False)
    dtype = jnp.dtype(model_args.dtype)
    model = model_code.module.MODEL_CLASS(config, dtype=dtype, param_dtype=dtype, mesh=mesh)
    boxed_params = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32), unbox=False)
    abstract_params = nn.meta.unbox(boxed_params)
    if mesh is not None:  # each tensor is read straight into its shards, never whole on one device
        abstract_params = jax.tree_util.tree_map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_params,
            parameter_shardings(boxed_params, mesh),
        )
    params = read_exported_params(source, model_loading(model_args), model_code, abstract_params)
    if mesh is None:
        return model, jax.device_put(params), tokenizer
    return model, jax.device_put(params, parameter_shardings(boxed_params, mesh)), tokenizer


def generation_mesh(mesh_shape: str | None):
    """The devices the model is split over (None: the default device alone). Decoding batches are too small to split
    by rows, so a mesh here has only its tensor axis."""
    if mesh_shape is None:
        return None
    mesh = create_mesh(mesh_shape)
    if mesh.shape["data"] * mesh.shape["fsdp"] > 1:
        raise UsageError(
            f"--mesh_shape {mesh_shape}: generation splits the model over a tensor axis alone; give "
            f"tensor={jax.device_count()} (all devices), or make fewer devices visible"
        )
    return mesh


class Generator:
    """One loaded model answering batches of prompts, or of conversations with a chat model, and scoring token
    sequences (the server's logprobs)."""

    def __init__(self, model, params, tokenizer, batch_size: int):
        self.model, self.params, self.tokenizer, self.batch_size = model, params, tokenizer, batch_size
        eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        self.eos_token_id = eos_token_id
        # A chat model's replies end at its end of turn, as its export's generation_config.json says to transformers.
        self.stop_token_ids = stop_token_ids(tokenizer, eos_token_id)
        self.sampler = make_sampler(model, self.stop_token_ids)
        self.scorer = Scorer(model, batch_size * model.config.max_position_embeddings, model.mesh)

    def encode(self, prompts: list[str | list[int]], max_new_tokens: int, where: str) -> list[list[int]]:
        """Token ids of each prompt: a text, started as the documents the model was trained on are
        (ids_around_documents: a Llama's BOS first; an empty GPT-2 text from the end-of-text token), or token ids
        already, taken as they are. Refuses prompts that leave no room for max_new_tokens within the model's
        positions, or hold ids outside its vocabulary (`where` names the prompt for the message)."""
        before_documents, _ = ids_around_documents(self.tokenizer)
        vocab_size = self.model.config.vocab_size
        encoded = []
        for number, prompt in enumerate(prompts, 1):
            if isinstance(prompt, list):
                if outside := [token_id for token_id in prompt if not 0 <= token_id < vocab_size]:
                    raise ValueError(
                        f"{where} {number} holds the token id {outside[0]}, outside the model's {vocab_size} tokens"
                    )
                encoded.append(prompt)
            else:
                ids = before_documents + self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                encoded.append(ids or [self.eos_token_id])
        return self.fitting(encoded, max_new_tokens, where)

    def encode_conversations(self, conversations: list, max_new_tokens: int, where: str) -> list[list[int]]:
        """Token ids that ask for the assistant's turn after each conversation (a list of messages with a role and
        content), rendered by the tokenizer's chat template (flax_lm.data.chat); refused as encode refuses prompts, and
        where the model has no chat template or a conversation is not one."""
        encoded = []
        for number, messages in enumerate(conversations, 1):
            try:
                encoded.append(conversation_prompt_ids(self.tokenizer, messages))
            except ValueError as error:
                raise ValueError(f"{where} {number} {error}") from None
        return self.fitting(encoded, max_new_tokens, where)

    def fitting(self, encoded: list[list[int]], max_new_tokens: int, where: str) -> list[list[int]]:
        positions = self.model.config.max_position_embeddings
        for number, ids in enumerate(encoded, 1):
            if len(ids) + max_new_tokens > positions:
                raise ValueError(
                    f"{where} {number} has {len(ids)} tokens, which with max_new_tokens {max_new_tokens} exceeds the "
                    f"model's {positions} positions; shorten it or lower max_new_tokens"
                )
        return encoded

    def generate(self, prompts: list[str], sampling: Sampling, where: str = "prompt", stop=()) -> list[dict]:
        """For each prompt: its continuation, the count of prompt and new tokens, and why it stopped ("eos",
        "stop": a `stop` string, "length"). A prompt's draws depend on the seed and its place in the list, not on
        the other prompts."""
        return self.continuations(self.encode(prompts, sampling.max_new_tokens, where), sampling, stop)

    def reply(self, conversations: list, sampling: Sampling, where: str = "conversation", stop=()) -> list[dict]:
        """For each conversation: the assistant's reply (up to its end of turn), as generate gives continuations."""
        prompt_ids = self.encode_conversations(conversations, sampling.max_new_tokens, where)
        return self.continuations(prompt_ids, sampling, stop)

    def continuations(self, prompt_ids: list[list[int]], sampling: Sampling, stop: list[str] = ()) -> list[dict]:
        results = []
        for first in range(0, len(prompt_ids), self.batch_size):
            batch = prompt_ids[first : first + self.batch_size]
            samplings = [replace(sampling, prompt_index=first + row) for row in range(len(batch))]
            for ids, ended in zip(batch, self.decode(batch, samplings, stop)):
                results.append(
                    {
                        "text": ended.text,
                        "prompt_tokens": len(ids),
                        "new_tokens": ended.new_tokens,
                        "finish_reason": ended.finish_reason,
                    }
                )
        return results

    def decode(self, prompt_ids: list[list[int]], samplings: list[Sampling], stop=()) -> list[RowFinished]:
        """How each prompt ends, decoded together: its text (cut before a `stop` string where one comes), and its
        new tokens (up to the one that completed the stop string, as transformers' stop_strings count them)."""
        texts = [RowText(self.tokenizer, self.stop_token_ids, list(stop)) for _ in prompt_ids]
        if samplings[0].num_beams > 1:  # one program to the end
            new_ids = decode_rows(self.sampler, self.params, prompt_ids, samplings)
            return [text.add(row, ids, True) for row, (text, ids) in enumerate(zip(texts, new_ids))]
        decoding = DecodingBatch(self.sampler, self.params, prompt_ids, samplings)
        # With stop strings, a look at the texts now and then ends the rows that wrote one.
        steps = STEPS_PER_CHUNK if stop else decoding.capacity
        while unfinished := [row for row, text in enumerate(texts) if text.result is None]:
            new_ids = decoding.advance(steps, ended=[row for row, text in enumerate(texts) if text.result])
            for row in unfinished:
                texts[row].add(row, new_ids[row], bool(decoding.finished[row]))
        return [text.result for text in texts]


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

    model, params, tokenizer = load_model(model_args)
    generator = Generator(model, params, tokenizer, generation_args.batch_size)
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
        else:
            print(prompt + result["text"], end="\n\n")


if __name__ == "__main__":
    call_with_one_line_errors(main)
