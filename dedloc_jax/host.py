"""The boundary between jitted code and the collaboration, shared by both transforms.

The transforms (:func:`dedloc_jax.collaborative`, :func:`dedloc_jax.diloco`) run inside
``jax.jit``; everything that needs the network happens on the host, behind the small protocol
:class:`CollaborationHost`. :class:`dedloc_jax.Collaboration` implements it over the DHT and the
butterfly all-reduce; tests may implement it in-process.

A micro-step reaches the host with callbacks: a cheap one with scalars on every micro-step
(:meth:`HostCalls.decide`), whose answer (:data:`KEEP`, :data:`STEP` or :data:`APPLY`) picks a
``lax.switch`` branch, and, only in a branch that averages, one that moves the arrays. Why they
are built the way they are (``bench.optax_overhead`` measures it):

- They are ``buffer_callback``s: the host reads and writes XLA's buffers as NumPy views.
  ``io_callback``/``pure_callback`` first ``device_put`` every argument into a new ``jax.Array``,
  which costs far more than the host's own work on a micro-step.
- They carry no JAX effect. Any effect (``io_callback``, ordered or not) takes the jitted step off
  JAX's C++ dispatch path, on every call. Effects are not needed for order: each host call reads
  state that the previous one produced (``epoch``, ``samples``, the averaging result), so data
  dependencies sequence them; every result is consumed, so none is dropped; and XLA keeps a
  custom call inside its branch (never turned into a select that runs both branches).

The same code runs eagerly: :class:`MicroStep` then calls the host directly and takes the
branch with Python control flow (no work for the branches not taken).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from dedloc_jax.history import RoundOutcome

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # older JAX: pure_callback, same semantics, slower per call
    buffer_callback = None


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: {new}", DeprecationWarning, stacklevel=3)


class AveragingOutcome:
    """One averaging step as the collaboration's averaging calls hand it out: a view of the
    round's :class:`~dedloc_jax.history.RoundOutcome` (:attr:`record`), whose every field it
    reads through (``average``: the mean, ``next_epoch``, ``group_size``, ``complete``,
    ``reason``, ...); it holds nothing else.

    Deprecated names, kept for code written when this was a record of its own (a NamedTuple of
    ``gradients, epoch, group_size, complete``); each warns:

    - building one, ``AveragingOutcome(gradients, epoch, group_size, complete=True)``: a host
      returns a ``RoundOutcome(epoch - 1, group_size, complete, average=gradients)``;
    - ``epoch``: the epoch *after* the step, the record's ``next_epoch`` (the record's
      ``epoch`` is the epoch averaged toward, one less);
    - ``gradients``: the record's ``average``;
    - unpacking or indexing: the four old fields, in that order.
    """

    __slots__ = ("record",)
    record: RoundOutcome

    def __init__(
        self, gradients: Sequence[Any], epoch: int, group_size: int, complete: bool = True
    ) -> None:
        _deprecated(
            "AveragingOutcome(gradients, epoch, ...)",
            "return dedloc_jax.RoundOutcome(epoch - 1, group_size, complete, average=gradients)",
        )
        self.record = RoundOutcome(
            int(epoch) - 1, int(group_size), bool(complete), average=list(gradients)
        )

    @classmethod
    def of(cls, record: RoundOutcome) -> AveragingOutcome:
        """The view of ``record`` (no warning)."""
        view = object.__new__(cls)
        view.record = record
        return view

    def __getattr__(self, name: str) -> Any:  # (only names the class does not define)
        if name == "record":
            raise AttributeError(name)
        return getattr(self.record, name)

    @property
    def epoch(self) -> int:
        _deprecated("AveragingOutcome.epoch (the epoch after the step)", "read .next_epoch")
        return self.record.next_epoch

    @property
    def gradients(self) -> list[np.ndarray]:
        _deprecated("AveragingOutcome.gradients", "read .average")
        return self.record.average  # type: ignore[return-value]

    _fields = ("gradients", "epoch", "group_size", "complete")  # the old NamedTuple's

    def _values(self) -> tuple:
        """The old NamedTuple's values, in its order."""
        r = self.record
        return (r.average, r.next_epoch, r.group_size, r.complete)

    def __iter__(self) -> Iterator[Any]:
        _deprecated("unpacking an AveragingOutcome", "read its fields by name")
        return iter(self._values())

    def __getitem__(self, i: int) -> Any:
        _deprecated("indexing an AveragingOutcome", "read its fields by name")
        return self._values()[i]

    def __len__(self) -> int:
        return 4

    def __repr__(self) -> str:
        return f"AveragingOutcome.of({self.record!r})"


