"""``collaborative``: an optax transformation that trains with a DeDLOC collaboration.

Like :func:`optax.MultiSteps`, it accumulates micro-batch gradients and returns zero updates until
a step is due. The difference is who decides: the step is due when the *whole collaboration* has
accumulated ``target_batch_size`` samples. Then this peer's accumulated mean gradient is averaged
with its group (weights = samples), the inner optimizer is applied to the average, and the
accumulator is reset. Every peer of a group receives bit-identical averages and holds the same
inner state, so every peer takes the same step.

Inside ``jax.jit`` the host is reached with callbacks: a cheap one with scalars on every
micro-step, whose answer picks a ``lax.switch`` branch, and, only in the branch that averages,
one that moves the gradient buffers. Why they are built the way they are (``bench.optax_overhead``
measures it):

- They are ``buffer_callback``s: the host reads and writes XLA's buffers as NumPy views.
  ``io_callback``/``pure_callback`` first ``device_put`` every argument into a new ``jax.Array``,
  which costs far more than the host's own work on a micro-step.
- They carry no JAX effect. Any effect (``io_callback``, ordered or not) takes the jitted step off
  JAX's C++ dispatch path, on every call. Effects are not needed for order: each host call reads
  state that the previous one produced (``epoch``, ``samples``, the averaging result), so data
  dependencies sequence them; every result is consumed, so none is dropped; and XLA keeps a
  custom call inside its branch (never turned into a select that runs both branches).
- A step that does not average costs what plain optax costs, pass for pass over memory: the
  accumulator takes the micro-batch in one fused pass before the branch; the big state crosses
  the branch untouched (with donated buffers XLA aliases it: no copy); and no zero tree is
  written: the branch hands back the gradients' own dead buffers, masked to zero outside it by a
  ``where`` that XLA fuses into the caller's ``apply_updates``. Every value a branch writes in
  place of one it read is computed from the host's answer, which orders the write after the read,
  so XLA can reuse the buffer instead of copying it on every step.

``overlap=True`` gives DeDLOC's delayed updates: the averaging runs in the background while the
peer computes the next epoch's gradients, and the step is applied once it finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dedloc_jax.host import CollaborationHost

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # older JAX: pure_callback, same semantics, slower per call
    buffer_callback = None

__all__ = ["CollaborativeState", "collaborative"]


class CollaborativeState(NamedTuple):
    """State of :func:`collaborative`: fixed shapes and dtypes, so jit never recompiles."""

    inner_state: optax.OptState
    grad_sum: optax.Updates  # sum over micro-batches of (mean gradient x batch size), float32
    samples: jax.Array  # int32: samples accumulated toward the current epoch
    epoch: jax.Array  # int32: collaboration epoch this peer is in
    group_size: jax.Array  # int32: peers in the last averaging group (0 before the first)
    # bool: the last step averaged with the whole collaboration (False before the first, and
    # after a step alone or one whose mean missed part of the run: keep_in_step then loads
    # the others' state)
    complete: jax.Array


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


CALLBACKS = ("auto", "buffer", "pure")


def _buffer_views_work() -> bool:
    """Whether ``buffer_callback``'s buffers can be read as NumPy views here: on CPU only
    (a GPU buffer offers ``__cuda_array_interface__``, and TPUs cannot lower it)."""
    return buffer_callback is not None and jax.default_backend() == "cpu"


def _host_call(
    fn: Callable[..., Sequence[Any]],
    result_shapes: Sequence[jax.ShapeDtypeStruct],
    *args: Any,
    kind: str = "auto",
) -> list[jax.Array]:
    """Call ``fn(*numpy_args) -> results`` on the host from traced code (see module docstring).

    ``kind``: "buffer" (NumPy views of XLA's buffers: the cheapest, CPU only), "pure"
    (``jax.pure_callback``: copies, works on every platform) or "auto" (chosen when traced:
    buffer views on CPU, the pure callback elsewhere). The arguments are valid only during
    the call; the results are written into XLA's output buffers.
    """
    shapes = tuple(result_shapes)
    if kind == "auto":
        kind = "buffer" if _buffer_views_work() else "pure"
    if kind == "buffer" and buffer_callback is None:
        raise RuntimeError("this JAX has no buffer_callback: use callback='pure'")
    if kind == "pure":
        outs = jax.pure_callback(lambda *a: tuple(fn(*map(np.asarray, a))), shapes, *args)
        return list(outs)

    def on_host(_ctx: Any, out: tuple, *buffers: Any) -> None:
        results = fn(*(np.asarray(b) for b in buffers))
        for buf, value in zip(out, results, strict=True):
            np.asarray(buf)[...] = value

    return list(buffer_callback(on_host, shapes)(*args))


KEEP, STEP, APPLY = 0, 1, 2  # what a micro-step does (the host's answer to every report)


def _done(outcome: Any) -> np.int32:
    """Whether an outcome averaged with the whole collaboration, as the int32 sent back."""
    return np.int32(bool(getattr(outcome, "complete", True)) and outcome.group_size > 1)


def _check_outcome(gradients: Sequence[Any], want: Sequence[Any]) -> list[np.ndarray]:
    """The averaged gradients as arrays of the shapes and dtypes that were sent."""
    if len(gradients) != len(want):
        raise ValueError("the collaboration returned a different number of gradient arrays")
    out = []
    for got, spec in zip(gradients, want, strict=True):
        got = np.asarray(got)
        if got.shape != tuple(spec.shape):
            raise ValueError(f"averaged gradient has shape {got.shape}, expected {spec.shape}")
        out.append(got.astype(spec.dtype, copy=False))
    return out


class HostCalls:
    """The host side of a collaborative transform: plain Python on NumPy, shared by the
    jitted and the eager paths (and by :func:`dedloc_jax.diloco.diloco`). ``wire``: keyword
    arguments every averaging call passes on (diloco's codec). One training loop per
    instance: with overlap, the averaging in flight is remembered here."""

    def __init__(self, collab: CollaborationHost, wire: dict[str, Any] | None = None) -> None:
        self.collab = collab
        self.wire = dict(wire or {})
        self.in_flight: dict[str, Any] = {"active": False, "outcome": None}

    def decide(self, epoch: np.ndarray, samples: np.ndarray, batch: np.ndarray) -> tuple:
        """KEEP, STEP or APPLY for this micro-step."""
        in_flight = self.in_flight
        if in_flight["active"]:
            # Not reported while averaging: others must not see this peer in the next epoch
            # before its registration for this one is in; the next report carries all samples.
            if in_flight["outcome"] is None:
                try:
                    in_flight["outcome"] = self.collab.poll_averaging()  # type: ignore[attr-defined]
                except Exception:  # the averaging failed: re-raised, and nothing is in flight
                    in_flight.update(active=False, outcome=None)
                    raise
            return (np.int32(KEEP if in_flight["outcome"] is None else APPLY),)
        ready = self.collab.report_progress(int(epoch), int(samples), int(batch))
        return (np.int32(STEP if ready else KEEP),)

    def average(self, epoch: np.ndarray, samples: np.ndarray, *arrays: np.ndarray) -> tuple:
        """Average ``arrays``: the averages, the outcome's epoch, group size and whether it
        was complete, and the samples consumed (all of them)."""
        # Copies: in the jitted path the inputs are views of XLA buffers that die after the call.
        sent = [np.array(a, copy=True) for a in arrays]
        outcome = self.collab.average_gradients(int(epoch), sent, int(samples), **self.wire)
        avg = _check_outcome(outcome.gradients, arrays)
        outcome_of = (np.int32(outcome.epoch), np.int32(outcome.group_size), _done(outcome))
        return (*avg, *outcome_of, np.int32(samples))

    def start(self, epoch: np.ndarray, samples: np.ndarray, *arrays: np.ndarray) -> tuple:
        """Start averaging ``arrays`` in the background: the samples consumed, as in
        :meth:`average`."""
        sent = [np.array(a, copy=True) for a in arrays]
        self.collab.start_averaging(int(epoch), sent, int(samples), **self.wire)  # type: ignore[attr-defined]
        self.in_flight.update(active=True, outcome=None)
        return (np.int32(samples),)

    def collect(self, specs: Sequence[jax.ShapeDtypeStruct]) -> Callable[..., tuple]:
        """The host function that hands over the finished averaging (arrays of ``specs``)."""

        def collect(epoch: np.ndarray) -> tuple:
            outcome = self.in_flight["outcome"]
            if outcome is None:
                raise RuntimeError("no finished averaging to apply")
            self.in_flight.update(active=False, outcome=None)
            avg = _check_outcome(outcome.gradients, specs)
            return (*avg, np.int32(outcome.epoch), np.int32(outcome.group_size), _done(outcome))

        return collect


def host_caller(traced: bool, kind: str) -> Callable[..., list]:
    """``host(fn, result_shapes, *args)``: ``fn`` on the host, through a callback of ``kind``
    when traced, called directly when eager."""

    def host(fn: Callable[..., tuple], shapes: Sequence[Any], *args: Any) -> list:
        if traced:
            return _host_call(fn, shapes, *args, kind=kind)
        return [jnp.asarray(r) for r in fn(*(np.asarray(a) for a in args))]

    return host


def collaborative(
    inner: optax.GradientTransformation,
    collab: CollaborationHost,
    *,
    target_batch_size: int,
    accumulator_dtype: Any = jnp.float32,
    overlap: bool = False,
    callback: str = "auto",
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

    ``update(grads, state, params=None, *, batch_size)``: ``grads`` are the mean gradients of a
    micro-batch of ``batch_size`` samples.
    """
    if target_batch_size <= 0:
        raise ValueError(f"target_batch_size must be positive, got {target_batch_size}")
    if callback not in CALLBACKS:
        raise ValueError(f"callback must be one of {CALLBACKS}, got {callback!r}")
    # The collaboration trains toward (and publishes) this target; one configured with
    # another raises a ValueError naming both.
    use_target = getattr(collab, "use_target", None)
    if use_target is not None:
        use_target(int(target_batch_size))
    if overlap and not all(hasattr(collab, m) for m in ("start_averaging", "poll_averaging")):
        raise TypeError(
            "overlap=True needs a collaboration with start_averaging and poll_averaging "
            f"(dedloc_jax.host.OverlappingHost); {type(collab).__name__} has not"
        )
    inner = optax.with_extra_args_support(inner)
    calls = HostCalls(collab)

    def init(params: optax.Params) -> CollaborativeState:
        return CollaborativeState(
            inner_state=inner.init(params),
            grad_sum=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), accumulator_dtype), params),
            samples=jnp.zeros((), jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            group_size=jnp.zeros((), jnp.int32),
            complete=jnp.zeros((), jnp.bool_),
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
        traced = any(_is_tracer(x) for x in (samples, *jax.tree.leaves(updates)))
        int32 = jax.ShapeDtypeStruct((), jnp.int32)

        host = host_caller(traced, callback)
        (action,) = host(calls.decide, [int32], state.epoch, samples, batch)

        # Every branch needs the accumulator with this micro-batch in it: one fused pass per leaf,
        # before the branch (in place when the state is donated).
        grad_sum = jax.tree.map(
            lambda acc, g: acc + g.astype(acc.dtype) * batch.astype(acc.dtype),
            state.grad_sum,
            updates,
        )

        def means_of(grad_sum: optax.Updates) -> tuple[list, Any]:
            leaves, treedef = jax.tree.flatten(grad_sum)
            return [x / jnp.maximum(samples, 1).astype(x.dtype) for x in leaves], treedef

        def step_with(grads: optax.Updates, inner_state: optax.OptState, treedef: Any, got: list):
            *avg_leaves, new_epoch, group_size, complete = got
            averaged = jax.tree.unflatten(treedef, avg_leaves)
            averaged = jax.tree.map(lambda a, u: a.astype(u.dtype), averaged, grads)
            step_updates, inner_state = inner.update(averaged, inner_state, params, **extra_args)
            return step_updates, inner_state, new_epoch, group_size, complete.astype(jnp.bool_)

        def zeros(tree: Any) -> Any:
            return jax.tree.map(jnp.zeros_like, tree)

        def consumed(grad_sum: optax.Updates, taken: jax.Array) -> tuple[optax.Updates, jax.Array]:
            """The accumulator and sample count once the host took ``taken`` samples.

            Computed from the host's answer, so XLA orders it after the host read the
            accumulator and can write it into the accumulator's buffer; a plain zero tree
            would have no such order, and XLA would copy the accumulator on every step.
            """
            zero = jax.tree.map(lambda a: jnp.where(taken > 0, jnp.zeros((), a.dtype), a), grad_sum)
            return zero, samples - taken

        # Each branch returns (updates, inner_state, epoch, group_size, complete, grad_sum,
        # samples, stepped). A branch that does not step returns the gradients it was given in the
        # updates slot: they are dead after the branch, so XLA reuses their buffers instead of
        # writing a zero tree, and ``stepped`` masks them below (fused into the caller's
        # ``apply_updates``).
        def keep_accumulating(grads, grad_sum, inner_state) -> tuple:
            kept = (grads, inner_state, state.epoch, state.group_size, state.complete)
            return (*kept, grad_sum, samples, jnp.bool_(False))

        def average_and_step(grads, grad_sum, inner_state) -> tuple:
            means, treedef = means_of(grad_sum)
            specs = [jax.ShapeDtypeStruct(m.shape, m.dtype) for m in means]
            shapes = [*specs, int32, int32, int32, int32]
            *got, taken = host(calls.average, shapes, state.epoch, samples, *means)
            out = step_with(grads, inner_state, treedef, got)
            return (*out, *consumed(grad_sum, taken), jnp.bool_(True))

        def start_averaging(grads, grad_sum, inner_state) -> tuple:
            means, _ = means_of(grad_sum)
            (taken,) = host(calls.start, [int32], state.epoch, samples, *means)
            kept = (grads, inner_state, state.epoch, state.group_size, state.complete)
            return (*kept, *consumed(grad_sum, taken), jnp.bool_(False))

        def apply_averaged(grads, grad_sum, inner_state) -> tuple:
            leaves, treedef = jax.tree.flatten(grad_sum)
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
            got = host(calls.collect(specs), [*specs, int32, int32, int32], state.epoch)
            out = step_with(grads, inner_state, treedef, got)
            return (*out, grad_sum, samples, jnp.bool_(True))

        if overlap:
            branches = [keep_accumulating, start_averaging, apply_averaged]
        else:
            branches = [keep_accumulating, average_and_step]
        operands = (updates, grad_sum, state.inner_state)
        if traced:
            out = jax.lax.switch(action, branches, *operands)
        else:  # eager: Python control flow, and no work for the branch not taken
            out = branches[int(action)](*operands)
        step_updates, inner_state, epoch, group_size, complete, grad_sum, samples, stepped = out
        if traced:
            step_updates = jax.tree.map(
                lambda u: jnp.where(stepped, u, jnp.zeros((), u.dtype)), step_updates
            )
        elif not stepped:
            step_updates = zeros(step_updates)
        return step_updates, CollaborativeState(
            inner_state=inner_state,
            grad_sum=grad_sum,
            samples=jnp.asarray(samples),
            epoch=jnp.asarray(epoch),
            group_size=jnp.asarray(group_size),
            complete=jnp.asarray(complete, jnp.bool_),
        )

    return optax.GradientTransformationExtraArgs(init, update)
