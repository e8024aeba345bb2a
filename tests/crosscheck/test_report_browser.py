"""The cross-check HTML in a real headless browser (Debian's ``chromium``; .ci/run installs it).

Checks: the page loads with no console messages at all (it has no script, so any message is
the browser complaining), its SVG plots are in the rendered DOM, and the screenshot is not
blank: many distinct colours, and the plots' own fill colours cover a real area. Each
detector is first shown to fire on a page built to trip it, so a pass is not vacuous.
The screenshot PNG is decoded with zlib and numpy (no Pillow).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from embedpipe.crosscheck.report.figures import LAYER_COLOURS
from embedpipe.crosscheck.report.page import VERDICT_COLOURS
from embedpipe.crosscheck.run import run_crosscheck
from embedpipe.extraction.run import EmbedOptions, embed_fasta
from helpers.embed_helpers import random_sequences, write_fasta

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (CI installs Debian's chromium: apt-get install -y chromium)"
)
CONSOLE_RE = re.compile(r"CONSOLE[:(]\d*\)?\]?\s*(.*)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars"]
WINDOW = (1200, 2000)


# =============================================================================== browser helpers


def _chromium(page: Path, tmp: Path, *args: str, window: tuple[int, int] = WINDOW) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           f"--window-size={window[0]},{window[1]}", *args, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _console_messages(stderr: str) -> list[str]:
    return [m.group(1) for line in stderr.splitlines() if (m := CONSOLE_RE.search(line))]


def _screenshot(page: Path, tmp: Path) -> tuple[np.ndarray, list[str]]:
    png = tmp / f"{page.stem}.png"
    result = _chromium(page, tmp, f"--screenshot={png}")
    assert png.is_file(), f"chromium wrote no screenshot (rc {result.returncode}):\n{result.stderr[-3000:]}"
    return decode_png(png.read_bytes()), _console_messages(result.stderr)


def _dom(page: Path, tmp: Path) -> tuple[str, list[str]]:
    result = _chromium(page, tmp, "--dump-dom")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, _console_messages(result.stderr)


# =============================================================================== a tiny PNG decoder


def decode_png(data: bytes) -> np.ndarray:
    """8-bit, non-interlaced RGB/RGBA PNG -> (height, width, channels) uint8 (all five filters)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, colour_type, _, _, interlace = header
    assert depth == 8 and interlace == 0 and colour_type in (2, 6), f"unsupported PNG {header}"
    bpp = 3 if colour_type == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = int(raw[y, 0]), raw[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # Sub: running sum per channel
            cur = (np.cumsum(line.reshape(width, bpp).astype(np.int64), axis=0) % 256).astype(np.uint8).ravel()
        elif kind == 2:  # Up
            cur = line + prev
        elif kind in (3, 4):  # Average, Paeth: sequential along the row
            filt, up, row = line.tolist(), prev.tolist(), [0] * stride
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                b = up[i]
                if kind == 3:
                    row[i] = (filt[i] + ((a + b) >> 1)) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    row[i] = (filt[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.array(row, dtype=np.uint8)
        else:
            raise AssertionError(f"bad PNG filter {kind}")
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def _distinct_colours(img: np.ndarray) -> int:
    flat = img.reshape(-1, 3).astype(np.uint32)
    return int(np.unique((flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]).size)


def _pixels_of(img: np.ndarray, hex_colour: str) -> int:
    rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.uint8)
    return int((img.reshape(-1, 3) == rgb).all(axis=1).sum())


def test_png_decoder_round_trip():
    """Every filter type, against an image encoded here by hand."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    rows = []
    for y in range(5):
        line = img[y].astype(np.int64).ravel()
        prev = img[y - 1].astype(np.int64).ravel() if y else np.zeros_like(line)
        left = np.concatenate([np.zeros(3, dtype=np.int64), line[:-3]])
        upleft = np.concatenate([np.zeros(3, dtype=np.int64), prev[:-3]])
        p = left + prev - upleft
        pa, pb, pc = abs(p - left), abs(p - prev), abs(p - upleft)
        paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        predictors = [0, left, prev, (left + prev) // 2, paeth]
        kind = y % 5
        rows.append(bytes([kind]) + ((line - predictors[kind]) % 256).astype(np.uint8).tobytes())

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 7, 5, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))
    assert np.array_equal(decode_png(png), img)


# =============================================================================== the report


@pytest.fixture(scope="module")
def report(tmp_path_factory, model_factory):
    """A real report from an fp16 store with fp32 fallbacks (the 'C' token overflows fp16)."""
    tmp = tmp_path_factory.mktemp("browser")
    model = model_factory(layers=2, dim=32, heads=4, seed=21, token_row_overrides={"C": 7e4})
    no_c = np.array(list("ADEFGHIKLMNPQRSTVWY"))
    records = random_sequences(24, (10, 160), seed=3, alphabet=no_c)
    records += [(f"cys{i}", s[:5] + "C" + s[5:]) for i, (_, s) in enumerate(random_sequences(4, (20, 60), seed=4))]
    fasta = write_fasta(tmp / "in.fasta", records)
    store = tmp / "fp16.h5"
    embed_fasta(fasta, model=str(model), out=store,
                options=EmbedOptions(precision="fp16", layers=(0, -1), per_residue=True), quiet=True)
    result = run_crosscheck(store, out=tmp / "cc", sample=16, seed=0, device="cpu", quiet=True)
    assert result.data["store_figures"]["fallback"]["count"] == 4
    return result


@needs_chromium
def test_detectors_fire_on_pages_built_to_trip_them(tmp_path):
    noisy = tmp_path / "noisy.html"
    noisy.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
                     "<title>t</title></head><body><p>text</p><script>console.error('boom');</script></body></html>")
    _, messages = _screenshot(noisy, tmp_path)
    assert any("boom" in m for m in messages), messages
    blank = tmp_path / "blank.html"
    blank.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
                     "<title>t</title></head><body></body></html>")
    img, messages = _screenshot(blank, tmp_path)
    assert messages == []
    assert _distinct_colours(img) <= 2 and _pixels_of(img, LAYER_COLOURS[0]) == 0


@needs_chromium
def test_report_loads_without_console_errors_and_its_plots_render(tmp_path, report):
    img, messages = _screenshot(report.html_path, tmp_path)
    assert messages == [], f"console messages while loading the report: {messages}"
    assert img.shape[:2] == (WINDOW[1], WINDOW[0])
    assert _distinct_colours(img) > 200, "screenshot looks blank"
    # the plots' bar and marker fills, one colour per stored layer, cover real areas
    for colour in LAYER_COLOURS[:2]:
        assert _pixels_of(img, colour) > 400, f"plot colour {colour} barely visible: plots did not render"
    # the verdict banner is first: its colour appears in the top part of the page
    fg, bg = VERDICT_COLOURS[report.verdict]
    top = img[:400]
    assert _pixels_of(top, bg) > 5000, "verdict banner not at the top"

    dom, messages = _dom(report.html_path, tmp_path)
    assert messages == []
    for name in ("cosine-histogram", "error-scatter", "overlap-histogram", "activation-histogram"):
        match = re.search(rf'<svg class="plot {name}"[^>]*>(.*?)</svg>', dom, flags=re.S)
        assert match, f"plot {name} missing from the rendered DOM"
        assert re.search(r"<(rect|circle)\b", match.group(1)), f"plot {name} has no marks"
    assert dom.index("verdict") < dom.index("<svg")
    assert "fp32 fallback" in dom and "nonfinite" in dom


# The page itself runs no script; a copy with this probe measures its layout in the browser.
_WIDTH_PROBE = """<script>
const tables = [...document.querySelectorAll('table')].map(t => Math.ceil(t.getBoundingClientRect().right));
document.title = JSON.stringify({page: document.documentElement.scrollWidth, tables: tables});
</script></body>"""


@needs_chromium
@pytest.mark.parametrize("width", [1400, 1200])
def test_no_table_is_wider_than_the_window(tmp_path, report, width):
    """At 1400 px every table (the per-layer summary, the verdict rules, the provenance) fits
    the window, long text and attribute values wrapping; narrower, a wide table scrolls in its
    own box, and the page itself never scrolls sideways."""
    probe = tmp_path / "probe.html"
    probe.write_text(report.html_path.read_text(encoding="utf-8").replace("</body>", _WIDTH_PROBE), encoding="utf-8")
    result = _chromium(probe, tmp_path, "--dump-dom", window=(width, 2000))
    measured = json.loads(html.unescape(re.search(r"<title>(.*?)</title>", result.stdout, flags=re.S).group(1)))
    assert len(measured["tables"]) >= 4
    if width >= 1400:
        assert max(measured["tables"]) <= width, measured
    assert measured["page"] <= width, measured
