"""``collaborative``: an optax transformation that trains with a DeDLOC collaboration.

Like :func:`optax.MultiSteps`, it accumulates micro-batch gradients and returns zero updates until
a step is due. The difference is who decides: the step is due when the *whole collaboration* has
accumulated ``target_batch_size`` samples. Then this peer's accumulated mean gradient is averaged
with its group (weights = samples), the inner optimizer is applied to the average, and the
accumulator is reset. Every peer of a group receives bit-identical averages and holds the same
inner state, so every peer takes the same step.

Inside ``jax.jit`` the host is reached through :mod:`dedloc_jax.host` (one cheap callback on
every micro-step picks the branch; only a branch that averages moves the gradients). A step that
does not average costs what plain optax costs, pass for pass over memory
(``bench.optax_overhead`` measures it): the accumulator takes the micro-batch in one fused pass
before the branch; the big state crosses the branch untouched (with donated buffers XLA aliases
it: no copy); and no zero tree is written: the branch hands back the gradients' own dead buffers,
masked to zero outside it by a ``where`` that XLA fuses into the caller's ``apply_updates``.
Every value a branch writes in place of one it read is computed from the host's answer, which
orders the write after the read, so XLA can reuse the buffer instead of copying it on every step.

``overlap=True`` gives DeDLOC's delayed updates: the averaging runs in the background while the
peer computes the next epoch's gradients, and the step is applied once it finished.

Blocking (the default), a peer averages mid-micro-step (``mid_step``): when the target will
likely land within the next micro-step, the branch ``hand`` hands the accumulator over and
keeps it; the host averages it once the round is due, while the device computes that
micro-step (JAX dispatches it asynchronously). At its end ``take`` steps with that averaging,
and the micro-step's gradients start the next epoch's accumulator; if the round never began,
nothing changed. Under PowerSGD what is handed over is the mean plus the error feedback, and
the new error comes back with the averaging.

``compression=PowerSGD(rank=r)`` averages rank-``r`` approximations (:mod:`dedloc_jax.powersgd`):
the branch that averages adds this peer's error feedback to its mean gradients and hands them
with the factors ``Q`` to the host, whose round runs both phases; the host hands back the mean,
the new ``Q`` and the new error, which stay in the state (fixed shapes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from dedloc_jax.host import (
    Averaged,
    CollaborationHost,
    MicroStep,
    TransformBranches,
    check_options,
    connect,
    is_traced,
)
from dedloc_jax.powersgd import PowerSGD, initial_q
from dedloc_jax.state.transform_states import CollaborativeState, PowerSGDState

__all__ = ["CollaborativeState", "collaborative"]


def collaborative(
    inner: optax.GradientTransformation,
    collab: CollaborationHost,
    *,
    target_batch_size: int,
    accumulator_dtype: Any = jnp.float32,
    overlap: bool = False,
    callback: str = "auto",
    compression: PowerSGD | None = None,
    mid_step: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it steps once per collaboration-wide batch.

    Args:
      inner: the optimizer applied to the collaboration's averaged gradients; its step count
        is the collaboration's epoch (also for a newcomer that loaded the state of others).
      collab: the collaboration (:class:`dedloc_jax.Collaboration` or any
        :class:`dedloc_jax.host.CollaborationHost`).
      target_batch_size: samples the whole collaboration accumulates per step.
      accumulator_dtype: dtype of the gradient accumulator.
      overlap: delayed updates (DeDLOC): when the target is reached, this peer's gradients are
        handed to the collaboration, which averages them in the background while the peer
        accumulates the next epoch's; the inner step is applied at the first micro-step after
        the averaging finished (the gradients of that micro-step and of those in between were
        computed with the previous parameters). Needs a host with ``start_averaging`` and
        ``poll_averaging`` (:class:`dedloc_jax.host.OverlappingHost`). One training loop per
        transform: the averaging in flight is remembered on the host side.
      callback: how jitted code reaches the host: "auto" (NumPy views of XLA's buffers on
        CPU, ``jax.pure_callback`` on GPU and TPU), or force "buffer" or "pure".
      compression: :class:`dedloc_jax.PowerSGD` to average low-rank approximations of the
        gradients in two phases, with error feedback (None: the run's codec carries them
        whole). Every peer of a run must use the same settings.
      mid_step: without overlap, on a collaboration that can (:class:`dedloc_jax.host.MidStepHost`,
        as :class:`dedloc_jax.Collaboration`): when the target will likely land within the next
        micro-step, hand the accumulator over at the end of this one; the collaboration
        averages it as soon as the round is due, while the next micro-step computes, and that
        micro-step's gradients start the next epoch (none is thrown away). A peer whose
        micro-steps are long then averages when the target lands, not up to a micro-step
        later while every other peer waits for it. False: only the host call of a micro-step
        that reaches the target averages (its micro-step done).

    ``update(grads, state, params=None, *, batch_size)``: ``grads`` are the mean gradients of a
    micro-batch of ``batch_size`` samples.
    """
    check_options(target_batch_size, callback)
    if compression is not None and not isinstance(compression, PowerSGD):
        raise TypeError(f"compression must be a dedloc_jax.PowerSGD, got {compression!r}")
    wire = None if compression is None else {"codec": compression}
    calls = connect(
        collab, target_batch_size=target_batch_size, overlap=overlap, wire=wire, mid_step=mid_step
    )
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> CollaborativeState:
        return CollaborativeState(
            inner_state=inner.init(params),
            grad_sum=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), accumulator_dtype), params),
            samples=jnp.zeros((), jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            group_size=jnp.zeros((), jnp.int32),
            complete=jnp.zeros((), jnp.bool_),
            powersgd=None if compression is None else _initial_powersgd(compression, params),
        )

    def update(
        updates: optax.Updates,
        state: CollaborativeState,
        params: optax.Params | None = None,
        *,
        batch_size: int | jax.Array,
        **extra_args: Any,
    ) -> tuple[optax.Updates, CollaborativeState]:
        batch = jnp.asarray(batch_size, jnp.int32)
        samples = state.samples + batch
        step = MicroStep(calls, traced=is_traced(samples, updates), kind=callback, overlap=overlap)
        action = step.decide(state.epoch, samples, batch)
        grad_sum = _accumulated(state.grad_sum, updates, batch)
        branches = _Accumulation(inner, step, state, samples, params, extra_args, compression)
        out = branches.chosen(action)(updates, grad_sum, state.inner_state)
        return _masked(out, step.traced)

    return optax.GradientTransformationExtraArgs(init, update)


