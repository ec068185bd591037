#!/usr/bin/env python3
"""How fast run_clm_flax.py tokenizes and packs a corpus, and how much memory and disk it takes, beside the
tokenizers library's own `encode_batch` on the same files.

For each corpus size (megabytes of text, made of the files of --shards in turn: the first files, then the same
files again under other names for sizes beyond them) and each number of workers it runs

    run_clm_flax.py --train_file FILES --packed_data_dir DIR --do_train false --do_eval false \\
        --preprocessing_num_workers N --block_size 128

in a fresh process with fresh caches (`datasets`' conversion of the files included where it makes one: not of
`.txt` files read as one document, as these are, which are read as they are) and reports the
seconds, megabytes of text a second (of the whole command, and of the tokenizing and packing alone, as
its log says), the peak memory of the whole process tree (the sum of the resident sizes of
the script and its workers, sampled four times a second; /usr/bin/time's figure is one process's alone) and the
disk the packed corpus and `datasets`' conversion take. Beside it, the rates of `encode_batch` and of
`encode_batch_fast` (ids alone, what the packing calls) in one process (tokenizers' own threads, pieces of
--piece_mb) over the first 20 MB of the same files, measured before each size: the packing cannot beat the
second on one worker.

    python benchmarks/benchmark_preprocessing.py --shards 'corpus/*.txt' --tokenizer DIR \\
        [--sizes 40 160 1600] [--workers 1 2] [--json results.json]

The machine's load (os.getloadavg) is reported before each run: measure on a quiet machine.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_files(shards: list[str], megabytes: float, directory: str) -> list[str]:
    """Files holding `megabytes` of text: the shards in turn, linked under new names once they are all used (so
    that each is a file of its own to the reader)."""
    files, total, number = [], 0, 0
    while total < megabytes * 1e6:
        shard = shards[number % len(shards)]
        if number < len(shards):
            files.append(shard)
        else:
            link = os.path.join(directory, f"copy-{number:05d}-{os.path.basename(shard)}")
            if not os.path.exists(link):
                os.symlink(os.path.abspath(shard), link)
            files.append(link)
        total += os.path.getsize(shard)
        number += 1
    return files


def tree_rss(process: psutil.Process) -> tuple[int, int]:
    """The resident bytes of a process and all its descendants, and those of them not backed by a file (resident
    pages of memory-mapped files, such as `datasets`' Arrow files, are page cache the kernel takes back as needed)."""
    total = anonymous = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            memory = member.memory_info()
        except psutil.NoSuchProcess:
            continue
        total, anonymous = total + memory.rss, anonymous + memory.rss - memory.shared
    return total, anonymous


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def pack(files: list[str], tokenizer: str, workers: int, scratch: str, piece_mb: float) -> dict:
    """One packing run in a fresh process: seconds, peak memory of the process tree, disk."""
    packed, cache = os.path.join(scratch, "packed"), os.path.join(scratch, "cache")
    shutil.rmtree(packed, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    command = [
        sys.executable, os.path.join(REPO_DIR, "run_clm_flax.py"), "--output_dir", os.path.join(scratch, "out"),
        "--config_name", tokenizer, "--tokenizer_name", tokenizer, "--train_file", *files,
        "--packed_data_dir", packed, "--cache_dir", cache, "--block_size", "128", "--do_train", "false",
        "--do_eval", "false", "--preprocessing_num_workers", str(workers), "--preprocessing_piece_mb", str(piece_mb),
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": REPO_DIR}
    started = time.monotonic()
    with open(os.path.join(scratch, "log.txt"), "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        process, peak, peak_anonymous = psutil.Process(child.pid), 0, 0
        while child.poll() is None:
            resident, anonymous = tree_rss(process)
            peak, peak_anonymous = max(peak, resident), max(peak_anonymous, anonymous)
            time.sleep(0.25)
    seconds = time.monotonic() - started
    if child.returncode != 0:
        raise SystemExit(f"packing failed; see {os.path.join(scratch, 'log.txt')}")
    with open(os.path.join(scratch, "log.txt")) as log:
        done = re.findall(r"Packed train: .*\(([\d.]+) MB/s\)", log.read())
    return {
        "seconds": seconds,
        "packing_mb_per_s": float(done[-1]) if done else None,  # the tokenizing and packing alone, as logged
        "peak_memory_mb": peak / 1e6,
        "peak_anonymous_memory_mb": peak_anonymous / 1e6,
        "packed_mb": directory_bytes(packed) / 1e6,
        "datasets_cache_mb": directory_bytes(cache) / 1e6,
    }


def encode_batch_rates(files: list[str], tokenizer: str, piece_mb: float) -> tuple[float, float]:
    """Megabytes of text a second that tokenizers' encode_batch, and its encode_batch_fast (ids without offsets,
    which the packing uses), encode in this process, pieces of `piece_mb` of the files' text at a time (cut at line
    ends), reading not counted; the two alternate piece by piece, so that both see the same load."""
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(tokenizer).backend_tokenizer
    seconds, fast_seconds, size = 0.0, 0.0, 0
    for path in files:
        with open(path, encoding="utf-8") as file:
            while lines := file.readlines(int(piece_mb * 2**20)):
                texts = ["".join(lines[start : start + 64]) for start in range(0, len(lines), 64)]
                started = time.monotonic()
                backend.encode_batch(texts, add_special_tokens=False)
                seconds += time.monotonic() - started
                started = time.monotonic()
                backend.encode_batch_fast(texts, add_special_tokens=False)
                fast_seconds += time.monotonic() - started
                size += sum(len(text.encode()) for text in texts)
    return size / 1e6 / seconds, size / 1e6 / fast_seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="a glob of the text files to build the corpora of")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory with a config (create_config.py)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[40, 160, 1600], help="corpus sizes, MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--piece_mb", type=float, default=1.0, help="--preprocessing_piece_mb")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    shards = sorted(glob.glob(args.shards))
    if not shards:
        raise SystemExit(f"no file matches {args.shards}")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for megabytes in args.sizes:
            files = corpus_files(shards, megabytes, scratch)
            text_mb = sum(os.path.getsize(path) for path in files) / 1e6
            load = os.getloadavg()[0]
            rate, fast_rate = encode_batch_rates(corpus_files(shards, 20, scratch), args.tokenizer, args.piece_mb)
            print(
                f"{text_mb:.0f} MB: encode_batch alone {rate:.2f} MB/s, encode_batch_fast {fast_rate:.2f} MB/s "
                f"(load {load:.1f})",
                flush=True,
            )
            for workers in args.workers:
                load = os.getloadavg()[0]
                run = pack(files, args.tokenizer, workers, scratch, args.piece_mb)
                run.update(text_mb=text_mb, workers=workers, load=load, encode_batch_mb_per_s=rate)
                run["encode_batch_fast_mb_per_s"] = fast_rate
                run["mb_per_s"] = text_mb / run["seconds"]
                results.append(run)
                print(
                    f"{text_mb:.0f} MB, {workers} worker(s): {run['seconds']:.0f} s, {run['mb_per_s']:.2f} MB/s "
                    f"({run['packing_mb_per_s']} MB/s tokenizing and packing), peak memory "
                    f"{run['peak_memory_mb']:.0f} MB ({run['peak_anonymous_memory_mb']:.0f} MB not file-backed), "
                    f"packed {run['packed_mb']:.0f} MB, datasets' conversion {run['datasets_cache_mb']:.0f} MB "
                    f"(load {load:.1f} at the start)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
