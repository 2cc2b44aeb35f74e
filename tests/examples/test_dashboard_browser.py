"""The coordinator's dashboard, rendered by a real browser (Debian's ``chromium``, headless).

The status comes from the coordinator's own code path: signed-slot metrics records of two
peers, parsed as the DHT hands them over, aggregated per epoch and turned into the status the
dashboard serves. Chromium loads the page, runs its script (which fetches ``api/status``) and
prints the DOM; the peers' rows, their throughput and the drawn loss curve must be in it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dedloc_jax.progress import CollaborationEstimate
from examples.sahajbert.config import NetConfig, TrainerConfig
from examples.sahajbert.coordinator import Coordinator, CoordinatorOptions
from examples.sahajbert.dashboard import Dashboard
from examples.sahajbert.metrics import EpochFigures, EpochTable, PeerMetrics, parse_records
from p2p.dht import owner_marker
from p2p.identity import Identity

CHROMIUM = Path("/usr/bin/chromium")
# Headless, no sandbox (root in CI containers), and nothing that reaches out to the network.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.is_file(), reason="needs /usr/bin/chromium (Debian: apt-get install chromium)"
    ),
    pytest.mark.timeout(180),
]


def _peer(peer: str, mode: str, rate: float, losses: list[float]) -> PeerMetrics:
    history = tuple(EpochFigures(e, loss, 48, 4.0) for e, loss in enumerate(losses))
    return PeerMetrics(
        peer=peer,
        epoch=len(losses),
        loss=losses[-1],
        samples_per_second=rate,
        micro_steps=6 * len(losses),
        samples=48 * len(losses),
        mode=mode,
        upload_bps=1.5e6 if mode == "node" else 0.25e6,
        download_bps=2.5e6,
        sent_bps=0.5e6,
        received_bps=0.75e6,
        history=history,
    )


def _status(tmp_path: Path, url: str) -> tuple[dict, list[str]]:
    """What the coordinator would serve after three epochs of two peers."""
    peers = [Identity.generate().peer_id for _ in range(2)]
    ids = [str(p) for p in peers]
    records = [
        _peer(ids[0], "node", 12.4, [7.6, 7.1, 6.7]),
        _peer(ids[1], "client", 4.6, [7.5, 7.0, 6.8]),
    ]
    wire = {owner_marker(p): r.to_record() for p, r in zip(peers, records, strict=True)}
    parsed = parse_records(wire)
    cfg = TrainerConfig.demo(tmp_path)
    coord = Coordinator(cfg, NetConfig(), CoordinatorOptions(out_dir=tmp_path / "run"))
    coord.table = EpochTable(cfg.target_batch_size)
    coord.table.add(parsed, now=0.0)
    coord.table.flush()
    est = CollaborationEstimate(
        epoch=3, samples=40.0, samples_per_second=17.0, eta=3.3, num_peers=2, num_clients=1,
        target=cfg.target_batch_size,
    )  # fmt: skip
    return coord._status(parsed, est, url, ["/ip4/127.0.0.1/tcp/1/p2p/x"]), ids


def _chromium(args: list[str], user_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={user_dir}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dashboard_page_shows_the_peers_and_the_loss_curve(tmp_path: Path) -> None:
    with Dashboard("sahajbert-demo") as dash:
        dash.status, ids = _status(tmp_path, dash.url)
        # virtual time lets the page's fetch and first refresh complete before the dump
        done = _chromium(["--virtual-time-budget=5000", "--dump-dom", dash.url], tmp_path / "u")
    dom = done.stdout
    assert "<tbody>" in dom, done.stderr[-2000:]
    table = re.search(r'<table id="peers">.*?</table>', dom, re.S)  # not the script's text
    assert table is not None
    rows = re.findall(r'<tr class="peer">(.*?)</tr>', table.group(0), re.S)
    assert len(rows) == 2
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in rows]
    by_peer = {re.sub("<[^>]+>", "", c[0]): c for c in cells}
    assert set(by_peer) == {i[:16] for i in ids}  # both peers, by (shortened) ID
    one, two = by_peer[ids[0][:16]], by_peer[ids[1][:16]]
    assert one[1:5] == ["node", "3", "144", "12.4"]  # mode, epoch, samples, samples/s
    assert two[1:5] == ["client", "3", "144", "4.6"]
    assert one[6:10] == ["0.50", "0.75", "1.50", "2.50"]  # traffic, then link capacity MB/s
    assert '<b id="epoch">3</b>' in dom and "2 peers" in dom
    # the loss curve: a path with one point per finished epoch, labelled with its range
    loss_svg = re.search(r'<svg id="loss".*?</svg>', dom, re.S)
    assert loss_svg is not None
    path = re.search(r'<path class="curve" d="([^"]+)"', loss_svg.group(0))
    assert path is not None and path.group(1).count("L") == 2  # 3 points: M, L, L
    # the axes carry round ticks (the loss spans 6.75..7.55, two peers' medians) and names
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", loss_svg.group(0))
    assert {"6.8", "7.0", "7.2", "7.4"} <= set(labels) and {"epoch", "loss"} <= set(labels)
    assert {"0", "1", "2"} <= set(labels)  # one tick per epoch here


MARKUP = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"


def test_peer_text_is_shown_as_text_and_its_markup_does_not_run(tmp_path: Path) -> None:
    """A ``mode`` (or peer ID, epoch, checkpoint path) holding markup is displayed as text: no
    element is made of it and its handler does not run in the organiser's browser. (The
    coordinator drops such records already; this is the page's own line of defence.)"""
    with Dashboard("sahajbert-demo") as dash:
        status, _ = _status(tmp_path, dash.url)
        peers = [dict(p) for p in status["peers"]]
        peers[0]["mode"] = MARKUP
        peers[1]["peer"] = MARKUP
        peers[1]["epoch"] = MARKUP
        dash.status = {**status, "peers": peers, "checkpoint": MARKUP}
        done = _chromium(["--virtual-time-budget=5000", "--dump-dom", dash.url], tmp_path / "u")
    dom = done.stdout
    assert "<tbody>" in dom, done.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None and "data-pwned" not in body.group(0)  # the handler never ran
    table = re.search(r'<table id="peers">.*?</table>', dom, re.S)
    assert table is not None and "<img" not in table.group(0)
    rows = re.findall(r'<tr class="peer">(.*?)</tr>', table.group(0), re.S)
    assert len(rows) == 2
    shown = MARKUP.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert f"<td>{shown}</td>" in rows[0]  # the mode, as text
    assert f"<code>{MARKUP[:16].replace('<', '&lt;')}</code>" in rows[1]  # the peer ID
    assert f"<td>{shown}</td>" in rows[1]  # the epoch, as text
    summary = re.search(r'<div id="summary">.*?</div>', dom, re.S)
    assert summary is not None and "<img" not in summary.group(0)
