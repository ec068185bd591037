"""The device mesh: how the batch and the parameters are split over every device of every process, and how a
process's rows of a batch become one global array."""

import math
import queue
import threading
from collections.abc import Iterator

import jax

from flax_lm.errors import UsageError

# The mesh has four axes.
# - "data": each device computes its own rows of the batch with whole parameters (data parallelism).
# - "fsdp": the batch is split over it too, and the parameters (with their gradients and optimizer state) are split
#   along their embedding dimension; XLA gathers each layer's parameters as it needs them (ZeRO-3/FSDP).
# - "expert": the batch is split over it too, and a mixture of experts' experts are split over it, each device
#   holding its share of every MoE layer's experts (expert parallelism); the other parameters are whole on it, as on
#   "data". A model without experts is refused on it (check_expert_split).
# - "tensor": the devices of a group compute the same rows, each with its share of the attention heads, of the
#   MLP's inner columns and of the vocabulary (Megatron-LM's tensor parallelism): a layer's first matrix is split
#   by columns, its second by rows, so a block costs one sum over the group in each direction.
# The default mesh puts every device on "data".
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Batches arrive split over every device, each process loading its own rows (see process_slice); the models then
# regroup the rows over "data", "fsdp" and "expert" (the logical "batch" below), every device of a tensor group with
# the group's rows.
BATCH_AXES = MESH_AXES

# Logical axis names (on parameters, and on activations in the models' sharding constraints) -> mesh axes.
LOGICAL_AXIS_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    # The positions of the activations between the split layers (residuals, layer norms), split over the tensor
    # axis where the layers are not (Megatron-LM's sequence parallelism): the sum that ends a split layer is
    # scattered over the positions, and gathered again where the next one starts, for the same traffic as one sum.
    ("length", "tensor"),
    ("vocab", "tensor"),
    ("positions", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    # The experts of a mixture of experts (flax_lm/models/shared/moe.py).
    ("expert", "expert"),
)


def create_mesh(mesh_shape: str | None = None) -> jax.sharding.Mesh:
    """All devices of all processes on MESH_AXES, sized by `mesh_shape` ("data=2,fsdp=2,tensor=2", "expert=4"); an axis
    left out has size 1, but for "data", which takes the devices the others leave. By default all devices are on
    "data"."""
    given = {}
    if mesh_shape:
        try:
            pairs = [(name.strip(), int(size)) for name, size in (part.split("=") for part in mesh_shape.split(","))]
        except ValueError:
            raise UsageError(f"--mesh_shape {mesh_shape}: write it as data=N,fsdp=M,expert=E,tensor=K") from None
        given = dict(pairs)
        if len(given) < len(pairs):
            repeated = next(name for name, _ in pairs if [other for other, _ in pairs].count(name) > 1)
            raise UsageError(f"--mesh_shape {mesh_shape} sizes the {repeated} axis twice; give each axis once")
        if not set(given) <= set(MESH_AXES) or min(given.values()) < 1:
            raise UsageError(f"--mesh_shape {mesh_shape}: the axes are data, fsdp, expert and tensor, each at least 1")
    others = given.get("fsdp", 1) * given.get("expert", 1) * given.get("tensor", 1)
    sizes = {"data": max(1, jax.device_count() // others), "fsdp": 1, "expert": 1, "tensor": 1, **given}
    total = math.prod(sizes.values())
    if total != jax.device_count():
        raise UsageError(
            f"--mesh_shape {mesh_shape} has {total} devices but there are {jax.device_count()}; make the sizes "
            "multiply to the device count"
        )
    # The last axis varies fastest over the devices, which jax orders process by process: a tensor group, whose
    # every layer exchanges activations, takes neighbouring devices of one process where it fits in one.
    return jax.make_mesh(
        tuple(sizes[axis] for axis in MESH_AXES), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    )


def check_tensor_split(mesh: jax.sharding.Mesh, split_sizes: dict[str, int]):
    """Refuse a tensor axis that does not divide every size it splits (`split_sizes`: what -> size, e.g.
    {"attention heads (n_head)": 12}), naming the first that it does not divide."""
    tensor = mesh.shape["tensor"]
    for what, size in split_sizes.items():
        if size % tensor:
            fix = "pad it with create_config.py --pad_vocab_to_multiple_of" if "vocab" in what else "change the config"
            raise UsageError(
                f"--mesh_shape tensor={tensor} does not divide the {what} {size}: choose a tensor size that divides "
                f"it, or {fix}"
            )


def check_expert_split(mesh: jax.sharding.Mesh, experts: int | None):
    """Refuse an expert axis that does not divide the experts of every MoE layer (`experts`; None for a model without
    experts, which the axis cannot split)."""
    size = mesh.shape.get("expert", 1)
    if size == 1:
        return
    if experts is None:
        raise UsageError(
            f"--mesh_shape expert={size} splits a mixture of experts' experts, and this model has none; put the "
            "devices on another axis (data or fsdp to train, tensor to generate)"
        )
    if experts % size:
        raise UsageError(
            f"--mesh_shape expert={size} does not divide the {experts} experts of the model: choose an expert size "
            "that divides them"
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
