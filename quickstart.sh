#!/usr/bin/env bash
# From nothing to a trained small model, offline, in a few minutes on a laptop CPU.
#
# The corpus is the Python standard library's own source code, which every Python installation has.
# Each step is one command you would also run on your own data:
#   1. train a byte-level BPE tokenizer      (train_tokenizer.py)
#   2. write a config sized for a CPU        (create_config.py)
#   3. train, evaluate and export the model  (run_clm_flax.py for GPT-2 and Llama, run_mlm_flax.py for RoBERTa)
#   4. generate text with the trained model  (generate_flax.py)
# `chat` fine-tunes a GPT-2 on conversations instead: a synthetic task (sorting digits), a tokenizer with a chat
# template, the loss on the assistant's turns, and replies to new conversations.
# Usage: ./quickstart.sh [clm|llama|mlm|chat] [WORK_DIR]   (default: clm, a GPT-2; quickstart/)
set -euo pipefail
cd "$(dirname "$0")"
task=${1:-clm}
work_dir=${2:-quickstart}
corpus=$work_dir/python-stdlib.jsonl
case "$task" in clm|llama|mlm|chat) ;; *) echo "error: the first argument is clm, llama, mlm or chat, not '$task'" >&2; exit 2 ;; esac
mkdir -p "$work_dir"

if [ "$task" = chat ]; then
    # To use your own conversations, skip this and point --train_file below at a JSON Lines file of rows such as
    # {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}.
    python3 - "$work_dir" <<'PYTHON'
import json, os, random, sys
rng = random.Random(0)
def conversation():
    digits = [rng.randrange(10) for _ in range(5)]
    return [{"role": "user", "content": "sort: " + " ".join(map(str, digits))},
            {"role": "assistant", "content": " ".join(map(str, sorted(digits)))}]
for name, count in (("train", 20000), ("validation", 500)):
    with open(os.path.join(sys.argv[1], f"chat-{name}.jsonl"), "w") as file:
        file.writelines(json.dumps({"messages": conversation()}) + "\n" for _ in range(count))
with open(os.path.join(sys.argv[1], "chat-text.txt"), "w") as file:  # the tokenizer's text: roles and contents
    for _ in range(2000):
        file.writelines(message["role"] + "\n" + message["content"] + "\n" for message in conversation())
print(f"conversations: 20000 to train on, 500 to evaluate on -> {sys.argv[1]}/chat-*.jsonl")
PYTHON
    model_dir=$work_dir/gpt2-chat
    ./train_tokenizer.py --train_file "$work_dir/chat-text.txt" --model_type gpt2 --vocab_size 320 \
        --model_max_length 64 --chat_template --output_dir "$model_dir" --overwrite
    ./create_config.py --preset gpt2-tiny --tokenizer_dir "$model_dir" \
        --set n_positions=64 resid_pdrop=0.0 embd_pdrop=0.0 attn_pdrop=0.0 --overwrite
    ./run_clm_flax.py --output_dir "$work_dir/gpt2-chat-trained" --overwrite_output_dir \
        --config_name "$model_dir" --tokenizer_name "$model_dir" \
        --train_file "$work_dir/chat-train.jsonl" --validation_file "$work_dir/chat-validation.jsonl" \
        --do_train --do_eval --block_size 64 --per_device_train_batch_size 32 --per_device_eval_batch_size 64 \
        --learning_rate 3e-3 --warmup_steps 30 --lr_scheduler_type cosine --max_steps 300 \
        --logging_steps 50 --eval_steps 150 --save_steps 300 --sample_prompt "sort: 7 3 9 1 4" --sample_tokens 12
    # The fine-tuned model replies to conversations it has not seen, each reply ending at its end of turn.
    ./generate_flax.py --model_name_or_path "$work_dir/gpt2-chat-trained" --chat \
        --prompt "sort: 8 2 6 2 0" --prompt "sort: 9 4 1 7 3" --max_new_tokens 16
    exit 0
fi

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

if [ "$task" != mlm ]; then
    # GPT-2 (clm) or Llama (llama): the same commands, the model type chosen by the tokenizer and config presets, and
    # the recommended small recipe of docs/pretraining-clm.md: 4096 tokens, Muon for the matrices and AdamW for the rest, the learning
    # rate warmed up, held and decayed over the last fifth of the steps (GPT-2 also 64 wide).
    if [ "$task" = clm ]; then model_type=gpt2 shape="--set n_embd=64 resid_pdrop=0.0 embd_pdrop=0.0 attn_pdrop=0.0"
    else model_type=llama shape=""; fi
    model_dir=$work_dir/$model_type-tiny
    ./train_tokenizer.py --train_file "$corpus" --model_type $model_type --vocab_size 4096 \
        --model_max_length 256 --output_dir "$model_dir" --overwrite
    ./create_config.py --preset $model_type-tiny --tokenizer_dir "$model_dir" --pad_vocab_to_multiple_of 64 \
        $shape --overwrite
    ./run_clm_flax.py --output_dir "$work_dir/$model_type-tiny-trained" --overwrite_output_dir \
        --config_name "$model_dir" --tokenizer_name "$model_dir" --train_file "$corpus" \
        --do_train --do_eval --block_size 128 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 \
        --optim muon --learning_rate 1.6e-2 --muon_learning_rate 0.025 --warmup_steps 5 \
        --lr_scheduler_type warmup_stable_decay --lr_decay_ratio 0.2 --lr_decay_shape linear \
        --weight_decay 0.01 --adam_beta2 0.98 --max_steps 220 --logging_steps 55 --eval_steps 110 --save_steps 220 \
        --sample_prompt "def " --sample_prompt "import " --sample_tokens 60
    # The trained model writes more: greedy after one prompt, drawn at temperature 0.8 after another.
    ./generate_flax.py --model_name_or_path "$work_dir/$model_type-tiny-trained" --prompt "class " --max_new_tokens 60
    ./generate_flax.py --model_name_or_path "$work_dir/$model_type-tiny-trained" --prompt "    def __init__(self" \
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