def round_record(outcome: Any) -> RoundOutcome:
    """The :class:`RoundOutcome` a host's averaging call returned: a record, a view of one, or
    (deprecated, warns) any object with the old fields ``gradients`` and ``epoch`` (the epoch
    after the step), ``group_size`` and optionally ``complete``."""
    if isinstance(outcome, RoundOutcome):
        return outcome
    if isinstance(outcome, AveragingOutcome):
        return outcome.record
    _deprecated(
        f"a host returning {type(outcome).__name__} (gradients, epoch after the step)",
        "return a dedloc_jax.RoundOutcome",
    )
    return RoundOutcome(
        int(outcome.epoch) - 1,
        int(outcome.group_size),
        bool(getattr(outcome, "complete", True)),
        average=list(outcome.gradients),
    )


class CollaborationHost(Protocol):
    """What :func:`dedloc_jax.collaborative` needs from a collaboration."""

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        """Record that this peer holds ``samples`` samples toward ``epoch`` after a micro-batch
        of ``batch_size``; return True when this peer should average now.

        Called on every micro-step, so it must be cheap: it only posts the numbers to the
        collaboration's background loop and reads its latest estimate.
        """
        ...

    def average_gradients(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int
    ) -> RoundOutcome | AveragingOutcome:
        """Average this peer's mean ``gradients`` over ``samples`` samples with ``epoch``'s
        group: the round's record, with the mean (same order, shapes and dtypes as given) in
        ``average`` (:class:`dedloc_jax.Collaboration` returns a view of it)."""
        ...


@runtime_checkable
class OverlappingHost(CollaborationHost, Protocol):
    """A collaboration that can average in the background, for ``overlap=True`` (DeDLOC's
    delayed updates: the peer keeps computing while its group averages)."""

    def start_averaging(self, epoch: int, gradients: Sequence[np.ndarray], samples: int) -> None:
        """Begin what :meth:`average_gradients` does and return at once (one at a time)."""
        ...

    def poll_averaging(self) -> RoundOutcome | AveragingOutcome | None:
        """The outcome of the averaging started last once it finished (then forgotten), else
        None. Cheap: called on every micro-step while an averaging is in flight."""
        ...


@runtime_checkable
class MidStepHost(CollaborationHost, Protocol):
    """A collaboration that averages a blocking peer's accumulator while its next micro-step
    computes (:mod:`dedloc_jax.handover`), so that a peer with long micro-steps averages when
    the target lands, not when its micro-step ends."""

    def report_whole_steps(self, epoch: int, samples: int, batch_size: int) -> bool:
        """:meth:`report_progress`, deciding on the samples peers hold in whole micro-steps."""
        ...

    def lands_within(self, seconds: float) -> bool:
        """Whether the target will likely land within ``seconds``. Cheap (every micro-step)."""
        ...

    def hand_over(self, epoch: int, gradients: Sequence[np.ndarray], samples: int) -> None:
        """Average ``gradients`` (as :meth:`average_gradients`) once the round is due, in the
        background, while the next micro-step computes; return at once."""
        ...

    def take_over(self) -> RoundOutcome | AveragingOutcome | None:
        """At the end of that micro-step: the outcome if the round began (waits for it), else
        None (it never will)."""
        ...


@runtime_checkable
class TargetedHost(Protocol):
    """A collaboration that trains toward (and publishes) the target a transform names."""

    def use_target(self, target: int) -> None:
        """Train toward ``target`` samples per step; ValueError when configured with another."""
        ...


# --- the options both transforms share ---------------------------------------------------
CALLBACKS = ("auto", "buffer", "pure")
KEEP, STEP, APPLY = 0, 1, 2  # what a micro-step does (the host's answer to every report)
HAND, TAKE = 3, 4  # blocking, mid-step: hand the accumulator over; step with its averaging
INT32 = jax.ShapeDtypeStruct((), jnp.int32)


def check_options(target_batch_size: int, callback: str) -> None:
    if target_batch_size <= 0:
        raise ValueError(f"target_batch_size must be positive, got {target_batch_size}")
    if callback not in CALLBACKS:
        raise ValueError(f"callback must be one of {CALLBACKS}, got {callback!r}")


