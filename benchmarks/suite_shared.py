"""What both sides of benchmarks/gpu_suite.py measure alike, with no framework imported (numpy and the standard
library only), so that importing it costs neither side's time to the first step anything: the clock from the
process's start, the peak memory, the packed prompt/completion rows the fine-tuning rows train on, and the
span-corrupted batch of the T5 row.
"""

import os
import resource
import time

import numpy as np

# T5's: <pad>=0 (the decoder's start), </s>=1, <unk>=2; the sentinels <extra_id_0>, <extra_id_1>, ... numbered down
# from the highest id.
T5_EOS_TOKEN_ID, T5_SENTINELS = 1, 100

# The token ids of the packed examples: each example begins with BOS (a Llama tokenizer's <s>, where document
# attention starts a document) and ends with EOS; the ids of prompts and completions lie above them.
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2


def seconds_since_process_start() -> float | None:
    """Seconds since this process started (Linux: from /proc), so the interpreter's start and the imports count."""
    try:
        with open("/proc/self/stat") as file:
            start_ticks = int(file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def peak_resident_bytes() -> int:
    """The most memory this process has held resident so far (on a CPU, where there is no device allocator to ask)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes


def packed_example_rows(batch_size: int, sequence_length: int, vocab_size: int, seed: int = 0) -> dict:
    """Rows of prompt/completion examples packed whole, as run_clm_flax.py --packing --completion_only_loss makes them
    (flax_lm/data/finetune_examples.py, run_clm_flax.example_rows), from random ids: each example is BOS, a prompt,
    a completion and EOS; the loss weights are 1 on the completion and its EOS, 0 elsewhere; the positions restart at
    each example (what transformers reads packed sequences from); the room after the last example is padding of
    weight 0. Prompts and completions are 1/32 to 1/4 of a row long each, so a row holds several examples."""
    rng = np.random.default_rng(seed)
    input_ids = np.full((batch_size, sequence_length), EOS_TOKEN_ID, np.int32)
    weights = np.zeros((batch_size, sequence_length), np.float32)
    positions = np.zeros((batch_size, sequence_length), np.int32)
    shortest, longest = max(1, sequence_length // 32), max(2, sequence_length // 4)
    for row in range(batch_size):
        filled = last_start = 0
        while True:
            prompt, completion = rng.integers(shortest, longest + 1, size=2)
            length = 1 + prompt + completion + 1
            if filled + length > sequence_length:
                break
            example = np.concatenate(
                [[BOS_TOKEN_ID], rng.integers(EOS_TOKEN_ID + 1, vocab_size, prompt + completion), [EOS_TOKEN_ID]]
            )
            input_ids[row, filled : filled + length] = example
            weights[row, filled + 1 + prompt : filled + length] = 1.0
            positions[row, filled : filled + length] = np.arange(length)
            last_start, filled = filled, filled + length
        # The padding continues the last example's positions: it attends as part of it, as in the project's model.
        positions[row, filled:] = np.arange(filled - last_start, sequence_length - last_start)
    return {"input_ids": input_ids, "weights": weights, "position_ids": positions}


def span_corrupted_batch(batch_size: int, input_length: int, vocab_size: int) -> dict:
    """The batch benchmark_t5.py trains the project's T5 on, made alike for its peer: rows of random ordinary tokens
    (past <pad>, </s> and <unk>, below the sentinels) of the length whose span-corrupted input is `input_length`
    long, corrupted as run_t5_mlm_flax.py's BatchMaker corrupts a first batch (seed (0,), rows numbered from 0).
    {"input_ids": (rows, input_length), "labels": (rows, target length), "row_length": tokens of text in a row}."""
    # flax_lm's span corruption (numpy alone), imported here: only the T5 row's peer needs it.
    from flax_lm.data.span_corruption import SpanCorruption, corrupt_spans, span_corruption_lengths

    corruption = SpanCorruption()
    row_length, _ = span_corruption_lengths(input_length, corruption)
    generator = np.random.default_rng(0)
    rows = generator.integers(3, vocab_size - T5_SENTINELS, (batch_size, row_length), dtype=np.int32)
    sentinel_ids = tuple(range(vocab_size - 1, vocab_size - 1 - T5_SENTINELS, -1))
    inputs, targets = corrupt_spans(rows, corruption, sentinel_ids, T5_EOS_TOKEN_ID, (0,), np.arange(batch_size))
    return {"input_ids": inputs, "labels": targets, "row_length": row_length}
