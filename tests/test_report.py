"""`memguard report`, Guard.postfix and the TensorBoard exporter, on a real run.

The run is a real Guard loop in a child process (memguard's arena is
process-global): a tiny model whose loss_fn takes 20 MiB of arena memory per
sample for four steps, under an arena budget of 512 MiB, so the whole batch
of 32 really runs out of memory once and the guard shrinks, then grows back.
Its JSONL telemetry is drawn through the command line; the TensorBoard
exporter rides on the same sampler, so both exporters are compared sample by
sample.
"""
from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from memguard.telemetry import JsonlExporter, Sampler, read_jsonl

torch = pytest.importorskip("torch")
mpimg = pytest.importorskip("matplotlib.image")
np = pytest.importorskip("numpy")

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"

MiB = 2**20
STEPS = 20
SHRINK_RGB = (247, 103, 7)    # the report's shrink markers, #f76707
GROW_RGB = (47, 158, 68)      # and grow markers, #2f9e44
DEMO_TRACE = FIXTURES / "traces" / "demo_validation_leak.jsonl"

CHILD = r'''
import json, sys, time
import torch
import memguard
from memguard import Guard
from memguard.memory import arena as allocator
from memguard.telemetry.tensorboard import TensorBoardExporter

MiB = 2**20
jsonl, tb_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
spike = range(4, 8)      # steps whose micro-batches take 20 MiB a sample


def loss_fn(micro):
    x, y = micro
    scratch = torch.empty(len(x) * (20 * MiB if step in spike else MiB), dtype=torch.uint8)
    del scratch          # arena bytes, never touched: RSS stays calm
    return torch.nn.functional.cross_entropy(model(x), y)


budget = memguard.sample().rss_bytes + 1024 * MiB
sampler = memguard.Sampler(interval_ms=20, budget=budget)
tb = TensorBoardExporter(tb_dir)
sampler.on_sample(tb)
# the tensors' own budget: 32 x 20 MiB cannot fit
guard = Guard(budget=budget, tensor_budget=512 * MiB, telemetry=jsonl, sampler=sampler,
              grow_after=2, retry_after=4)
micro = []
with guard:
    if not allocator.installed():
        print(json.dumps({"skip": guard.allocator_error}))
        sys.exit(0)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        batch = (torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
        res = guard.step(batch, loss_fn, opt)
        tb.event("step", step=step, micro_batch=res.micro_batch, n_micro=res.n_micro,
                 retries=res.retries, peak_bytes=res.peak_bytes, loss=res.loss)
        for _ in range(res.retries):
            tb.event("oom_recovered", step=step)
        micro.append(res.micro_batch)
        time.sleep(0.03)                   # a few samples a step
    deadline = time.monotonic() + 60       # 10 at least, however slow the machine
    while sampler.latest().seq < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    postfix = guard.postfix()
    latest_rss = sampler.latest().rss_bytes
tb.close()
print(json.dumps({"summary": guard.summary(), "micro": micro, "postfix": postfix,
                  "latest_rss": latest_rss}, default=str))
'''


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memguard", *args], capture_output=True,
                          check=False, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The child's telemetry paths and what it printed."""
    d = tmp_path_factory.mktemp("guard_run")
    jsonl, tb_dir = d / "run.jsonl", d / "tb"
    out = subprocess.run([sys.executable, "-c", CHILD, str(jsonl), str(tb_dir), str(STEPS)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(f"memguard's allocator is not available here: {res['skip']}")
    res.update(dir=d, jsonl=jsonl, tb_dir=tb_dir)
    return res


def table(page: str) -> dict[str, str]:
    rows = re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", page)
    return {html.unescape(k): html.unescape(v) for k, v in rows}


def embedded_png(page: str):
    m = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert m, "the page embeds its figure as a base64 PNG"
    return mpimg.imread(io.BytesIO(base64.b64decode(m.group(1))), format="png")


def near(img, rgb: tuple[int, int, int], tol: int = 8) -> int:
    """Pixels of ``img`` (floats in [0, 1]) within ``tol`` of ``rgb``."""
    px = (img[..., :3] * 255).round()
    return int((np.abs(px - np.array(rgb)) <= tol).all(axis=-1).sum())


# -- the run itself: what the report has to show --------------------------------
def test_the_run_recovered_an_oom_shrank_and_grew(run):
    _, samples, events = read_jsonl(run["jsonl"])
    kinds = [e["event"] for e in events]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["micro_batch"] for e in steps] == run["micro"]
    assert kinds.count("oom_recovered") == run["summary"]["ooms_recovered"] == 1
    assert {e["action"] for e in steps} >= {"shrink", "grow"}
    assert "relieve" in kinds and samples
    assert any(s.arena_allocated_bytes for s in samples)


# -- the report ----------------------------------------------------------------
def test_png_report_through_the_cli(run):
    out_png = run["dir"] / "report.png"
    out = cli("report", str(run["jsonl"]), "-o", str(out_png))
    assert out.returncode == 0, out.stderr
    assert f"{STEPS} steps" in out.stdout and str(out_png) in out.stdout
    img = mpimg.imread(out_png)
    h, w = img.shape[:2]
    assert 600 <= w <= 3000 and 400 <= h <= 3000 and img.shape[2] in (3, 4)
    assert img[..., :3].std() > 0.05, "the figure is not blank"
    assert near(img, SHRINK_RGB) >= 30, "shrink markers are drawn"
    assert near(img, GROW_RGB) >= 30, "grow markers are drawn"


def test_html_report_embeds_the_figure_and_the_summary(run):
    out_html = run["dir"] / "report.html"
    out = cli("report", str(run["jsonl"]), "-o", str(out_html))
    assert out.returncode == 0, out.stderr
    page = out_html.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "run.jsonl" in page
    assert "<img" in page and "http" not in page, "self-contained"
    img = embedded_png(page)
    assert img.shape[0] >= 400 and img.shape[1] >= 600
    s, micro = run["summary"], run["micro"]
    t = table(page)
    assert t["steps"] == str(STEPS) == str(s["steps"])
    assert t["OOMs recovered"] == str(s["ooms_recovered"]) == "1"
    assert t["micro-batch changes"] == str(sum(a != b for a, b in zip(micro, micro[1:])))
    assert f"({s['peak_bytes']:,} bytes)" in t["peak step memory"]
    assert f"({s['budget_bytes']:,} bytes)" in t["budget"]
    assert t["arena budget"] == f"512.0 MiB ({512 * MiB:,} bytes)"
    _, samples, _ = read_jsonl(run["jsonl"])
    assert f"({max(x.rss_bytes for x in samples):,} bytes)" in t["peak RSS (sampled)"]


def test_default_output_is_a_png_beside_the_telemetry(tmp_path):
    src = tmp_path / "leak.jsonl"
    src.write_bytes(DEMO_TRACE.read_bytes())
    out = cli("report", str(src))
    assert out.returncode == 0, out.stderr
    img = mpimg.imread(tmp_path / "leak.png")
    assert near(img, SHRINK_RGB) < 5 and near(img, GROW_RGB) < 5, "no steps, no markers"


def test_recorded_demo_trace(tmp_path):
    """A schema-1 trace without arena fields or guard events."""
    from memguard.cli.report import report

    summary = report(DEMO_TRACE, tmp_path / "demo.html")
    assert summary.steps == 0 and summary.peak_arena_allocated_bytes is None
    assert summary.max_level.name == "CRITICAL" and summary.high_s > 1
    t = table((tmp_path / "demo.html").read_text(encoding="utf-8"))
    assert t["steps"] == "0" and t["peak arena allocated"] == t["arena budget"] == "-"
    assert t["highest pressure level"] == "CRITICAL"
    assert "growth forecast" not in t and "batch headroom" not in t, "no such events, no rows"


@pytest.mark.parametrize("kind", ["header_only", "samples_no_events", "sparse_fixture"])
def test_missing_fields_and_no_events_still_give_a_report(tmp_path, kind):
    src = tmp_path / "t.jsonl"
    if kind == "sparse_fixture":   # every sample lacks most fields, even the level
        src.write_bytes((FIXTURES / "traces" / "swap_storm.jsonl").read_bytes())
    else:
        with JsonlExporter(src) as ex:
            if kind == "samples_no_events":
                sampler = Sampler(budget="4GiB")
                for _ in range(3):
                    ex(sampler.sample_now())
    from memguard.cli.report import report

    for ext in ("png", "html"):
        assert report(src, tmp_path / f"r.{ext}").steps == 0
    assert mpimg.imread(tmp_path / "r.png").shape[0] >= 400
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    embedded_png(page)
    assert table(page)["steps"] == "0"


def test_bad_inputs_are_clear_errors(tmp_path):
    from memguard.cli.report import report

    missing = tmp_path / "nope.jsonl"
    out = cli("report", str(missing), "-o", str(tmp_path / "r.png"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert str(missing) in out.stderr and "cannot read" in out.stderr
    assert not (tmp_path / "r.png").exists()

    junk = tmp_path / "junk.jsonl"
    junk.write_text("this is not json\n")
    out = cli("report", str(junk), "-o", str(tmp_path / "r.png"))
    assert out.returncode == 2 and str(junk) in out.stderr and "JSON" in out.stderr

    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=re.escape(repr(str(binary)))):
        report(binary, tmp_path / "r.png")

    not_objects = tmp_path / "list.jsonl"
    not_objects.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="not memguard telemetry"):
        report(not_objects, tmp_path / "r.png")

    other = FIXTURES / "traces" / "planner_oom_then_calm.jsonl"
    out = cli("report", str(other), "-o", str(tmp_path / "r.png"))
    assert out.returncode == 2 and "not a memguard telemetry file" in out.stderr

    with pytest.raises(ValueError, match="cannot read"):
        report(tmp_path, tmp_path / "r.png")   # a directory

    out = cli("report", str(DEMO_TRACE), "-o", str(tmp_path / "r.svg"))
    assert out.returncode == 2 and "r.svg" in out.stderr and ".png or .html" in out.stderr
    assert not (tmp_path / "r.svg").exists()


# -- drift: the baseline, a growth forecast, the batch headroom ----------------------
FORECAST_RGB = (194, 37, 92)    # the forecasts' trends, #c2255c
BASELINE_RGB = (11, 114, 133)   # the baseline (the steps' floor_bytes), #0b7285
T0 = 1.7e9
GROWING = [{"what": f"{what} at {where}", "kind": kind, "count": n, "added": n,
            "per_step": n / 15, "bytes": b, "added_bytes": b}
           for what, where, kind, n, b in (("torch.Tensor float32 (256, 1024)", "train.py:42",
                                             "tensor", 15, 15 * MiB),
                                            ("list", "data.py:7", "object", 3, 2048),
                                            ("dict", "loader.py:88", "object", 2, 1024),
                                            ("<tail & co>", "x.py:1", "object", 1, 10))]
FORECAST = {"step": 20, "source": "arena", "level_bytes": 120 * MiB,
            "rate_bytes_per_step": MiB, "rate_bytes_per_epoch": 10 * MiB, "epochs_left": 28.0,
            "budget_bytes": 400 * MiB, "steps_left": 280, "reach_step": 300,
            "seconds_left": 56.0, "since_step": 5, "census_s": 0.01, "growing": GROWING}
FORECAST_ROW = ("arena memory held between steps grows 1 MiB/step (10 MiB/epoch) since step 5: "
                "120.0 MiB at step 20, reaching the budget of 400.0 MiB at step 300 (280 steps, "
                "28.0 epochs, 56 s left); what grows: torch.Tensor float32 (256, 1024) at "
                "train.py:42 (+15.0 MiB), list at data.py:7 (+2.0 KiB), dict at loader.py:88 "
                "(+1.0 KiB)")
HEADROOM = {"step": 3, "source": "cuda", "peak_bytes": 150 * MiB, "budget_bytes": 1024 * MiB,
            "batch": 8, "largest_batch": 48, "predicted_peak_bytes": 900 * MiB, "capped": True,
            "queue": [{"batch": 32, "queue": 4096}, {"batch": 64, "queue": 4096}]}
HEADROOM_ROW = ("step 3: the whole batch of 8 peaked at 150.0 MiB/1.0 GiB (CUDA, 15 %); the peak "
                "model fits a batch of 48 (predicted peak 900.0 MiB; capped: not extrapolated "
                "further); with a queue near the current one: batch 32 with queue 4,096, "
                "batch 64 with queue 4,096")


def write_drift_run(path: pathlib.Path, event: str) -> None:
    """30 steps 0.1 s apart whose floor grows 1 MiB a step from 100 MiB, and
    ``event``: a forecast at step 20 (since step 5) or a headroom at step 3."""
    with JsonlExporter(path) as ex:
        for n in range(30):
            ex.event("step", t=T0 + n / 10, step=n, micro_batch=8, n_micro=1, batch=8,
                     action="keep", floor_bytes=(100 + n) * MiB, peak_bytes=(150 + n) * MiB)
            if event == "forecast" and n == 20:
                ex.event("forecast", t=T0 + 2.0, **FORECAST)
            if event == "headroom" and n == 3:
                ex.event("headroom", t=T0 + 0.3, **HEADROOM)


def test_a_forecast_is_a_row_a_list_and_a_trend_to_the_budget(tmp_path):
    """The row says the rate, what is left and the top three growing groups;
    the page lists every group; the figure draws the baseline and the trend,
    which starts where step 5 ended and meets the budget at the reach
    (the event's seconds_left after it)."""
    from memguard.cli.report import report, scan

    src = tmp_path / "forecast.jsonl"
    write_drift_run(src, "forecast")
    # the trend starts where step 5 ended (its own seconds per step would say T0 - 1)
    assert scan(src).trends() == [([T0 + 0.5, T0 + 2.0, T0 + 58.0],
                                   [105 * MiB, 120 * MiB, 400 * MiB])]
    summary = report(src, tmp_path / "r.html")
    assert summary.forecasts == 1 and summary.headroom is None
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    t = table(page)
    assert t["growth forecast"] == FORECAST_ROW and "batch headroom" not in t
    listed = page[page.index('<table class="growing">'):]
    assert all(html.escape(g["what"]) in listed for g in GROWING)
    img = embedded_png(page)
    assert near(img, BASELINE_RGB) >= 50, "the baseline is drawn (the trend covers most)"
    assert near(img, FORECAST_RGB) >= 300, "the trend is drawn"


def test_a_forecast_far_below_the_panels_top_is_shown_cut(tmp_path):
    """A forecast against the arena's 400 MiB in a panel that goes to 20 GiB
    (the process's budget) would be a flat line at its bottom: the panel is
    cut at a quarter above the trend's budget, and says so; a forecast near
    the top is left as it is."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memguard.cli.report import _zoom_to_trends, scan

    src = tmp_path / "forecast.jsonl"
    write_drift_run(src, "forecast")
    run = scan(src)
    for top, cut in ((20 << 30, True), (1 << 30, False)):
        fig, ax = plt.subplots()
        ax.set_ylim(0, top / MiB)
        _zoom_to_trends(ax, run, run.trends(), top, MiB)
        assert ax.get_ylim()[1] == pytest.approx(500 if cut else top / MiB)
        assert bool(ax.texts) is cut
        plt.close(fig)


def test_a_headroom_is_a_row_and_no_forecast_is_none(tmp_path):
    from memguard.cli.report import report

    src = tmp_path / "headroom.jsonl"
    write_drift_run(src, "headroom")
    summary = report(src, tmp_path / "r.png")
    rows = dict(summary.rows())
    assert rows["batch headroom"] == HEADROOM_ROW and "growth forecast" not in rows
    img = mpimg.imread(tmp_path / "r.png")
    assert near(img, BASELINE_RGB) >= 100, "the baseline is drawn"
    assert near(img, FORECAST_RGB) < 5, "no forecast, no trend"


def test_drift_words_of_partial_events():
    """Events with fields missing or of the wrong type give words, never an error."""
    from memguard.cli import drift_view

    odd = {"growing": "not a list", "queue": 3, "rate_bytes_per_step": "fast", "t": T0}
    assert drift_view.rows(odd, 2, odd) == [
        ("growth forecast", ("the last of 2: the memory held between steps grows at a rate "
                             "since step ?: ? at step ?, reaching the budget of ? at step ? "
                             "(? steps left)")),
        ("batch headroom", ("step ?: the whole batch of ? peaked at ?/?; the peak model fits a "
                            "batch of ? (predicted peak ?)"))]
    assert drift_view.trend(odd, None) is None and drift_view.growing_html(odd) == ""
    assert [drift_view.duration(s) for s in (45, 750, 7200, 216000)] == \
        ["45 s", "12.5 min", "2.0 h", "2.5 days"]
    # a step's end: the last stretch of steps that reaches it, between kept points
    assert drift_view.step_time([0.0, 10.0], [0, 100], 50) == 5.0
    assert drift_view.step_time([0.0, 1.0, 2.0, 10.0, 11.0], [0, 1, 2, 0, 1], 1) == 11.0
    assert drift_view.step_time([0.0, 1.0, 10.0], [0, 1, 0], 5) is None


# -- long and hostile files: memory bounded whatever the file ------------------------
# Runs a command and prints its peak RSS last on stderr, as /usr/bin/time
# does: measured from this small launcher, since a child's ru_maxrss counts
# what it shared with its parent before exec (here, pytest and torch). The
# address-space limit is a safety net: a reader that took a whole endless
# line would fail there in a second instead of taking the machine's memory.
TIMED = r'''
import resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
code = subprocess.run(sys.argv[1:]).returncode
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(f"peak_rss_kib={peak // 1024 if sys.platform == 'darwin' else peak}", file=sys.stderr)
sys.exit(code)
'''
# one BLAS thread: each would reserve address space under that limit
ONE_THREAD = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
#: what a long file may add to the peak RSS of the report of a short one
GROWTH_MIB = 25


def cli_rss(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``memguard *args`` in a child under a 2 GiB address-space limit; its peak RSS in MiB."""
    out = subprocess.run([sys.executable, "-c", TIMED, sys.executable, "-m", "memguard", *args],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, **ONE_THREAD))
    m = re.search(r"peak_rss_kib=(\d+)\s*$", out.stderr)
    assert m, out.stderr[-3000:]
    return out, int(m.group(1)) / 1024


