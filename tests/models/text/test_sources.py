"""Streaming pretraining data: local text in both layouts, local Parquet/Arrow through
``datasets``, a weighted mix, a different order per peer, tokenized on the fly."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from models.text.corpus import generate_documents
from models.text.data import PretrainingConfig, streaming_batches
from models.text.sources import (
    SAHAJBERT_SOURCES,
    DocumentLayout,
    SourceKind,
    SourceSpec,
    parse_data,
    sample_documents,
    stream_documents,
)
from models.text.tokenizer import train_tokenizer


def _text(tmp_path, name, docs, layout="line"):
    path = tmp_path / name
    sep = "\n" if layout == "line" else "\n\n"
    body = sep.join(d if layout == "line" else d.replace("। ", "।\n") for d in docs)
    path.write_text(body + "\n", encoding="utf-8")
    return path


def test_parse_data_names_both_layouts_datasets_and_the_mix(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(b"")
    specs = parse_data(f"a.txt,block:b.txt,c.parquet,{tmp_path / 'shards'},hf:x/y:bn", "1,2,3,4,5")
    assert [(s.kind, s.layout, s.weight) for s in specs] == [
        (SourceKind.TEXT, DocumentLayout.LINE, 1.0),
        (SourceKind.TEXT, DocumentLayout.BLOCK, 2.0),
        (SourceKind.PARQUET, DocumentLayout.LINE, 3.0),
        (SourceKind.PARQUET, DocumentLayout.LINE, 4.0),
        (SourceKind.HUB, DocumentLayout.LINE, 5.0),
    ]
    assert specs[-1].name == "bn" and specs[-1].path == "x/y"
    hf = parse_data("hf")
    assert hf == SAHAJBERT_SOURCES and [s.weight for s in hf] == [0.23, 0.77]
    names = {(s.path, s.name) for s in hf}
    assert names == {
        ("wikimedia/wikipedia", "20231101.bn"),
        ("HuggingFaceFW/fineweb-2", "ben_Beng"),
    }
    with pytest.raises(ValueError, match="2 weights for 1 sources"):
        parse_data("a.txt", "1,2")
    for bad in ("nan", "-1", "0", "x"):
        with pytest.raises(ValueError):
            parse_data("a.txt", bad)


def test_text_streams_cover_every_document_in_a_different_order_per_peer(tmp_path):
    docs = generate_documents(40, seed=3)
    for layout in ("line", "block"):
        path = _text(tmp_path, f"{layout}.txt", docs, layout)
        spec = SourceSpec(SourceKind.TEXT, str(path), layout=layout)
        want = [d.strip() for d in docs]
        if layout == "block":  # a block's lines are joined with one space
            want = [" ".join(x.strip() for x in d.replace("। ", "।\n").split("\n")) for d in docs]
        firsts = []
        for peer in range(3):
            got = list(itertools.islice(stream_documents([spec], seed=peer, shuffle_buffer=8), 40))
            assert sorted(got) == sorted(want)  # one whole pass, each document once
            firsts.append(got[:10])
        assert firsts[0] != firsts[1] != firsts[2]


@pytest.mark.slow
def test_a_local_parquet_dataset_streams_mixed_with_text_by_weight(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    wiki = [f"উইকি {i}। দ্বিতীয় বাক্য {i}।" for i in range(200)]
    web = [f"ওয়েব {i}। আরেকটি বাক্য {i}।" for i in range(200)]
    (tmp_path / "wiki").mkdir()
    for k in range(2):  # two shards
        pq.write_table(pa.table({"text": wiki[k::2], "id": list(range(100))}),
                       tmp_path / "wiki" / f"part-{k}.parquet")  # fmt: skip
    text = _text(tmp_path, "web.txt", web)
    specs = parse_data(f"{tmp_path / 'wiki'},{text}", "0.23,0.77")
    got = list(itertools.islice(stream_documents(specs, seed=5, shuffle_buffer=16), 400))
    share = sum(d.startswith("উইকি") for d in got) / len(got)
    assert 0.15 < share < 0.31, share
    assert set(d for d in got if d.startswith("উইকি")) <= set(wiki)
    other = list(itertools.islice(stream_documents(specs, seed=6, shuffle_buffer=16), 50))
    assert other != got[:50]  # another peer, another order
    assert len(sample_documents(specs, 100, seed=0)) == 100


def test_streaming_batches_tokenize_on_the_fly(tmp_path):
    docs = generate_documents(80, seed=4)
    tok = train_tokenizer(docs, 400, tmp_path / "tok")
    cfg = PretrainingConfig(seq_len=32, shuffle_buffer=16)
    stream = streaming_batches(iter(docs * 3), tok, batch_size=4, seed=0, config=cfg)
    batches = list(itertools.islice(stream, 10))
    assert all(b["input_ids"].shape == (4, 32) for b in batches)
    assert collections.Counter(int(x) for b in batches for x in b["sop_labels"]).keys() <= {0, 1}
    assert any((b["mlm_labels"] != -100).any() for b in batches)
    assert all(b["input_ids"][:, 0].tolist() == [2] * 4 for b in batches)  # [CLS]
    with pytest.raises(ValueError, match="no sentence-order pair"):
        next(streaming_batches(iter(["এক বাক্য।"] * 10), tok, batch_size=2, seed=0, config=cfg))
    assert np.all(np.concatenate([b["input_ids"] for b in batches]) < len(tok))
