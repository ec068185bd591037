#!/usr/bin/env bash
# From nothing to a trained small model, offline, in a few minutes on a laptop CPU.
#
# The corpus is the Python standard library's own source code, which every Python installation has.
# Each step is one command you would also run on your own data:
#   1. train a byte-level BPE tokenizer      (train_tokenizer.py)
#   2. write a config sized for a CPU        (create_config.py)
#   3. train, evaluate and export the model  (run_clm_flax.py for GPT-2, run_mlm_flax.py for RoBERTa)
#   4. generate text with the trained GPT-2  (generate_flax.py)
# Usage: ./quickstart.sh [clm|mlm] [WORK_DIR]   (default: clm, quickstart/)
set -euo pipefail
cd "$(dirname "$0")"
task=${1:-clm}
work_dir=${2:-quickstart}
corpus=$work_dir/python-stdlib.jsonl
case "$task" in clm|mlm) ;; *) echo "error: the first argument is clm or mlm, not '$task'" >&2; exit 2 ;; esac
mkdir -p "$work_dir"

# To use your own data, skip this and point --train_file below at your .txt/.jsonl/.csv/.parquet files.
python3 - "$corpus" <<'PYTHON'
import glob, json, os, sys, sysconfig
sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
with open(sys.argv[1], "w") as corpus:
    for path in sources:
        with open(path, encoding="utf-8", errors="replace") as source:
            corpus.write(json.dumps({"text": source.read()}) + "\n")
print(f"corpus: {len(sources)} standard-library modules, {os.path.getsize(sys.argv[1]) / 1e6:.1f} MB -> {sys.argv[1]}")
PYTHON

if [ "$task" = clm ]; then
    model_dir=$work_dir/gpt2-tiny
    # The README's recommended small recipe: a 2-layer GPT-2 64 wide with 4096 tokens, Muon for its matrices and
    # AdamW for the rest, the learning rate warmed up, held and decayed over the last fifth of the steps.
    ./train_tokenizer.py --train_file "$corpus" --model_type gpt2 --vocab_size 4096 \
        --model_max_length 256 --output_dir "$model_dir" --overwrite
    ./create_config.py --preset gpt2-tiny --tokenizer_dir "$model_dir" --pad_vocab_to_multiple_of 64 \
        --set n_embd=64 resid_pdrop=0.0 embd_pdrop=0.0 attn_pdrop=0.0 --overwrite
    ./run_clm_flax.py --output_dir "$work_dir/gpt2-tiny-trained" --overwrite_output_dir \
        --config_name "$model_dir" --tokenizer_name "$model_dir" --train_file "$corpus" \
        --do_train --do_eval --block_size 128 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 \
        --optim muon --learning_rate 1.6e-2 --muon_learning_rate 0.025 --warmup_steps 5 \
        --lr_scheduler_type warmup_stable_decay --lr_decay_ratio 0.2 --lr_decay_shape linear \
        --weight_decay 0.01 --adam_beta2 0.98 --max_steps 220 --logging_steps 55 --eval_steps 110 --save_steps 220 \
        --sample_prompt "def " --sample_prompt "import " --sample_tokens 60
    # The trained model writes more: greedy after one prompt, drawn at temperature 0.8 after another.
    ./generate_flax.py --model_name_or_path "$work_dir/gpt2-tiny-trained" --prompt "class " --max_new_tokens 60
    ./generate_flax.py --model_name_or_path "$work_dir/gpt2-tiny-trained" --prompt "    def __init__(self" \
        --max_new_tokens 60 --temperature 0.8 --top_k 40 --seed 1
else
    model_dir=$work_dir/roberta-tiny
    ./train_tokenizer.py --train_file "$corpus" --model_type roberta --vocab_size 8192 \
        --model_max_length 256 --output_dir "$model_dir" --overwrite
    ./create_config.py --preset roberta-tiny --tokenizer_dir "$model_dir" --pad_vocab_to_multiple_of 64 \
        --set hidden_dropout_prob=0.0 attention_probs_dropout_prob=0.0 --overwrite
    ./run_mlm_flax.py --output_dir "$work_dir/roberta-tiny-trained" --overwrite_output_dir \
        --config_name "$model_dir" --tokenizer_name "$model_dir" --train_file "$corpus" \
        --do_train --do_eval --max_seq_length 128 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 \
        --learning_rate 1e-3 --warmup_steps 30 --lr_scheduler_type cosine --weight_decay 0.01 --adam_beta2 0.98 \
        --max_steps 300 --logging_steps 50 --eval_steps 150 --save_steps 300
fi