def write_run(path: pathlib.Path, samples: int, junk: str | None = None) -> None:
    """A guarded run's telemetry as the exporter writes it: ``samples`` samples
    (RSS 1 GB plus 1000 bytes a sample), a step event every tenth, and
    ``junk`` as one line after the first half."""
    base = Sampler(budget="4GiB").sample_now()
    with open(path, "w", encoding="utf-8") as f, JsonlExporter(f) as ex:
        for n in range(1, samples + 1):
            t = 1.7e9 + n / 10
            ex(dataclasses.replace(base, t=t, seq=n, rss_bytes=10**9 + 1000 * n))
            if n % 10 == 0:
                ex.event("step", t=t, step=n // 10, micro_batch=32, n_micro=1,
                         peak_bytes=2 * 10**8, action="keep")
            if n == samples // 2 and junk is not None:
                f.write(junk + "\n")


@pytest.fixture(scope="module")
def short_report_rss(tmp_path_factory) -> float:
    """Peak RSS (MiB) of `memguard report` on 100 samples."""
    d = tmp_path_factory.mktemp("short")
    write_run(d / "short.jsonl", 100)
    out, rss = cli_rss("report", str(d / "short.jsonl"), "-o", str(d / "short.png"))
    assert out.returncode == 0, out.stderr
    return rss