def connect(
    collab: CollaborationHost,
    *,
    target_batch_size: int,
    overlap: bool,
    wire: dict[str, Any] | None = None,
    mid_step: bool = False,
) -> HostCalls:
    """The host calls of one transform on ``collab``: tells it the target (a collaboration
    configured with another raises a ValueError naming both) and checks it can overlap.
    ``mid_step``: a blocking transform that averages mid-step where ``collab`` can
    (:class:`MidStepHost`)."""
    if isinstance(collab, TargetedHost):
        collab.use_target(int(target_batch_size))
    if overlap and not isinstance(collab, OverlappingHost):
        raise TypeError(
            "overlap=True needs a collaboration with start_averaging and poll_averaging "
            f"(dedloc_jax.host.OverlappingHost); {type(collab).__name__} has not"
        )
    mid_step = mid_step and not overlap and isinstance(collab, MidStepHost)
    return HostCalls(collab, wire, mid_step=mid_step)


def is_traced(*trees: Any) -> bool:
    """Whether any leaf of ``trees`` is a tracer (the update runs under ``jax.jit``)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


# --- the host side: plain Python on NumPy -------------------------------------------------
def _done(outcome: RoundOutcome) -> np.int32:
    """Whether an outcome averaged with the whole collaboration, as the int32 sent back."""
    return np.int32(bool(outcome.complete) and outcome.group_size > 1)


def _handed_back(outcome: RoundOutcome, specs: Sequence[Any]) -> tuple:
    """What the jitted side gets of an averaging: the mean (arrays of ``specs``), the epoch
    after the step, the group's size and whether it was complete."""
    avg = _check_outcome(outcome.average or [], specs)
    return (*avg, np.int32(outcome.next_epoch), np.int32(outcome.group_size), _done(outcome))


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
    """The host side of a transform: plain Python on NumPy, shared by the jitted and the
    eager paths and by both transforms. ``wire``: keyword arguments every averaging call passes
    on (diloco's codec). One training loop per instance: with overlap, the averaging in flight
    is remembered here; so is, with ``mid_step`` (a :class:`MidStepHost`), the accumulator
    handed over at the end of the last micro-step (``handed``: its epoch) and the outcome
    of its round (``taken``)."""

    def __init__(
        self, collab: CollaborationHost, wire: dict[str, Any] | None = None, *, mid_step=False
    ) -> None:
        self.collab = collab
        self.wire = dict(wire or {})
        self.in_flight: dict[str, Any] = {"active": False, "outcome": None}
        self.mid_step = mid_step
        self.handed: int | None = None
        self.taken: RoundOutcome | None = None
        self._last: float | None = None  # time.monotonic() of the last micro-step's end

    def decide(self, epoch: np.ndarray, samples: np.ndarray, batch: np.ndarray) -> tuple:
        """KEEP, STEP or APPLY for this micro-step (HAND or TAKE with ``mid_step``)."""
        if self.mid_step:
            return (self._decide_mid_step(int(epoch), int(samples), int(batch)),)
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

    def _decide_mid_step(self, epoch: int, samples: int, batch: int) -> np.int32:
        """TAKE when the accumulator handed over at the last micro-step was averaged (this
        micro-step's gradients start the next epoch); else STEP or KEEP as ever, or HAND when
        the target will likely land within the next micro-step (as long as this one)."""
        collab: Any = self.collab
        now = time.monotonic()
        step, self._last = (None if self._last is None else now - self._last), now
        if self.handed is not None:
            handed, self.handed = self.handed, None
            outcome = collab.take_over()
            if outcome is not None and handed == epoch:
                self.taken = round_record(outcome)
                # (this micro-step counts toward the next epoch: nothing is thrown away)
                collab.report_whole_steps(self.taken.next_epoch, batch, batch)
                return np.int32(TAKE)
            # (not begun: nothing changed; another epoch: the state was replaced meanwhile)
        if collab.report_whole_steps(epoch, samples, batch):
            return np.int32(STEP)
        if step is not None and samples > 0 and collab.lands_within(step):
            return np.int32(HAND)
        return np.int32(KEEP)

    def average(
        self,
        epoch: np.ndarray,
        samples: np.ndarray,
        *arrays: np.ndarray,
        like: Sequence[Any] | None = None,
    ) -> tuple:
        """Average ``arrays``: the averages (shaped like ``arrays``, or like ``like`` when the
        arrays are a compressed form), the outcome's epoch, group size and whether it was
        complete, and the samples consumed (all of them)."""
        # Copies: in the jitted path the inputs are views of XLA buffers that die after the call.
        sent = [np.array(a, copy=True) for a in arrays]
        got = self.collab.average_gradients(int(epoch), sent, int(samples), **self.wire)
        outcome = round_record(got)
        self._last = time.monotonic()  # (the next micro-step is measured from here)
        return (*_handed_back(outcome, arrays if like is None else like), np.int32(samples))

    def hand(self, epoch: np.ndarray, samples: np.ndarray, *arrays: np.ndarray) -> tuple:
        """Hand ``arrays`` over to be averaged once due, while the next micro-step computes:
        the samples held (they stay in the accumulator until the round is taken)."""
        sent = [np.array(a, copy=True) for a in arrays]
        self.collab.hand_over(int(epoch), sent, int(samples), **self.wire)  # type: ignore[attr-defined]
        self.handed = int(epoch)
        return (np.int32(samples),)

    def take(self, specs: Sequence[jax.ShapeDtypeStruct]) -> Callable[..., tuple]:
        """The host function that hands over the averaging of the handed-over accumulator."""

        def take(epoch: np.ndarray) -> tuple:
            outcome, self.taken = self.taken, None
            if outcome is None:
                raise RuntimeError("no handed-over averaging to apply")
            self._last = time.monotonic()
            return _handed_back(outcome, specs)

        return take

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
            return _handed_back(round_record(outcome), specs)

        return collect


