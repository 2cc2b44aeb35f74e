"""The simulated network's pure fluid model: max-min fair rates, infinite links.

The model runs on its own event engine, in virtual time, without trio.
"""

from __future__ import annotations

import math

import pytest

from p2p.sim.engine import Engine
from p2p.sim.fluid import Flow, FluidNet


def test_fluid_max_min_rates():
    """Progressive filling: capacity a flow cannot use goes to the others on its link."""
    eng = Engine()
    fluid = FluidNet(eng)
    a_up = fluid.new_link("a.up", 100.0)
    b_down = fluid.new_link("b.down", 20.0)
    c_down = fluid.new_link("c.down", math.inf)
    d_down = fluid.new_link("d.down", math.inf)
    got: list[tuple[str, float]] = []
    ab = Flow(a_up, b_down, lambda p, t: got.append(("ab", t)))
    ac = Flow(a_up, c_down, lambda p, t: got.append(("ac", t)))
    ad = Flow(a_up, d_down, lambda p, t: got.append(("ad", t)))
    eng.run_until(0.0)
    for f in (ab, ac, ad):
        fluid.enqueue(f, b"x" * 1000)
    assert fluid.flush()  # the three starts are one reallocation
    assert fluid.reallocations == 1 and not fluid.flush()
    # a.up = 100 shared by three flows, but a->b is held to 20 by b's downlink: 40 + 40 + 20
    assert ab.rate == pytest.approx(20.0)
    assert ac.rate == pytest.approx(40.0)
    assert ad.rate == pytest.approx(40.0)
    eng.run_until(100.0)
    # ac, ad finish at 1000/40 = 25 s; then a->b alone, still capped at 20: 1000/20 = 50 s
    assert sorted(got) == [("ab", 50.0), ("ac", pytest.approx(25.0)), ("ad", pytest.approx(25.0))]
    assert got[-1][0] == "ab"
    assert not a_up.flows and not b_down.flows


def test_fluid_infinite_links_deliver_at_once():
    eng = Engine()
    fluid = FluidNet(eng)
    up, down = fluid.new_link("u", math.inf), fluid.new_link("d", math.inf)
    got: list[tuple[bytes, float]] = []
    flow = Flow(up, down, lambda p, t: got.append((p, t)))
    eng.run_until(3.0)
    fluid.enqueue(flow, b"abc")
    assert got == [(b"abc", 3.0)]
    with pytest.raises(ValueError):
        fluid.new_link("zero", 0)
