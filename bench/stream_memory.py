"""Memory of a streaming data peer: RSS does not grow with the corpus.

Writes a local text corpus of ``--gigabytes`` GB (synthetic Bengali documents, repeated) and a
small one, then in a fresh process per file streams ``--batches`` sahajBERT batches from it
(random start offset, mix, on-the-fly tokenization, shuffle buffers) and prints the process's
peak RSS before and after. The figures are printed, not asserted.

    python -m bench.stream_memory --gigabytes 3 --batches 300
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_corpus(path: Path, gigabytes: float) -> None:
    from models.text.corpus import generate_documents

    block = ("\n".join(generate_documents(2000, seed=1)) + "\n").encode()
    target = int(gigabytes * (1 << 30))
    with path.open("wb") as f:
        while f.tell() < target:
            f.write(block)


def measure(path: str, tok_dir: str, batches: int) -> dict:
    """(in the child) stream ``batches`` batches from ``path`` and report RSS figures."""
    import itertools

    from models.text.data import PretrainingConfig, streaming_batches
    from models.text.sources import parse_data, stream_documents
    from models.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    before = _rss_mb()
    docs = stream_documents(parse_data(path), seed=7, shuffle_buffer=1024)
    cfg = PretrainingConfig(seq_len=512, shuffle_buffer=1024)
    start = time.perf_counter()
    stream = streaming_batches(docs, tok, batch_size=8, seed=0, config=cfg)
    for _ in itertools.islice(stream, batches):
        pass
    return {
        "rss_before_mb": before,
        "rss_after_mb": _rss_mb(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gigabytes", type=float, default=3.0)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--dir", type=Path, help="where to write the corpora (unset: a temp dir)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], int(args.child[2]))))
        return
    from models.text.corpus import generate_documents
    from models.text.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        train_tokenizer(generate_documents(1000, seed=0), 32000, tmp / "tok")
        for name, gb in (("small", 0.05), ("large", args.gigabytes)):
            path = tmp / f"{name}.txt"
            t = time.perf_counter()
            write_corpus(path, gb)
            size = path.stat().st_size / (1 << 30)
            out = subprocess.run(
                [sys.executable, "-m", "bench.stream_memory", "--child", str(path),
                 str(tmp / "tok"), str(args.batches)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            fig = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{name}: {size:.2f} GB corpus (written in {time.perf_counter() - t:.0f} s): "
                f"RSS {fig['rss_before_mb']:.0f} MB after import, {fig['rss_after_mb']:.0f} MB "
                f"after {args.batches} batches of 8x512 ({fig['seconds']:.1f} s), peak "
                f"{fig['peak_rss_mb']:.0f} MB"
            )
            path.unlink()


if __name__ == "__main__":
    main()
