"""The parts the training scripts' schedules and optimizers are made of, from optax's: the warm-up, the decays after
it, warmup-stable-decay; AdamW, Lion and Adafactor with the script's weight decay mask, and Muon beside AdamW. Which
of them a flag names is each script's choice, in its tables LEARNING_RATE_SCHEDULES and OPTIMIZERS."""

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from flax_lm.errors import UsageError
from flax_lm.training.lora import decaying_adapters
from flax_lm.training.train_state import trained_mask


@dataclass(frozen=True)
class OptimizerSettings:
    """What the schedules and optimizers are made from: the training flags of the same names (the scripts' training
    arguments give theirs, CommonTrainingArguments.optimizer_settings), passed to the scripts' tables
    LEARNING_RATE_SCHEDULES and OPTIMIZERS."""

    optim: str
    lr_scheduler_type: str
    learning_rate: float
    warmup_steps: int
    warmup_ratio: float
    min_lr_rate: float
    lr_decay_ratio: float
    lr_decay_shape: str
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    weight_decay: float
    max_grad_norm: float
    muon_learning_rate: float
    muon_momentum: float
    trains: bool  # --do_train: a schedule longer than the run is refused only where it trains


# What --lr_decay_shape names: a decay from (peak, floor, steps), at `floor` from `steps` on. 1-sqrt falls fast at
# the end, which Hägele et al. (2024, arXiv:2405.18392) found better than linear for the decay of warmup_stable_decay.
DECAY_SHAPES = {
    "linear": lambda peak, floor, steps: optax.linear_schedule(peak, floor, steps),
    "cosine": lambda peak, floor, steps: optax.cosine_decay_schedule(peak, steps, alpha=floor / peak),
    "1-sqrt": lambda peak, floor, steps: (
        lambda step: floor + (peak - floor) * (1 - jnp.sqrt(jnp.clip(step / steps, 0.0, 1.0)))
    ),
}


