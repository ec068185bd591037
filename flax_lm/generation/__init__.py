"""Generating text with a causal model: decoding over a key/value cache, each row with its own settings
(sampling.py); and with an encoder-decoder (T5), over its decoder's cache (seq2seq.py). generate_flax.py, the server
and the samples shown during training decode through it."""