def _accumulated(grad_sum: optax.Updates, updates: optax.Updates, batch: jax.Array) -> Any:
    """The accumulator with this micro-batch in it. Every branch needs it: one fused pass per
    leaf, before the branch (in place when the state is donated)."""
    return jax.tree.map(
        lambda acc, g: acc + g.astype(acc.dtype) * batch.astype(acc.dtype), grad_sum, updates
    )


def _masked(out: tuple, traced: bool) -> tuple[optax.Updates, CollaborativeState]:
    """The updates (zero unless the branch stepped) and the new state, from a branch's output."""
    step_updates, inner_state, epoch, group_size, complete, grad_sum, samples, stepped = out[:8]
    if traced:
        step_updates = jax.tree.map(
            lambda u: jnp.where(stepped, u, jnp.zeros((), u.dtype)), step_updates
        )
    elif not stepped:
        step_updates = jax.tree.map(jnp.zeros_like, step_updates)
    return step_updates, CollaborativeState(
        inner_state=inner_state,
        grad_sum=grad_sum,
        samples=jnp.asarray(samples),
        epoch=jnp.asarray(epoch),
        group_size=jnp.asarray(group_size),
        complete=jnp.asarray(complete, jnp.bool_),
        powersgd=out[8],
    )


def _initial_powersgd(cfg: PowerSGD, params: optax.Params) -> PowerSGDState:
    """The first ``Q`` (from the seed: the same on every peer) and zero errors."""
    shapes = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]
    compressed = cfg.plan(shapes).compressed
    return PowerSGDState(
        q=tuple(jnp.asarray(q) for q in initial_q(cfg, shapes)),
        error=tuple(jnp.zeros(shapes[i], jnp.float32) for i in compressed),
    )


