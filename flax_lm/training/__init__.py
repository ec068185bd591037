"""What the train step is built from, besides the model and the loss the script defines:

train_state.py   the training state created with its sharding, gradient accumulation, finite-only updates
optimizers.py    schedules and optimizers from optax's parts (the scripts' OPTIMIZERS table names them)
compilation.py   the persistent compilation cache, and the train step compiled while the run prepares
fp8.py           --fp8: the train step's dense products in FP8 with per-tensor current scaling
setup.py         the set-up both scripts share: shapes, shardings, compiled steps, the starting state, saves
phases.py        main()'s phases around the loop: the run started on disk (state, output directory, trackers), and
                 its end (the weights it ends with, results, final evaluation)
"""


def __getattr__(name):
    from flax_lm import moved_from_subpackage

    return moved_from_subpackage("training", name)
