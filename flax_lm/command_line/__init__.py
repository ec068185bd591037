"""The command line of the tools: the arguments of the training scripts (arguments.py; run_clm_flax.py's
lm-evaluation-harness flags: harness_flags.py) and of train_tokenizer.py and create_config.py (tool_arguments.py),
each checked before any work starts. flax_lm/errors.py turns a mistake into
the one line a user reads."""