class _Accumulation(TransformBranches):
    """The branches of one micro-step of :func:`collaborative`.

    Each takes ``(grads, grad_sum, inner_state)`` and returns (updates, inner_state, epoch,
    group_size, complete, grad_sum, samples, stepped, powersgd). A branch that does not step
    returns the gradients it was given in the updates slot: they are dead after the branch, so
    XLA reuses their buffers instead of writing a zero tree, and ``stepped`` masks them (fused
    into the caller's ``apply_updates``).
    """

    def __init__(
        self,
        inner: optax.GradientTransformationExtraArgs,
        step: MicroStep,
        state: CollaborativeState,
        samples: jax.Array,
        params: optax.Params | None,
        extra_args: dict[str, Any],
        compression: PowerSGD | None = None,
    ) -> None:
        super().__init__(inner, step, state, samples, params, compression)
        self.extra_args = extra_args

    def keep(self, grads: Any, grad_sum: Any, inner_state: Any) -> tuple:
        kept = (grad_sum, self.samples, jnp.bool_(False), self.state.powersgd)
        return (*self._kept(grads, inner_state), *kept)

    def average(self, grads: Any, grad_sum: Any, inner_state: Any) -> tuple:
        means, treedef = self._means(grad_sum)
        averaged, taken = self.step.average(
            self.state.epoch, self.samples, self._sending(means), like=self._like(means)
        )
        averaged, powersgd = self._unpacked(averaged, len(means))
        out = self._step_with(grads, inner_state, treedef, averaged)
        return (*out, *self._consumed(grad_sum, taken), jnp.bool_(True), powersgd)

    def start(self, grads: Any, grad_sum: Any, inner_state: Any) -> tuple:
        means, _ = self._means(grad_sum)
        taken = self.step.start(self.state.epoch, self.samples, self._sending(means))
        consumed = self._consumed(grad_sum, taken)
        return (*self._kept(grads, inner_state), *consumed, jnp.bool_(False), self.state.powersgd)

    def apply(self, grads: Any, grad_sum: Any, inner_state: Any) -> tuple:
        leaves, treedef = jax.tree.flatten(grad_sum)
        averaged = self.step.collect(self.state.epoch, self._like(leaves) or leaves)
        averaged, powersgd = self._unpacked(averaged, len(leaves))
        out = self._step_with(grads, inner_state, treedef, averaged)
        return (*out, grad_sum, self.samples, jnp.bool_(True), powersgd)

    def hand(self, grads: Any, grad_sum: Any, inner_state: Any) -> tuple:
        """Hand the accumulator (this micro-step in) over; keep it until the round is taken."""
        means, _ = self._means(grad_sum)
        held = self.step.hand(self.state.epoch, self.samples, self._sending(means))
        return (
            *self._kept(grads, inner_state),
            grad_sum,
            held,
            jnp.bool_(False),
            self.state.powersgd,
        )

    def take(self, grads: Any, grad_sum: Any, inner_state: Any) -> tuple:
        """Step with the averaging of what was handed over (the accumulator before this
        micro-step); this micro-step's gradients begin the next epoch's accumulator."""
        leaves, treedef = jax.tree.flatten(grad_sum)
        averaged = self.step.take(self.state.epoch, self._like(leaves) or leaves)
        averaged, powersgd = self._unpacked(averaged, len(leaves))
        out = self._step_with(grads, inner_state, treedef, averaged)
        batch = self.samples - self.state.samples
        fresh = _accumulated(jax.tree.map(jnp.zeros_like, grad_sum), grads, batch)
        return (*out, fresh, batch, jnp.bool_(True), powersgd)

    # --- PowerSGD: what the host gets and gives back (see the module docstring) -----------
    def _compressed(self, leaves: list) -> tuple[int, ...]:
        assert self.compression is not None
        return self.compression.plan([tuple(x.shape) for x in leaves]).compressed

    def _sending(self, means: list) -> list:
        """The means, or PowerSGD's ``[*M, *Q, leaves]`` with ``M = mean + error``."""
        lowrank = self.state.powersgd
        if lowrank is None:
            return means
        ms = list(means)
        for j, i in enumerate(self._compressed(means)):
            ms[i] = ms[i].astype(jnp.float32) + lowrank.error[j]
        return [*ms, *lowrank.q, jnp.asarray(len(ms), jnp.int32)]

    def _like(self, leaves: list) -> list | None:
        """What the host hands back under PowerSGD: ``[*mean, *Q, *error]`` (else None)."""
        lowrank = self.state.powersgd
        return None if lowrank is None else [*leaves, *lowrank.q, *lowrank.error]

    def _unpacked(self, got: Averaged, count: int) -> tuple[Averaged, PowerSGDState | None]:
        """The mean leaves and the new PowerSGD state (the host's next ``Q`` and error)."""
        if self.state.powersgd is None:
            return got, None
        c = len(self.state.powersgd.q)
        qs, errors = got.leaves[count : count + c], got.leaves[count + c :]
        return got._replace(leaves=got.leaves[:count]), PowerSGDState(tuple(qs), tuple(errors))

    def _kept(self, grads: Any, inner_state: Any) -> tuple:
        """The step's slots of a branch that does not step."""
        state = self.state
        return (grads, inner_state, state.epoch, state.group_size, state.complete)

    def _means(self, grad_sum: optax.Updates) -> tuple[list, Any]:
        leaves, treedef = jax.tree.flatten(grad_sum)
        return [x / jnp.maximum(self.samples, 1).astype(x.dtype) for x in leaves], treedef

    def _step_with(self, grads: Any, inner_state: Any, treedef: Any, got: Averaged) -> tuple:
        """The inner step on the averaged gradients (cast to the gradients' dtypes)."""
        averaged = jax.tree.unflatten(treedef, got.leaves)
        averaged = jax.tree.map(lambda a, u: a.astype(u.dtype), averaged, grads)
        step_updates, inner_state = self.inner.update(
            averaged, inner_state, self.params, **self.extra_args
        )
        return step_updates, inner_state, got.epoch, got.group_size, got.complete

    def _consumed(self, grad_sum: optax.Updates, taken: jax.Array) -> tuple:
        """The accumulator and sample count once the host took ``taken`` samples.

        Computed from the host's answer, so XLA orders it after the host read the
        accumulator and can write it into the accumulator's buffer; a plain zero tree
        would have no such order, and XLA would copy the accumulator on every step.
        """
        zero = jax.tree.map(lambda a: jnp.where(taken > 0, jnp.zeros((), a.dtype), a), grad_sum)
        return zero, self.samples - taken