def test_memory_does_not_grow_with_the_file(tmp_path, short_report_rss):
    src = tmp_path / "long.jsonl"
    write_run(src, 20000)                # 40 MB: 20000 samples, 2000 steps
    assert src.stat().st_size > 35e6
    out, rss = cli_rss("report", str(src), "-o", str(tmp_path / "long.html"))
    src.unlink()
    assert out.returncode == 0, out.stderr
    assert "report of 2000 steps and 20000 samples" in out.stdout
    t = table((tmp_path / "long.html").read_text(encoding="utf-8"))
    assert t["samples"] == "20000" and t["steps"] == "2000" and t["duration"] == "1999.9 s"
    assert t["peak RSS (sampled)"].endswith(f"({10**9 + 1000 * 20000:,} bytes)")
    assert rss < short_report_rss + GROWTH_MIB, (rss, short_report_rss)


def test_an_overlong_line_is_skipped_unread(tmp_path, short_report_rss):
    src = tmp_path / "long_line.jsonl"
    # a well-formed sample of 50 MB: read whole, it would be drawn and counted
    write_run(src, 100, junk=json.dumps({"type": "sample", "t": 1.7e9 + 5, "seq": 0,
                                         "rss_bytes": 10**15, "reasons": ["x" * 50 * MiB]}))
    out, rss = cli_rss("report", str(src), "-o", str(tmp_path / "r.html"))
    src.unlink()
    assert out.returncode == 0, out.stderr
    assert "report of 10 steps and 100 samples" in out.stdout
    # the header, 50 samples and 5 steps, then the long line
    assert "skipped 1 unreadable line(s) (line 57: longer than 1.0 MiB, not read)" in out.stderr
    t = table((tmp_path / "r.html").read_text(encoding="utf-8"))
    assert t["peak RSS (sampled)"].endswith(f"({10**9 + 1000 * 100:,} bytes)")
    assert rss < short_report_rss + GROWTH_MIB, (rss, short_report_rss)


