"""What the pretraining scripts share: the Flax models and their Hugging Face layout (models/), the arguments and
their checks, reading texts and packed corpora, processes and the device mesh, the output directory, checkpoints,
the training log and trackers, and Hugging Face model directories. The scripts hold what an experiment changes."""

import importlib.util
import os

# transformers warns on import that PyTorch was not found, where it is not installed: the tools here need it only to
# compare a model with PyTorch's or to read a pickled checkpoint, and a newcomer would read the warning as an error.
# The tools import flax_lm before transformers for this.
if importlib.util.find_spec("torch") is None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
