"""Evaluation: the validation loss reported for the whole data and each source (validation.py), log-probabilities
of token sequences (scoring.py), and lm-evaluation-harness tasks scored by the JAX model (harness.py)."""


def __getattr__(name):
    from flax_lm import moved_from_subpackage

    return moved_from_subpackage("evaluation", name)