def test_dev_zero_is_a_clear_error_in_bounded_memory(tmp_path, short_report_rss):
    out, rss = cli_rss("report", "/dev/zero", "-o", str(tmp_path / "r.png"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.startswith("memguard: '/dev/zero' is not memguard telemetry: line 1 "
                                 "comes before any memguard header (goes on past 256.0 MiB "
                                 "without a newline"), out.stderr
    assert rss < short_report_rss, (rss, short_report_rss)
    assert not (tmp_path / "r.png").exists()


def test_a_long_line_is_drawn_in_bounded_points_with_its_peaks():
    """Up to POINTS points a line is drawn point for point; past that each
    stretch keeps its lowest and highest point, so a one-sample peak stays."""
    from memguard.cli.report import POINTS, _Series

    short = _Series()
    for n in range(POINTS):
        short.add(n, n % 7)
    assert short.points() == (list(range(POINTS)), [n % 7 for n in range(POINTS)])
    long = _Series()
    for n in range(50000):
        long.add(n, 5.0 if n == 31337 else -1.0 if n == 7 else 1.0 if n % 2 else math.nan)
    xs, ys = long.points()
    assert len(xs) <= 2 * POINTS and xs == sorted(xs)
    assert (31337, 5.0) in zip(xs, ys) and (7, -1.0) in zip(xs, ys)
    assert not any(math.isnan(y) for y in ys), "a missing value gives way to a real one"


def test_import_memguard_needs_neither_matplotlib_nor_tensorboard():
    code = ("import sys, memguard, memguard.cli.report, memguard.telemetry.tensorboard, memguard.cli; "
            "print(sorted(m for m in ('matplotlib', 'tensorboard', 'torch.utils.tensorboard') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# -- Guard.postfix ---------------------------------------------------------------
MEM = re.compile(r"^(?P<used>\d+(\.\d)?)/(?P<budget>\d+(\.\d)?)(?P<unit>GiB|MiB)$")


def test_postfix_of_the_run(run):
    p, s = run["postfix"], run["summary"]
    assert set(p) == {"mem", "micro", "oom"}
    assert p["micro"] == run["micro"][-1] == s["micro_batch"]
    assert p["oom"] == s["ooms_recovered"] == 1
    m = MEM.match(p["mem"])
    assert m, p["mem"]
    scale = 2**30 if m["unit"] == "GiB" else MiB
    assert abs(float(m["used"]) * scale - run["latest_rss"]) <= 0.05 * scale + 1
    assert abs(float(m["budget"]) * scale - s["budget_bytes"]) <= 0.05 * scale + 1


def test_postfix_before_any_sample_and_without_budget():
    from memguard import Guard

    assert Guard(budget="4GiB", allocator=False).postfix() == \
        {"mem": "?/4.0GiB", "micro": 0, "oom": 0}
    assert Guard(budget="512MiB", allocator=False).postfix()["mem"] == "?/512MiB"
    assert Guard(budget=None, allocator=False).postfix()["mem"] == "?"


def test_postfix_in_a_tqdm_bar():
    tqdm = pytest.importorskip("tqdm").tqdm
    from memguard import Guard

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = Sampler(interval_ms=20)
    guard = Guard(budget=None, micro_batch=2, allocator=False, sampler=sampler)
    buf = io.StringIO()
    with guard, tqdm(range(3), file=buf, mininterval=0) as bar:
        for _ in bar:
            guard.step(torch.randn(8, 4), lambda x: model(x).square().mean(), opt)
            while sampler.latest() is None:
                pass
            bar.set_postfix(guard.postfix())
    line = buf.getvalue().splitlines()[-1] if "\n" in buf.getvalue() else buf.getvalue()
    assert re.search(r"mem=\d+(\.\d)?(GiB|MiB), micro=2, oom=0", line), line


# -- the TensorBoard exporter -------------------------------------------------------
def test_tensorboard_scalars_match_the_jsonl(run):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(str(run["tb_dir"]))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"memory/rss_bytes", "memory/budget_bytes", "memory/arena_allocated_bytes",
            "pressure/level", "throttle/micro_batch", "throttle/n_micro", "throttle/retries",
            "throttle/peak_bytes", "throttle/loss", "throttle/ooms_recovered"} <= tags

    assert [(e.step, e.value) for e in ea.Scalars("throttle/micro_batch")] == \
        list(enumerate(float(m) for m in run["micro"]))
    _, samples, events = read_jsonl(run["jsonl"])
    oom_step = next(e["step"] for e in events if e["event"] == "oom_recovered")
    assert [(e.step, e.value) for e in ea.Scalars("throttle/ooms_recovered")] == \
        [(oom_step, 1.0)]

    # the same sampler fed both exporters: every JSONL sample is in TensorBoard
    by_seq = {tag: {e.step: e.value for e in ea.Scalars(tag)}
              for tag in ("memory/rss_bytes", "memory/arena_allocated_bytes", "pressure/level")}
    assert len(samples) >= 10
    for s in samples:
        assert by_seq["memory/rss_bytes"][s.seq] == pytest.approx(s.rss_bytes, rel=1e-6)
        assert by_seq["memory/arena_allocated_bytes"][s.seq] == \
            pytest.approx(s.arena_allocated_bytes, rel=1e-6)
        assert by_seq["pressure/level"][s.seq] == int(s.level)


def test_tensorboard_exporter_direct_use(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from memguard.telemetry.tensorboard import TensorBoardExporter

    sampler = Sampler(budget="4GiB")
    with TensorBoardExporter(tmp_path) as tb:
        s = sampler.sample_now()
        tb(s)
        tb.event("checkpoint", step=3, blocks=2, reason="high")
        tb.event("relieve", reason="high", seconds=0.25, arena_released_bytes=4096)
        tb.event("relieve", reason="oom", seconds=0.5)
        tb.event("validation_start", epoch=1, note="not a number")
        tb.event("forecast", step=40, rate_bytes_per_step=2048.0, steps_left=300, growing=[])
        tb.event("headroom", step=41, largest_batch=96, queue=None)
    tb.close()                      # idempotent
    tb(s)                           # and quiet once closed
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()

    def values(tag):
        return [(e.step, e.value) for e in ea.Scalars(tag)]

    assert values("memory/budget_bytes") == [(s.seq, 4.0 * 2**30)]
    assert values("throttle/checkpointed_blocks") == [(3, 2.0)]
    assert values("gc/reliefs") == [(3, 1.0), (3, 2.0)]
    assert values("gc/relief_seconds") == [(3, 0.25), (3, 0.5)]
    assert values("events/validation_start") == [(3, 1.0)]
    assert values("drift/rate_bytes_per_step") == [(40, 2048.0)]
    assert values("drift/steps_left") == [(40, 300.0)]
    assert values("headroom/largest_batch") == [(41, 96.0)]
    if s.arena_allocated_bytes is None:     # absent: left out, never a made-up 0
        assert "memory/arena_allocated_bytes" not in ea.Tags()["scalars"]
    else:
        assert values("memory/arena_allocated_bytes") == [(s.seq, s.arena_allocated_bytes)]
