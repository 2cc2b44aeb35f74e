"""The dashboard page's own script, run in Node.js against a stub DOM (skipped without node):
the peers table shows measured traffic apart from link capacity, the charts have round ticks
on both axes, and the summary shows the trainers' throughput."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from examples.sahajbert.dashboard import PAGE

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js")

STUB = """
const els={};
function el(id,w,h){return els[id]??=(
  {innerHTML:"",textContent:"",width:{baseVal:{value:w||420}},height:{baseVal:{value:h||220}}})}
globalThis.document={getElementById:id=>el(id),querySelector:q=>el(q)};
globalThis.setInterval=()=>0;
globalThis.fetch=async()=>({json:async()=>STATUS});
"""


def _render(status: dict) -> dict[str, str]:
    script = PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    code = (
        f"const STATUS={json.dumps(status)};{STUB}{script}\n"
        "setTimeout(()=>console.log(JSON.stringify(Object.fromEntries("
        "Object.entries(els).map(([k,v])=>[k,v.innerHTML||v.textContent])))),50);"
    )
    done = subprocess.run([NODE, "-e", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_dashboard_shows_traffic_capacity_throughput_and_ticked_axes() -> None:
    rows = [
        {"epoch": e, "loss": loss, "samples_per_second": sps}
        for e, loss, sps in [(0, 7.55, 120.0), (1, 7.05, 131.0), (2, 6.75, 128.5)]
    ]
    peer = {"peer": "P" * 20, "mode": "node", "epoch": 3, "samples": 144, "loss": 6.7,
            "samples_per_second": 64.0, "sent_bps": 0.5e6, "received_bps": 0.75e6,
            "upload_bps": 300e6, "download_bps": 250e6}  # fmt: skip
    status = {"run_id": "r", "target": 192, "target_batch_size": 96, "peers": [peer],
              "rows": rows, "estimate": {"epoch": 3, "samples": 40, "samples_per_second": 130.0,
                                         "eta": 1.2},
              "mode": "dedloc", "compression": "adaptive"}  # fmt: skip
    out = _render(status)
    assert 'dedloc, <span id="compression">adaptive</span> on the wire' in out["summary"]
    out = _render({**status, "compression": "fp16", "powersgd": {"rank": 4}})
    assert '<span id="compression">fp16 (PowerSGD rank 4)</span> on the wire' in out["summary"]
    cells = re.findall(r"<td>(.*?)</td>", out["#peers tbody"])
    assert cells[6:10] == ["0.50", "0.75", "300.00", "250.00"]  # traffic, then capacity
    assert "130.0 samples/s" in out["summary"] and "ETA 1.2 s" in out["summary"]
    assert "/ 192" in out["summary"]  # the samples per averaging (DiLoCo: H target batches)
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", out["loss"])
    assert {"6.8", "7.0", "7.2", "7.4", "epoch", "loss", "0", "1", "2"} <= set(labels), labels
    assert out["loss"].count('class="ytick"') == 4 and out["loss"].count('class="xtick"') == 3
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", out["tput"])
    assert {"120", "125", "130", "samples/s"} <= set(labels), labels


def test_dashboard_shows_topk_settings() -> None:
    """A TopK DiLoCo run's summary names its density, bits and error feedback."""
    status = {"run_id": "r", "target": 192, "peers": [], "rows": [], "estimate": {},
              "mode": "diloco", "compression": "topk",
              "topk": {"density": 0.015625, "bits": 2, "error_feedback": 0.95}}  # fmt: skip
    out = _render(status)
    assert (
        'diloco, <span id="compression">topk (density 0.015625, 2 bits, error feedback 0.95)'
        "</span> on the wire"
    ) in out["summary"]
    out = _render({**status, "compression": "int8", "topk": None})
    assert '<span id="compression">int8</span>' in out["summary"]
