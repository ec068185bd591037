"""From texts to the token rows a train step reads, in the order the layers are met; each module imports only those
above it, so that the way from files to rows goes down once (and none imports flax_lm.command_line: the scripts
unpack their flags into the values and settings these functions take):

source.py             where the texts come from and how they are read (TextSource), how examples become rows
data_files.py         which local files --train_file names (one rule for every tool), each format's reader
pieces.py             texts tokenized a piece at a time, in worker processes, with the progress shown
long_texts.py         a text longer than memory, read and cut a stretch at a time; .txt files as they are
texts.py              reading text files, datasets and streams, and encoding them into token ids
text_stream.py        a whole corpus read once in counted batches of texts (train_tokenizer.py)
chat.py               chat templates: rendering a conversation, the tokens that end a turn
finetune_examples.py  prompt/completion pairs and conversations in TRL's formats, with their loss weights
text_pairs.py         input/target pairs tokenized for a sequence-to-sequence model (T5)
preferences.py        preference pairs (prompt, chosen, rejected) in TRL's formats as DPO's rows (run_dpo_flax.py)
cache_key.py          the fingerprint of the code that turns texts into tokens, which keys the token cache
packed.py             packed corpora on disk (the token cache and --packed_data_dir), read by memory maps
mixture.py            several sources mixed by weight (--data_mixture)
loading.py            a run's rows for each split from whichever route the arguments name, and their order
host_random.py        counter-based random numbers for the choices made per row (MLM's masks)
span_corruption.py    T5's span corruption: the row length that fills the input, the dropped spans, the sentinels
"""


def __getattr__(name):
    from flax_lm import moved_from_subpackage

    return moved_from_subpackage("data", name)
