"""The device mesh: how the batch and the parameters are split over every device of every process, and how a
process's rows of a batch become one global array."""

import queue
import threading
from collections.abc import Iterator

import jax

from flax_lm.errors import UsageError

# The mesh has two axes. The batch is split over both; parameters (and with them gradients and optimizer
# state) are split along their embedding dimension over "fsdp" and replicated over "data". With the
# default mesh (fsdp=1) that is plain data parallelism; with fsdp=N each device holds 1/N of the state
# and XLA gathers the parameters for each layer as needed, as ZeRO-3/FSDP do.
MESH_AXES = ("data", "fsdp")


BATCH_AXES = MESH_AXES


LOGICAL_AXIS_RULES = (
    ("vocab", None),
    ("positions", None),
    ("embed", "fsdp"),
    ("heads", None),
    ("mlp", None),
)


def create_mesh(mesh_shape: str | None = None) -> jax.sharding.Mesh:
    """All devices of all processes on MESH_AXES, sized by `mesh_shape` ("data=2,fsdp=4"); by default all on "data"."""
    given = {}
    if mesh_shape:
        try:
            given = {name.strip(): int(size) for name, size in (part.split("=") for part in mesh_shape.split(","))}
        except ValueError:
            raise UsageError(f"--mesh_shape {mesh_shape}: write it as data=N,fsdp=M") from None
        if not set(given) <= set(MESH_AXES) or min(given.values()) < 1:
            raise UsageError(f"--mesh_shape {mesh_shape}: the axes are {' and '.join(MESH_AXES)}, each at least 1")
    sizes = {"data": max(1, jax.device_count() // given.get("fsdp", 1)), "fsdp": 1, **given}
    if sizes["data"] * sizes["fsdp"] != jax.device_count():
        raise UsageError(
            f"--mesh_shape {mesh_shape} has {sizes['data'] * sizes['fsdp']} devices but there are "
            f"{jax.device_count()}; make the sizes multiply to the device count"
        )
    return jax.make_mesh(
        tuple(sizes[axis] for axis in MESH_AXES), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    )


def to_global_batch(local_batch: dict, batch_sharding) -> dict:
    """This process's rows -> one array split over every device of every process."""
    return {name: jax.make_array_from_process_local_data(batch_sharding, rows) for name, rows in local_batch.items()}


def prefetch(iterator: Iterator) -> Iterator:
    """Run `iterator` in a background thread, two items ahead, so the host prepares the next batches while the
    devices compute."""
    items = queue.Queue(maxsize=2)
    end = object()

    def produce():
        try:
            for item in iterator:
                items.put(item)
        except BaseException as error:  # handed to the consumer, which re-raises it
            items.put(error)
        items.put(end)

    threading.Thread(target=produce, daemon=True).start()
    while (item := items.get()) is not end:
        if isinstance(item, BaseException):
            raise item
        yield item


def process_slice(global_batch_size: int) -> slice:
    """The rows of each global batch that this process loads; jax assembles them into one global array."""
    local_size = global_batch_size // jax.process_count()
    return slice(jax.process_index() * local_size, (jax.process_index() + 1) * local_size)
