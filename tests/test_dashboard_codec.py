"""The dashboard page's column coding, end to end in a real browser: what
the page's decoder rebuilds from the page (block addresses from their
back-references, sizes and waste from the table of pairs, the gzip streams
from their 7-bit text) equals the history model Python built, and the text
survives the HTML parser byte for byte, whatever the bytes."""
from __future__ import annotations

import random

import numpy as np
import pytest
from _browser import launch, require
from _pool_workload import MiB

import dtralloc
from dtralloc.dashboard.history import build_history
from dtralloc.dashboard.page import _TEXT7_ESCAPED, address_refs, text7

require()


@pytest.fixture(scope="module")
def browser():
    with launch() as b:
        yield b


def _open(browser, path) -> "object":
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto("file://" + str(path))
    page.evaluate("window.dtrallocDashboard.ready")
    assert errors == []
    return page


def _random_pool(steps: int, seed: int):
    """Random sizes from 512 B to 64 MiB, each freed at random: blocks placed
    where freed ones were, after live ones, in fresh segments, unsplit."""
    rng = random.Random(seed)
    pool = dtralloc.Pool("virtual", capacity="80G", conf="history_entries:1000000")
    sizes = [int(2 ** rng.uniform(9, 26)) for _ in range(64)]
    live = []
    for i in range(steps):
        pool.set_op_stamp(i // 8)
        if live and (len(live) > 200 or rng.random() < 0.5):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.malloc(rng.choice(sizes)))
    return pool


def test_the_page_rebuilds_every_block_exactly(browser, tmp_path):
    pool = _random_pool(6000, seed=3)
    snap = pool.snapshot(columns=True)
    h = build_history(snap["device_traces"][pool.device], snap["segments"])
    m = h.model
    page = _open(browser, dtralloc.dashboard(pool).save(tmp_path / "random.html"))
    got = page.evaluate("window.dtrallocDashboard.blocks(0)")
    unit = got["unit"]
    assert unit == 512
    y = h.block_y.astype(np.int64)
    refs = address_refs(y // unit, (y + m["block_size"]) // unit)
    # The coding is exercised: both kinds of reference, and raw addresses.
    assert np.any(refs % 2 == 1) and np.any((refs > 0) & (refs % 2 == 0)) and np.any(refs == 0)
    assert got["y"] == (y // unit).tolist()
    assert got["size"] == (m["block_size"] // unit).tolist()
    assert got["waste"] == (m["block_size"] - m["block_requested"]).tolist()
    assert got["start"] == m["block_start"].tolist()
    assert got["reqAt"] == m["block_free_requested"].tolist()
    assert got["doneAt"] == m["block_free_completed"].tolist()
    assert got["largest_free"] == m["largest_free"].tolist()
    assert got["op"] == h.cols["op"].tolist()
    assert got["coding"] == {"largest": "runs", "op": "runs"}  # both seldom change here
    page.close()


def test_per_event_columns_that_change_often_stay_dense(browser, tmp_path):
    """Op stamps that change at every event, and times: stored as steps."""
    pool = dtralloc.Pool("virtual", capacity="80G", conf="history_entries:10000")
    live = []
    for i in range(600):
        pool.set_op_stamp(i)
        live.append(pool.malloc((i % 7 + 1) * 4096))
        if i % 3 == 2:
            pool.free(live.pop(0))
    snap = pool.snapshot(columns=True)
    cols = dict(snap["device_traces"][pool.device])
    cols["time_us"] = 1_700_000_000_000_000 + np.arange(cols["action"].size, dtype=np.int64) * 37
    page = _open(browser, dtralloc.dashboard({"segments": snap["segments"], "device_traces": [cols]})
                 .save(tmp_path / "dense.html"))
    got = page.evaluate("window.dtrallocDashboard.blocks(0)")
    assert got["coding"]["op"] == "dense"
    assert got["op"] == cols["op"].tolist()
    assert got["time"] == cols["time_us"].tolist()
    page.close()


def _values_to_bytes(values: list) -> bytes:
    """Bytes whose 7-bit reading (text7's) starts with `values`."""
    bits = "".join(format(v, "07b") for v in values)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


def test_text7_survives_the_html_parser(browser, tmp_path):
    rng = np.random.default_rng(5)
    every = list(range(128))
    escape_runs = [v for r in range(1, 9) for v in [_TEXT7_ESCAPED[r % 4]] * r + [65]]
    cases = [b"", bytes(1), bytes(2), bytes(7), bytes(64), b"\xff" * 9,
             _values_to_bytes(every + every[::-1]), _values_to_bytes(escape_runs),
             _values_to_bytes([5, 13]), _values_to_bytes([5, 60, 60, 127]), _values_to_bytes([127] * 8),
             rng.integers(0, 256, 20000, dtype=np.uint8).tobytes()]
    cases += [bytes(rng.choice(np.array([0, 1, 6, 13, 26, 60, 120, 127, 254, 255], np.uint8), n)) for n in range(1, 40)]
    pool = dtralloc.Pool("virtual", capacity="1G")
    pool.malloc(3 * MiB)
    html = dtralloc.dashboard(pool).html
    extra = "".join(f'<script type="application/octet-stream" id="t7-{i}">{text7(c)}</script>'
                    for i, c in enumerate(cases))
    path = tmp_path / "t7.html"
    path.write_text(html.replace("</body>", extra + "</body>"), encoding="utf-8")
    page = _open(browser, path)
    for i, c in enumerate(cases):
        got = page.evaluate(f"window.dtrallocDashboard.text7decode(document.getElementById('t7-{i}').textContent)")
        assert bytes(got) == c, i
    page.close()


def test_text7_is_ascii_without_what_a_script_cannot_hold():
    data = np.random.default_rng(6).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    s = text7(data)
    assert s.isascii() and not any(ch in s for ch in "\0\r<")
    assert len(s) <= len(data) * 8 / 7 * (1 + 4 / 128) * 1.01


def test_notebook_iframe_decodes(browser, tmp_path):
    """The page inside _repr_html_'s srcdoc (its text attribute-escaped)."""
    pool = _random_pool(800, seed=4)
    d = dtralloc.dashboard(pool)
    path = tmp_path / "nb.html"
    path.write_text(f'<!DOCTYPE html><meta charset="utf-8"><body>{d._repr_html_()}</body>', encoding="utf-8")
    page = browser.new_page()
    page.goto("file://" + str(path))
    frame = page.frames[1]
    frame.wait_for_function("window.dtrallocDashboard !== undefined")
    frame.evaluate("window.dtrallocDashboard.ready")
    assert frame.evaluate("document.body.dataset.ready") == "1"
    page.close()


@pytest.mark.parametrize("high", [0, 1 << 62])
def test_address_refs_name_the_nearest_earlier_block(high):
    """Against a direct search; addresses near 2**64 take the stable-sort way."""
    rng = np.random.default_rng(7)
    size = rng.integers(1, 4, 3000).astype(np.uint64)
    y = (rng.integers(0, 200, 3000).astype(np.uint64) + np.uint64(high))
    refs = address_refs(y, y + size)
    for i in range(y.size):
        want = 0
        for j in range(i - 1, -1, -1):
            if y[j] == y[i]:
                want = 2 * (i - j)
                break
            if y[j] + size[j] == y[i]:
                want = 2 * (i - j) + 1
                break
        assert refs[i] == want, i
