"""The processes of a run: one, or several joined by JAX's distributed runtime; their logging, and how they take
turns and agree."""

import contextlib
import logging
import os
from dataclasses import dataclass

import datasets
import jax
import numpy as np
import transformers
from jax.experimental import multihost_utils

from flax_lm.errors import UsageError, is_full_disk


def on_cloud_tpu_vm() -> bool:
    """As JAX found when it was imported. The flag lives in a private module of JAX; should it move, TPU users pass
    the three flags instead."""
    try:
        from jax._src import cloud_tpu_init
    except ImportError:
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def multi_process_launcher() -> str | None:
    """The launcher that started this process as one of several tasks, or None. jax.distributed.initialize()
    reads the run's settings from the launcher's environment, but cannot be told to do nothing for a process on
    its own: without a launcher it fails, and for a single task it starts a coordinator all the same."""
    # Only srun's tasks have SLURM_STEP_NODELIST: a batch script run with --ntasks 4 is still one process.
    if "SLURM_STEP_NODELIST" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "Slurm"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if on_cloud_tpu_vm():
        return "Cloud TPU"
    return None


@dataclass(frozen=True)
class ProcessGroup:
    """How the processes of a run started by hand find each other: the distributed flags of the same names (the
    scripts' DistributedArguments give theirs, DistributedArguments.process_group); all None where a launcher tells
    JAX, or for a single process."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: str | None = None  # comma-separated


def check_process_group(group: ProcessGroup):
    """The distributed flags, checked by initialize_distributed before the processes join."""
    explicit = [group.coordinator_address, group.num_processes, group.process_id]
    if any(value is not None for value in explicit) and any(value is None for value in explicit):
        raise UsageError(
            "--coordinator_address, --num_processes and --process_id go together: pass all three, or none where "
            "Slurm, Open MPI or Cloud TPU supplies them"
        )
    address, num_processes, process_id = explicit
    if address is not None and (num_processes < 1 or not 0 <= process_id < num_processes):
        raise UsageError(
            f"--process_id {process_id} is not in 0..{num_processes - 1}; number the processes 0 to "
            "--num_processes - 1"
        )
    if address is not None and ":" not in address:
        raise UsageError(f"--coordinator_address {address} has no port; give HOST:PORT")
    device_ids = group.local_device_ids
    if device_ids is not None and not all(part.strip().isdigit() for part in device_ids.split(",")):
        raise UsageError(f"--local_device_ids {device_ids} is not a comma-separated list of integers")


def initialize_distributed(group: ProcessGroup):
    """Join the other processes of a multi-process run, before anything touches the devices: with the three flags,
    or with what JAX finds itself under Slurm's srun, Open MPI's mpirun or on the hosts of a Cloud TPU slice."""
    check_process_group(group)
    explicit = group.coordinator_address is not None
    launcher = None if explicit else multi_process_launcher()
    if group.num_processes == 1 or not (explicit or launcher):
        if group.local_device_ids is not None:
            raise UsageError(
                "--local_device_ids applies to multi-process runs; to choose the GPUs of a single process, set "
                "CUDA_VISIBLE_DEVICES"
            )
        return
    device_ids = group.local_device_ids
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator_address,
            num_processes=group.num_processes,
            process_id=group.process_id,
            local_device_ids=None if device_ids is None else [int(part) for part in device_ids.split(",")],
        )
    except ValueError as error:
        if explicit:
            raise
        # The launcher's environment lacks something JAX reads, e.g. the address of Open MPI 5's launcher.
        raise UsageError(
            f"{launcher} started this process as one of several, but JAX cannot tell how to join the others "
            f"({error}); pass --coordinator_address, --num_processes and --process_id"
        ) from None


# One log format for the four scripts; a process of a multi-process run names itself after the time.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(is_main_process: bool):
    """Only process 0 logs below ERROR."""
    process_label = f" process {jax.process_index()}" if jax.process_count() > 1 else ""
    logging.basicConfig(
        format=LOG_FORMAT.replace("%(asctime)s", f"%(asctime)s{process_label}"),
        level=logging.INFO if is_main_process else logging.ERROR,
        force=True,  # importing orbax installs absl's handler, which would hide these logs
    )
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.getLogger("absl").addFilter(not_a_full_disk)
    datasets.utils.logging.set_verbosity_warning()
    # Its reader of JSON logs a file it cannot parse, by a row that counts from the start of a block, before it
    # raises; the command's error names the file and the line (flax_lm.data.texts.unreadable_data_error).
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    transformers.utils.logging.set_verbosity_warning()
    if not is_main_process:
        datasets.disable_progress_bars()


def not_a_full_disk(record: logging.LogRecord) -> bool:
    """Leave out Orbax's logs of a checkpoint's background threads failing on a full disk, each with its traceback:
    the command ends with one line saying so (flax_lm.errors)."""
    error = record.exc_info[1] if record.exc_info else None
    return not (is_full_disk(error or OSError()) or "No space left on device" in record.getMessage())


def wait_for_all_processes(name: str):
    """Return once every process has called this with the same `name` (at once for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def main_process_first(name: str):
    """Process 0 runs the block first, then the others: they then read the caches it filled (on a file
    system the hosts share) instead of all writing the same files at once."""
    if jax.process_index() > 0:
        wait_for_all_processes(name)
    try:
        yield
    finally:  # also when process 0 fails: the others then try, and report the same error
        if jax.process_index() == 0:
            wait_for_all_processes(name)


def on_process_zero(action, what: str):
    """Run `action` on process 0 alone; its UsageError stops every process (the others with a line naming
    `what` and pointing to process 0). Returns what `action` returns (None on the other processes)."""
    result, failure = None, None
    if jax.process_index() == 0:
        try:
            result = action()
        except UsageError as error:
            failure = error
    if jax.process_count() > 1 and not np.all(multihost_utils.process_allgather(np.asarray(failure is None))):
        raise failure or UsageError(f"process 0 could not {what} (see its error)")
    if failure:
        raise failure
    return result


def print_once(text: str):
    if jax.process_index() == 0:
        print(text)
