"""The coordinator's live dashboard: one HTML page polling a JSON endpoint, on 127.0.0.1.

``GET /`` serves the page, ``GET /api/status`` the coordinator's current status (peers with
their throughput and bandwidth, the collaboration's estimate, one row per finished epoch).
The page draws the loss and throughput curves as inline SVG: no external assets, so it works
offline. The server is the standard library's, in one daemon thread of the coordinator's
process (it only reads a snapshot the coordinator swaps in).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import html
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>dedloc-jax: RUN_ID</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.2em .7em;border-bottom:1px solid #ddd;
text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.charts{display:flex;gap:2em;flex-wrap:wrap}svg{border:1px solid #ccc;background:#fcfcfc}
#summary span{margin-right:1.5em}
</style></head><body>
<h1>Collaboration <code id="run">RUN_ID</code></h1>
<div id="summary">loading...</div>
<h2>Peers</h2>
<table id="peers"><thead><tr><th>peer</th><th>mode</th><th>epoch</th><th>samples</th>
<th>samples/s</th><th>loss</th><th>sent MB/s</th><th>received MB/s</th>
<th>link capacity up MB/s</th><th>link capacity down MB/s</th></tr></thead>
<tbody></tbody></table>
<h2>Banned peers</h2>
<table id="banned"><thead><tr><th>peer</th><th>role</th><th>reason</th><th>round</th>
<th>by</th><th>verified</th></tr></thead><tbody></tbody></table>
<div class="charts"><div><h2>Loss per epoch</h2><svg id="loss" width="420" height="220"></svg>
</div><div><h2>Samples/s per epoch</h2><svg id="tput" width="420" height="220"></svg></div></div>
<script>
// Every peer-supplied value goes through esc() before it meets innerHTML.
function esc(x){return String(x??"-").replace(/[&<>"']/g,c=>"&#"+c.charCodeAt(0)+";")}
function fmt(x,d){return (x===null||x===undefined||isNaN(x))?"-":Number(x).toFixed(d)}
// About n round values (1, 2 or 5 times a power of ten) spanning [a, b]; whole ones if int.
function ticks(a,b,n,int){
  if(!(b>a))return [a];
  let step=(b-a)/n;const mag=Math.pow(10,Math.floor(Math.log10(step)));
  step=[1,2,5,10].map(m=>m*mag).find(s=>s>=step);if(int)step=Math.max(1,Math.round(step));
  const out=[];for(let v=Math.ceil(a/step)*step;v<=b+step*1e-9;v+=step)out.push(+v.toPrecision(12));
  return out;
}
function plot(id,xs,ys,color,label){
  const svg=document.getElementById(id),W=svg.width.baseVal.value,H=svg.height.baseVal.value;
  const L=56,R=14,T=14,B=38;svg.innerHTML="";
  const pts=xs.map((x,i)=>[x,ys[i]]).filter(p=>p[1]!==null&&isFinite(p[1]));
  if(!pts.length){svg.innerHTML=`<text x="${L}" y="${H/2}">no finished epoch yet</text>`;return}
  const x0=Math.min(...pts.map(p=>p[0])),x1=Math.max(...pts.map(p=>p[0]));
  let y0=Math.min(...pts.map(p=>p[1])),y1=Math.max(...pts.map(p=>p[1]));
  if(y1-y0<1e-9){const pad=Math.abs(y1)*0.05||1;y0-=pad;y1+=pad}
  const sx=x=>L+(W-L-R)*(x1>x0?(x-x0)/(x1-x0):0.5),sy=y=>H-B-(H-T-B)*(y-y0)/(y1-y0);
  const d=pts.map((p,i)=>(i?"L":"M")+sx(p[0]).toFixed(1)+","+sy(p[1]).toFixed(1)).join("");
  const dots=pts.length<40?pts.map(p=>`<circle cx="${sx(p[0]).toFixed(1)}" `+
    `cy="${sy(p[1]).toFixed(1)}" r="2.5" fill="${color}"/>`).join(""):"";
  const yt=ticks(y0,y1,4,false),xt=ticks(x0,x1,5,true);
  const dy=yt.length>1?Math.max(0,-Math.floor(Math.log10(yt[1]-yt[0])+1e-9)):2;
  const ygrid=yt.map(v=>`<path class="ytick" d="M${L},${sy(v).toFixed(1)}H${W-R}" stroke="#eee"/>`+
    `<text x="${L-4}" y="${(sy(v)+4).toFixed(1)}" font-size="11" text-anchor="end">`+
    `${fmt(v,dy)}</text>`).join("");
  const xgrid=(x1>x0?xt:[x0]).map(v=>`<path class="xtick" d="M${sx(v).toFixed(1)},${H-B}v4" `+
    `stroke="#999"/><text x="${sx(v).toFixed(1)}" y="${H-B+16}" font-size="11" `+
    `text-anchor="middle">${v}</text>`).join("");
  svg.innerHTML=ygrid+`<path d="M${L},${T}V${H-B}H${W-R}" fill="none" stroke="#999"/>`+xgrid+
    `<path class="curve" d="${d}" fill="none" stroke="${color}" stroke-width="2"/>`+dots+
    `<text x="${(L+W-R)/2}" y="${H-4}" font-size="11" text-anchor="middle">epoch</text>`+
    `<text x="12" y="${(T+H-B)/2}" font-size="11" text-anchor="middle" `+
    `transform="rotate(-90 12 ${(T+H-B)/2})">${label}</text>`;
}
async function refresh(){
  try{
    const s=await (await fetch("api/status")).json(),e=s.estimate||{};
    const dv=s.diverged;
    document.getElementById("summary").innerHTML=(dv?`<span id="diverged" style="color:#c00">`+
      `<b>diverged</b> at epoch ${esc(dv.epoch)} (${(dv.peers||[]).length|0} peers say so)`+
      `</span>`:"")+
      `<span>epoch <b id="epoch">${esc(e.epoch)}</b></span>`+
      `<span>samples ${fmt(e.samples,0)} / ${esc(s.target??s.target_batch_size)}</span>`+
      `<span>${fmt(e.samples_per_second,1)} samples/s</span><span>ETA ${fmt(e.eta,1)} s</span>`+
      `<span>${(s.peers||[]).length|0} peers</span>`+
      `<span>${esc(s.mode)}, <span id="compression">${esc(s.compression)}${s.powersgd?` (PowerSGD`+
      ` rank ${esc(s.powersgd.rank)})`:""}${s.topk?` (density `+
      `${esc(s.topk.density)}, ${esc(s.topk.bits)} bits, error feedback `+
      `${esc(s.topk.error_feedback)})`:""}</span> on the wire</span>`+
      `<span>last checkpoint: ${esc(s.checkpoint)}</span>`;
    document.querySelector("#peers tbody").innerHTML=(s.peers||[]).map(p=>
      `<tr class="peer"><td><code>${esc(String(p.peer).slice(0,16))}</code></td>`+
      `<td>${esc(p.mode)}</td>`+
      `<td>${esc(p.epoch)}</td><td>${esc(p.samples)}</td><td>${fmt(p.samples_per_second,1)}</td>`+
      `<td>${fmt(p.loss,3)}</td><td>${fmt(p.sent_bps/1e6,2)}</td>`+
      `<td>${fmt(p.received_bps/1e6,2)}</td><td>${fmt(p.upload_bps/1e6,2)}</td>`+
      `<td>${fmt(p.download_bps/1e6,2)}</td></tr>`).join("");
    document.querySelector("#banned tbody").innerHTML=(s.banned||[]).map(b=>
      `<tr class="ban"><td><code>${esc(String(b.peer).slice(0,16))}</code></td>`+
      `<td>${esc(b.role)}</td><td>${esc(b.reason)}</td><td>${esc(b.round)}</td>`+
      `<td><code>${esc(String(b.by).slice(0,16))}</code></td><td>${esc(b.verified)}</td></tr>`
      ).join("");
    const rows=s.rows||[];
    plot("loss",rows.map(r=>r.epoch),rows.map(r=>r.loss),"#c33","loss");
    plot("tput",rows.map(r=>r.epoch),rows.map(r=>r.samples_per_second),"#36c","samples/s");
  }catch(err){document.getElementById("summary").textContent="coordinator unreachable"}
}
refresh();setInterval(refresh,1000);
</script></body></html>
"""


