"""The command line of the tools: the arguments of the training scripts (arguments.py, trainer_flags.py;
run_clm_flax.py's lm-evaluation-harness flags: harness_flags.py) and of train_tokenizer.py and create_config.py
(tool_arguments.py), each checked before any work starts; a training script's start (start.py) and the phases of its
main() around the loop (phases.py); and the settings each part of flax_lm receives, filled from the flags here alone
(settings.py, model_loading.py). flax_lm/errors.py turns a mistake into the one line a user reads."""
