"""What the pretraining scripts share, one concern per subpackage:

    data/          texts to token rows: reading, tokenizing, fine-tuning examples, chat, packed corpora, mixtures
    training/      what the train step is built from: the state, optimizers, compilation, the shared set-up
    run/           a run on disk: output directory, run record, checkpoints, checksums, the log and trackers
    evaluation/    validation loss, sequence scores, lm-evaluation-harness tasks
    models/        the Flax models, their Hugging Face mapping and model directories
    devices/       the device mesh and the processes of a run
    generation/    decoding with a key/value cache
    server/        generate_flax.py's model loading, its Generator and its HTTP server
    command_line/  the tools' arguments and their checks, and the settings each part receives, filled from them;
                   errors.py turns a user's mistake into one line

A subpackage imports only those before it in DEPENDENCY_ORDER (errors.py, below them all, imports none), so that each
reads without the ones after it; tests/unit/test_package_layout.py holds the order.

The scripts hold what an experiment changes."""

import importlib.abc
import importlib.util
import os
import sys

# transformers warns on import that PyTorch was not found, where it is not installed: the tools here need it only to
# compare a model with PyTorch's or to read a pickled checkpoint, and a newcomer would read the warning as an error.
# The tools import flax_lm before transformers for this.
if importlib.util.find_spec("torch") is None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The subpackages, each importing only those before it.
DEPENDENCY_ORDER = (
    "devices",
    "run",
    "data",
    "models",
    "generation",
    "evaluation",
    "training",
    "server",
    "command_line",
)

# The modules of version 0.3, which had no subpackages, and where each went.
MOVED_MODULES = {
    "arguments": "command_line.arguments",
    "tool_arguments": "command_line.tool_arguments",
    "texts": "data.texts",
    "chat": "data.chat",
    "examples": "data.finetune_examples",
    "packed": "data.packed",
    "mixture": "data.mixture",
    "host_random": "data.host_random",
    "code_fingerprint": "data.cache_key",
    "train_state": "training.train_state",
    "optimizers": "training.optimizers",
    "compilation": "training.compilation",
    "run_dir": "run.output_dir",
    "run_record": "run.record",
    "checkpoints": "run.checkpoints",
    "checksums": "run.checksums",
    "tracking": "run.tracking",
    "harness": "evaluation.harness",
    "scoring": "evaluation.scoring",
    "hf_io": "models.huggingface",
    "model_code": "models.model_code",
    "mesh": "devices.mesh",
    "processes": "devices.processes",
    "sampling": "generation.sampling",
    "serving": "server.app",
    "server_requests": "server.requests",
    "batching": "server.request_queue",
}
# Modules of 0.3 whose names are subpackages now: their functions moved into the subpackage's modules.
MODULES_NOW_SUBPACKAGES = {
    "data": "data.loading",
    "training": "training.lifecycle",
    "evaluation": "evaluation.validation",
}
# Modules of 0.4.0 renamed since, and their new names.
RENAMED_MODULES = {"training.setup": "training.lifecycle"}


def refuse_moved_module(old: str):
    """A script written for 0.3 stops at its first import of a moved module with one line naming the new one."""
    raise SystemExit(
        f"error: flax_lm.{old} moved to flax_lm.{MOVED_MODULES[old]} in flax_lm 0.4 (the package is grouped into "
        f"subpackages, see flax_lm/__init__.py); change the import to flax_lm.{MOVED_MODULES[old]}"
    )


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package == __name__ and name in MOVED_MODULES:
            refuse_moved_module(name)
        if package == __name__ and name in RENAMED_MODULES:
            raise SystemExit(
                f"error: flax_lm.{name} is flax_lm.{RENAMED_MODULES[name]} since flax_lm 0.4.0 (start_run is in "
                f"flax_lm.command_line.start); change the import to flax_lm.{RENAMED_MODULES[name]}"
            )
        return None


if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MovedModuleFinder())


def moved_from_subpackage(subpackage: str, name: str):
    """For a subpackage's __getattr__: a name a 0.3 script imported from the module of the same name (flax_lm.data,
    flax_lm.training, flax_lm.evaluation) stops the script with one line naming the module that holds it now."""
    if name.startswith("__"):
        raise AttributeError(name)
    new = MODULES_NOW_SUBPACKAGES[subpackage]
    module = importlib.import_module(f"{__name__}.{new}")
    if name not in vars(module):
        raise AttributeError(f"module 'flax_lm.{subpackage}' has no attribute '{name}'")
    raise SystemExit(
        f"error: flax_lm.{subpackage}.{name} moved to flax_lm.{new} in flax_lm 0.4 (flax_lm.{subpackage} is a "
        f"subpackage now); change the import to `from flax_lm.{new} import {name}`"
    )