# --- the jitted side: reaching the host from traced code ----------------------------------
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


def host_caller(traced: bool, kind: str) -> Callable[..., list]:
    """``host(fn, result_shapes, *args)``: ``fn`` on the host, through a callback of ``kind``
    when traced, called directly when eager."""

    def host(fn: Callable[..., tuple], shapes: Sequence[Any], *args: Any) -> list:
        if traced:
            return _host_call(fn, shapes, *args, kind=kind)
        return [jnp.asarray(r) for r in fn(*(np.asarray(a) for a in args))]

    return host


class Averaged(NamedTuple):
    """An averaging as the transform sees it: the mean leaves (the shapes and dtypes sent),
    the epoch after it, the group's size and whether it was complete (bool)."""

    leaves: list[jax.Array]
    epoch: jax.Array
    group_size: jax.Array
    complete: jax.Array


class Branches(NamedTuple):
    """What a transform does on each of the host's answers; every branch takes the same
    operands and returns values of the same structure (they are ``lax.switch`` branches)."""

    keep: Callable[..., Any]  # KEEP: go on accumulating
    average: Callable[..., Any]  # STEP without overlap: average now and step
    start: Callable[..., Any]  # STEP with overlap: start averaging in the background
    apply: Callable[..., Any]  # APPLY (overlap only): step with the finished averaging
    hand: Callable[..., Any] | None = None  # HAND (blocking, mid-step): hand the sum over
    take: Callable[..., Any] | None = None  # TAKE: step with its averaging, restart the sum


class TransformBranches:
    """The branches of one micro-step of a transform, over what they all read: the ``inner``
    optimizer, the way across the boundary (``step``), the ``state`` before the micro-step,
    the ``samples`` with this micro-batch in, the caller's ``params`` and the ``compression``.
    A transform writes the four branches (:class:`Branches`)."""

    def __init__(
        self,
        inner: Any,
        step: MicroStep,
        state: Any,
        samples: jax.Array,
        params: Any,
        compression: Any = None,
    ) -> None:
        self.inner = inner
        self.step = step
        self.state = state
        self.samples = samples
        self.params = params
        self.compression = compression

    def table(self) -> Branches:
        return Branches(self.keep, self.average, self.start, self.apply, self.hand, self.take)

    def chosen(self, action: jax.Array) -> Callable[..., Any]:
        """The branch the host's answer names, to call with the operands (see
        :meth:`MicroStep.branch`)."""
        return self.step.branch(action, self.table())

    def keep(self, *operands: Any) -> Any:
        raise NotImplementedError

    def average(self, *operands: Any) -> Any:
        raise NotImplementedError

    def start(self, *operands: Any) -> Any:
        raise NotImplementedError

    def apply(self, *operands: Any) -> Any:
        raise NotImplementedError

    def hand(self, *operands: Any) -> Any:
        raise NotImplementedError

    def take(self, *operands: Any) -> Any:
        raise NotImplementedError


def _specs(leaves: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]


