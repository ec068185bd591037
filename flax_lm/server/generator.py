"""A loaded model that answers prompts, and conversations with a chat model: what generate_flax.py decodes from the
command line and its server answers requests with. load_model reads a model directory (or hub name) onto the device
or the tensor (and expert) mesh of --mesh_shape; Generator encodes the prompts, decodes them in batches and scores
sequences."""

import os
from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
from transformers import AutoConfig, AutoTokenizer

from flax_lm.data.chat import conversation_prompt_ids, stop_token_ids
from flax_lm.data.texts import ids_around_documents
from flax_lm.devices.mesh import create_mesh
from flax_lm.errors import UsageError, first_line
from flax_lm.evaluation.scoring import Scorer
from flax_lm.generation.sampling import DecodingBatch, Sampling, decode_rows, make_sampler
from flax_lm.generation.seq2seq import decode_sources, make_seq2seq_generate
from flax_lm.models import family_of
from flax_lm.models.huggingface import (
    ModelLoading,
    check_config_values,
    check_local_model_directory,
    read_exported_params,
)
from flax_lm.models.model_code import load_model_code
from flax_lm.server.request_queue import STEPS_PER_CHUNK, RowFinished, RowText
from flax_lm.training.lora import ADAPTER_CONFIG, adapter_base, with_adapter_merged
from flax_lm.training.train_state import abstract_model_params, parameter_shardings


def load_model(
    loading: ModelLoading, mesh_shape: str | None = None, model_file: str | None = None, dtype: str = "float32"
):
    """(model, parameters on the default device, tokenizer) of a model directory or hub name, split over the tensor
    and expert axes of `mesh_shape` where given, computed by `model_file` where given, in `dtype`. A PEFT LoRA
    adapter's directory (run_clm_flax.py --lora_rank's output) is its base model with the adapter merged in."""
    check_local_model_directory("--model_name_or_path", loading.model_name_or_path)
    adapter = (
        loading.model_name_or_path
        if os.path.isfile(os.path.join(loading.model_name_or_path, ADAPTER_CONFIG))
        else None
    )
    if adapter:
        loading = replace(loading, model_name_or_path=adapter_base(adapter))
        check_local_model_directory("the adapter's base_model_name_or_path", loading.model_name_or_path)
    source = loading.model_name_or_path

    def load(loader):
        try:
            return loader.from_pretrained(source, cache_dir=loading.cache_dir, token=loading.token)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load --model_name_or_path {source}: {first_line(error)}") from None

    config, tokenizer = load(AutoConfig), load(AutoTokenizer)
    if adapter:  # the tokenizer the adapter was trained with
        tokenizer = AutoTokenizer.from_pretrained(adapter)
    check_config_values(config, f"--model_name_or_path {source}")
    mesh = generation_mesh(mesh_shape)
    encoder_decoder = family_of(config.model_type) is not None and family_of(config.model_type).encoder_decoder
    model_code = load_model_code(
        config, model_file, True, "generate_flax.py", mesh, exports=False, encoder_decoder=encoder_decoder
    )
    dtype = jnp.dtype(dtype)
    model = model_code.module.MODEL_CLASS(config, dtype=dtype, param_dtype=dtype, mesh=mesh)
    boxed_params = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32), unbox=False)
    abstract_params = nn.meta.unbox(boxed_params)
    if mesh is not None:  # each tensor is read straight into its shards, never whole on one device
        abstract_params = jax.tree_util.tree_map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_params,
            parameter_shardings(boxed_params, mesh),
        )
    params = read_exported_params(source, loading, model_code, abstract_params)
    if adapter:
        params = with_adapter_merged(adapter, params, model_code.module)
    if mesh is None:
        return model, jax.device_put(params), tokenizer
    return model, jax.device_put(params, parameter_shardings(boxed_params, mesh)), tokenizer


def generation_mesh(mesh_shape: str | None):
    """The devices the model is split over (None: the default device alone). Decoding batches are too small to split
    by rows, so a mesh here has a tensor axis and, for a mixture of experts, an expert axis: whole rows on every
    device, and the experts split over the expert axis as in training (the tokens exchanged by all-to-all where the
    rows divide among its devices, flax_lm.models.shared.moe.exchanges_tokens)."""
    if mesh_shape is None:
        return None
    mesh = create_mesh(mesh_shape)
    if mesh.shape["data"] * mesh.shape["fsdp"] > 1:
        raise UsageError(
            f"--mesh_shape {mesh_shape}: generation splits the model over the tensor and expert axes alone; give "
            f"tensor={jax.device_count()} (all devices), or for a mixture of experts tensor and expert sizes that "
            "multiply to it, or make fewer devices visible"
        )
    return mesh


def is_encoder_decoder(model) -> bool:
    """Whether `model` is an encoder-decoder (T5), which Seq2SeqGenerator decodes; else Generator does."""
    return family_of(model.config.model_type).encoder_decoder


class Generator:
    """One loaded model answering batches of prompts, or of conversations with a chat model, and scoring token
    sequences (the server's logprobs)."""

    continues_prompt = True  # its text follows the prompt

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


class Seq2SeqGenerator:
    """An encoder-decoder (T5) answering batches of prompts: each prompt, encoded as its tokenizer encodes a text
    (T5's: </s> after it), is the source, and the text the decoder writes for it (greedy, drawn or by beam search,
    as Sampling says) is the answer, which does not continue the prompt."""

    continues_prompt = False

    def __init__(self, model, params, tokenizer, batch_size: int):
        self.model, self.params, self.tokenizer, self.batch_size = model, params, tokenizer, batch_size
        eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        self.stop_token_ids = [] if eos_token_id is None else [eos_token_id]
        self.decoding = make_seq2seq_generate(model, self.stop_token_ids)

    def generate(self, prompts: list[str], sampling: Sampling, where: str = "prompt", stop=()) -> list[dict]:
        """For each prompt: the text written for it, the count of its tokens and of the new ones, and why it stopped
        ("eos", "stop": a `stop` string, "length"), as Generator.generate gives them."""
        sources = [self.tokenizer(prompt)["input_ids"] or self.stop_token_ids[:1] for prompt in prompts]
        results = []
        for first in range(0, len(sources), self.batch_size):
            batch = sources[first : first + self.batch_size]
            samplings = [replace(sampling, prompt_index=first + row) for row in range(len(batch))]
            new_ids = decode_sources(self.decoding, self.params, batch, samplings, self.model.config.vocab_size)
            for row, (ids, tokens) in enumerate(zip(batch, new_ids)):
                ended = RowText(self.tokenizer, self.stop_token_ids, list(stop)).add(row, tokens, True)
                results.append(
                    {
                        "text": ended.text,
                        "prompt_tokens": len(ids),
                        "new_tokens": ended.new_tokens,
                        "finish_reason": ended.finish_reason,
                    }
                )
        return results
