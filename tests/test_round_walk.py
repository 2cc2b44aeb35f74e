"""bench.round_walk's count: stops in a reader's order, files, returns to a visited file."""

from __future__ import annotations

from bench.round_walk import Walk


def _stop(path: str, name: str) -> tuple[str, str, int]:
    return (path, name, 1)


def test_a_walk_counts_files_and_returns_depth_first() -> None:
    walk = Walk(epoch=0)
    top, branch, call = _stop("a.py", "top"), _stop("b.py", "branch"), _stop("a.py", "call")
    down, back = _stop("c.py", "down"), _stop("b.py", "back")
    # entered in this order; ``back`` was entered before ``down`` but is called by ``top``
    for i, stop in enumerate([top, branch, back, call, down]):
        walk.stops[stop] = i
    walk.caller.update({branch: top, call: branch, down: call, back: top})
    assert walk.order() == [top, branch, call, down, back]
    counts = walk.counts(deep=True)
    # a.py -> b.py -> a.py (a return) -> c.py -> b.py (a return)
    assert (counts["stops"], counts["files"], counts["returns"]) == (5, 3, 2)
    assert counts["returns_by_file"] == {"a.py": 1, "b.py": 1}


def test_p2p_below_the_collaboration_is_the_socket() -> None:
    walk = Walk(epoch=0)
    mine = _stop("dedloc_jax/x.py", "average")
    api, below = _stop("p2p/rpc.py", "send"), _stop("p2p/mux.py", "frames")
    for i, stop in enumerate([mine, api, below]):
        walk.stops[stop] = i
    walk.caller.update({api: mine, below: api})
    assert walk.counts()["walk"] == ["dedloc_jax/x.py:average", "p2p/rpc.py:send"]
    assert walk.counts(deep=True)["stops"] == 3