def _csp(page: str) -> str:
    """A Content-Security-Policy that runs only the page's own script (by its hash): an
    inline handler smuggled into the DOM (``<img onerror=...>``) is blocked even if some
    value escaped ``esc()``; nothing is loaded from anywhere but the dashboard itself."""
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    return (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'"
    )


CSP = _csp(PAGE)


class DashboardError(OSError):
    """The dashboard's address could not be bound."""


class Dashboard:
    """Serves :attr:`status` (a JSON-able dict replaced by the coordinator) over HTTP."""

    def __init__(self, run_id: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.status: dict[str, Any] = {"run_id": run_id, "peers": [], "rows": []}
        page = PAGE.replace("RUN_ID", html.escape(run_id)).encode()
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                if self.path.split("?")[0] in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", page)
                elif self.path.split("?")[0] == "/api/status":
                    body = json.dumps(clean_json(dashboard.status)).encode()
                    self._send(200, "application/json", body)
                else:
                    self._send(404, "text/plain", b"not found")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("Content-Security-Policy", CSP)
                self.send_header("X-Content-Type-Options", "nosniff")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("dashboard: " + format, *args)

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else e.strerror or e
            raise DashboardError(
                f"cannot serve the dashboard on {host}:{port}: {why} (--dashboard-port PORT "
                "picks another; 0: any free port)"
            ) from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="dashboard", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> Dashboard:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> Dashboard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def clean_json(x: Any) -> Any:
    """``x`` with NaN/inf replaced by None (JSON has no such numbers; browsers reject them)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean_json(v) for v in x]
    if x is None or isinstance(x, str | int | bool):
        return x
    return str(x)