class MicroStep:
    """One micro-step's way across the boundary: host callbacks of ``kind`` when ``traced``,
    direct calls when eager; and the one dispatch on the host's answer."""

    def __init__(self, calls: HostCalls, *, traced: bool, kind: str, overlap: bool) -> None:
        self.calls = calls
        self.traced = traced
        self.overlap = overlap
        self.mid_step = calls.mid_step
        self._host = host_caller(traced, kind)

    def decide(self, epoch: jax.Array, samples: jax.Array, batch: jax.Array) -> jax.Array:
        """The host's answer to this micro-step's report: KEEP, STEP or APPLY."""
        (action,) = self._host(self.calls.decide, [INT32], epoch, samples, batch)
        return action

    def average(
        self,
        epoch: jax.Array,
        samples: jax.Array,
        leaves: Sequence[jax.Array],
        like: Sequence[Any] | None = None,
    ) -> tuple[Averaged, jax.Array]:
        """Average ``leaves`` now: the averaging (leaves shaped like ``like`` when given: the
        leaves sent are then a compressed form) and the samples it consumed."""
        specs = _specs(leaves if like is None else like)
        fn = (
            self.calls.average
            if like is None
            else functools.partial(self.calls.average, like=specs)
        )
        *avg, new_epoch, group_size, complete, taken = self._host(
            fn, [*specs, INT32, INT32, INT32, INT32], epoch, samples, *leaves
        )
        return Averaged(avg, new_epoch, group_size, complete.astype(jnp.bool_)), taken

    def start(self, epoch: jax.Array, samples: jax.Array, leaves: Sequence[jax.Array]) -> jax.Array:
        """Start averaging ``leaves`` in the background: the samples consumed."""
        (taken,) = self._host(self.calls.start, [INT32], epoch, samples, *leaves)
        return taken

    def collect(self, epoch: jax.Array, like: Sequence[jax.Array]) -> Averaged:
        """The finished background averaging, as leaves shaped like ``like``."""
        specs = _specs(like)
        *avg, new_epoch, group_size, complete = self._host(
            self.calls.collect(specs), [*specs, INT32, INT32, INT32], epoch
        )
        return Averaged(avg, new_epoch, group_size, complete.astype(jnp.bool_))

    def hand(self, epoch: jax.Array, samples: jax.Array, leaves: Sequence[jax.Array]) -> jax.Array:
        """Hand ``leaves`` over to be averaged while the next micro-step computes: the samples
        held (the host's answer, so that the call is kept)."""
        (held,) = self._host(self.calls.hand, [INT32], epoch, samples, *leaves)
        return held

    def take(self, epoch: jax.Array, like: Sequence[jax.Array]) -> Averaged:
        """The averaging of the handed-over leaves, as leaves shaped like ``like``."""
        specs = _specs(like)
        *avg, new_epoch, group_size, complete = self._host(
            self.calls.take(specs), [*specs, INT32, INT32, INT32], epoch
        )
        return Averaged(avg, new_epoch, group_size, complete.astype(jnp.bool_))

    def branch(self, action: jax.Array, branches: Branches) -> Callable[..., Any]:
        """The branch the host's answer names, for the transform to call with its operands:
        one ``lax.switch`` over them when traced, the branch itself when eager (no work for the
        branches not taken; the transform runs its branch, not this boundary)."""
        if self.overlap:
            table = [branches.keep, branches.start, branches.apply]
        elif self.mid_step:
            # KEEP against the rest, then which of the rest (APPLY never comes): a switch of
            # more than two branches makes XLA copy the state on every micro-step; two do not.
            rest = [branches.average, branches.average, branches.hand, branches.take]
            if not self.traced:
                return ([branches.keep, *rest])[int(action)]
            acting = functools.partial(self._switch, action - 1, rest)
            return functools.partial(
                jax.lax.switch, jnp.minimum(action, 1), [branches.keep, acting]
            )
        else:
            table = [branches.keep, branches.average]
        if self.traced:
            return functools.partial(jax.lax.switch, action, table)
        return table[int(action)]

    @staticmethod
    def _switch(index: jax.Array, table: list, *operands: Any) -> Any:
        return jax.lax.switch(index, table, *operands)

    def cond(self, pred: Any, if_true: Callable[..., Any], if_false: Callable[..., Any], *ops: Any):
        """``lax.cond`` when traced, Python when eager."""
        if self.traced:
            return jax.lax.cond(pred, if_true, if_false, *ops)
        return (if_true if bool(pred) else if_false)(*ops)