def after_linear_warmup(schedule_after_warmup, settings: OptimizerSettings, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate over --warmup_steps (or --warmup_ratio of the run), then
    `schedule_after_warmup(settings, warmup_steps, total_steps)`, whose step 0 is the first after the warm-up."""
    warmup_steps = settings.warmup_steps or math.ceil(settings.warmup_ratio * total_steps)
    if settings.trains and warmup_steps > total_steps:
        raise UsageError(
            f"--warmup_steps {warmup_steps} is longer than the run's {total_steps} steps, so the learning rate would "
            "never reach --learning_rate; pass fewer --warmup_steps, or --warmup_ratio"
        )
    warmup_steps = min(warmup_steps, total_steps)  # an evaluation alone has no steps
    after_warmup = schedule_after_warmup(settings, warmup_steps, total_steps)
    warmup = optax.linear_schedule(0.0, settings.learning_rate, max(warmup_steps, 1))
    return optax.join_schedules([warmup, after_warmup], [warmup_steps])


def decay_to_the_end(shape: str):
    """The schedule after warm-up that decays from the peak to --min_lr_rate of it over all the remaining steps, in
    the shape DECAY_SHAPES names."""

    def schedule(settings: OptimizerSettings, warmup_steps: int, total_steps: int) -> optax.Schedule:
        peak = settings.learning_rate
        return DECAY_SHAPES[shape](peak, peak * settings.min_lr_rate, max(total_steps - warmup_steps, 1))

    return schedule


def warmup_stable_decay(settings: OptimizerSettings, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """After the warm-up, the peak, held until the last --lr_decay_ratio of the run's steps, which decay to
    --min_lr_rate of it in the shape --lr_decay_shape names. The decay is placed by the run's last step alone: a
    checkpoint of the stable phase resumed with another --max_steps decays at the end of the new budget."""
    peak = settings.learning_rate
    decay_steps = round(settings.lr_decay_ratio * total_steps)
    stable_steps = total_steps - warmup_steps - decay_steps
    if settings.trains and stable_steps < 0:
        raise UsageError(
            f"the warm-up ({warmup_steps} steps) and the decay (--lr_decay_ratio {settings.lr_decay_ratio}: "
            f"{decay_steps} steps) are longer than the run's {total_steps} steps; shorten one of them"
        )
    decay = DECAY_SHAPES[settings.lr_decay_shape](peak, peak * settings.min_lr_rate, max(decay_steps, 1))
    return optax.join_schedules([optax.constant_schedule(peak), decay], [max(stable_steps, 0)])


def adamw(settings: OptimizerSettings, schedule: optax.Schedule, decay_mask) -> optax.GradientTransformation:
    """AdamW with --adam_beta1, --adam_beta2, --adam_epsilon, and --weight_decay on what `decay_mask` picks and on
    LoRA's adapters (decaying_adapters)."""
    return optax.adamw(
        schedule,
        b1=settings.adam_beta1,
        b2=settings.adam_beta2,
        eps=settings.adam_epsilon,
        weight_decay=settings.weight_decay,
        mask=decaying_adapters(decay_mask),
    )


def lion(settings: OptimizerSettings, schedule: optax.Schedule, decay_mask) -> optax.GradientTransformation:
    """Lion, whose betas are --adam_beta1 and --adam_beta2, weight decay as adamw's."""
    return optax.lion(
        schedule,
        b1=settings.adam_beta1,
        b2=settings.adam_beta2,
        weight_decay=settings.weight_decay,
        mask=decaying_adapters(decay_mask),
    )


def adafactor(settings: OptimizerSettings, schedule: optax.Schedule, decay_mask) -> optax.GradientTransformation:
    """optax's Adafactor, weight decay as adamw's."""
    return optax.adafactor(
        schedule, weight_decay_rate=settings.weight_decay or None, weight_decay_mask=decaying_adapters(decay_mask)
    )


def muon_with_adamw(
    settings: OptimizerSettings, schedule: optax.Schedule, adamw, is_hidden_matrix
) -> optax.GradientTransformation:
    """optax's Muon for the parameters `is_hidden_matrix(path, param)` picks, at --muon_learning_rate, and the
    optimizer `adamw` for every other parameter, at --learning_rate: both in the shape of `schedule`."""
    muon_scale = settings.muon_learning_rate / settings.learning_rate
    # optax.contrib.muon sends what is not 2-D to an Adam of its own unless told which axes are the matrix: here the
    # last two (in, out), any before them a stack of matrices each orthogonalised alone (a mixture's experts). Given
    # only such matrices, its Adam holds nothing but a step count.
    muon = optax.contrib.muon(
        lambda step: schedule(step) * muon_scale,
        beta=settings.muon_momentum,
        weight_decay=settings.weight_decay,
        muon_weight_dimension_numbers=lambda params: jax.tree_util.tree_map(
            lambda param: optax.contrib.MuonDimensionNumbers(param.ndim - 2, param.ndim - 1), params
        ),
    )
    return optax.partition(
        {"muon": muon, "adamw": adamw},
        lambda params: jax.tree_util.tree_map_with_path(
            lambda path, param: "muon" if is_hidden_matrix(path, param) else "adamw", params
        ),
    )


def trained_only(optimizer, is_trained) -> optax.GradientTransformation:
    """`optimizer` for the parameters `is_trained(path, param)` picks, and an update of zero for the others: frozen,
    they have no optimizer state (optax.MaskedNode in place of each of their moments, as optax.masked keeps it) and
    no share in what the optimizer computes over all parameters (the global norm of --max_grad_norm). Where every
    parameter is trained, the state is `optimizer`'s own, so that the checkpoints of earlier runs resume."""

    def trained_part(tree, mask):
        return jax.tree_util.tree_map(lambda leaf, trained: leaf if trained else optax.MaskedNode(), tree, mask)

    def init(params):
        # optax.tree_utils.tree_map_params initialises with a placeholder of no leaves to find where the
        # parameters' copies are; it finds them in `optimizer`'s state (MaskedNode where frozen: see optax.masked).
        if not jax.tree_util.tree_leaves(params):
            return optimizer.init(params)
        mask = trained_mask(params, is_trained)
        if not any(jax.tree_util.tree_leaves(mask)):
            raise UsageError(
                "is_trained returns False for every parameter, so the run would train nothing; let it return True "
                "for those to train"
            )
        return optimizer.init(trained_part(params, mask))

    def update(updates, state, params=None):
        mask = trained_mask(updates if params is None else params, is_trained)
        if all(jax.tree_util.tree_leaves(mask)):
            return optimizer.update(updates, state, params)
        trained_params = None if params is None else trained_part(params, mask)
        trained_updates, state = optimizer.update(trained_part(updates, mask), state, trained_params)
        # trained_updates holds a MaskedNode where `mask` is False: a zero of the gradient's shape goes there.
        all_updates = jax.tree_util.tree_map(
            lambda trained, update, gradient: update if trained else jnp.zeros_like(gradient),
            mask,
            trained_updates,
            updates,
        )
        return all_updates, state

    return optax.GradientTransformation(init, update)
