"""The demo's story on the booted lab, read as a CI log reads it (output not a terminal).

What a newcomer met on a first run, each now checked: a final table with a step left `pending`, a
plan row cut off, a progress line printed several times, a wait with no line at all, a dry run that
refused to show its plan without --kill-training, misleading words for a unit never deployed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from test_pivot import REPO, ct200

pytestmark = [pytest.mark.lab, pytest.mark.slow]

RESET = ("systemctl disable --now ddtree.service; rm -f /etc/systemd/system/ddtree.service "
         "/etc/ddops/ddtree.env /var/lib/ddops/pivot.lock /var/lib/ddops/pivot.journal.json; rm -rf /var/lib/ddops/backups; "
         "systemctl daemon-reload; systemctl reset-failed; systemctl start dflash-train.service")
SILENT_S = 10.0     # the longest a log may go without a line
PROGRESS = re.compile(r"^(-->|\s{5}\S)")   # banners and the plan view's notes and heartbeats


@pytest.fixture(scope="module")
def story(lab):
    """Run `ddops demo --keep` from a fresh ct200 (training, no ddtree.service); its lines, timed."""
    ct200(lab, RESET)
    proc = subprocess.Popen([sys.executable, "-m", "ddops", "-i", str(lab.inventory_path), "demo", "--keep"],
                            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    timed: list[tuple[float, str]] = []
    started = time.monotonic()
    for line in proc.stdout:
        timed.append((time.monotonic() - started, line.rstrip("\n")))
    code = proc.wait(timeout=60)
    yield code, timed
    ct200(lab, RESET)


def text(timed) -> str:
    return "\n".join(line for _, line in timed)


def test_the_demo_passes_and_leaves_the_lab_running_with_keep(story, lab):
    code, timed = story
    out = text(timed)
    assert code == 0, out[-4000:]
    assert "every step passed" in out
    assert "the lab is still running" in out and "`ddops lab down` stops it" in out
    assert lab.ssh("ct200", "true").returncode == 0


def test_no_step_is_left_pending_and_the_summary_starts_its_own_line(story):
    _, timed = story
    out = text(timed)
    assert not re.search(r"\spending\b", out), [line for line in out.splitlines() if "pending" in line]
    assert re.search(r"^OK: ddtree.service on ct200 is active and healthy", out, re.M)
    assert re.search(r"^\s*✔\s+Record:\s+done\b", out, re.M)


def test_the_dry_run_shows_the_whole_plan_without_the_kill_flag(story):
    _, timed = story
    out = text(timed)
    assert re.search(r"stop training pid \d+ \(dflash-train.service\) at step \d+ \(a real run needs "
                     r"--kill-training\)", out)
    # each sync row whole: source, destination, file count and size
    assert re.search(r"sync draft eval-a6000:/root/models/tiny-draft -> /root/models/tiny-draft: \d+ file\(s\), "
                     r"[\d.]+ MiB", out)
    assert re.search(r"sync target local:\S+/tiny-models-seed0/target -> /root/models/tiny-target: \d+ file\(s\)", out)
    assert "DRY-RUN: nothing was changed; a real run must stop training on ct200" in out
    assert "dry run: nothing was changed" not in out


def test_words_for_a_unit_never_deployed_and_for_the_smoke_test(story):
    _, timed = story
    out = text(timed)
    assert "ddtree.service: not installed" in out
    assert "journal of ddtree.service on ct200" in out
    assert re.search(r"smoke 'What is 2\+3\?' -> '5' ok: \d+ token\(s\)", out)


def test_no_progress_line_repeats_and_the_log_is_never_silent(story):
    _, timed = story
    progress = [line for _, line in timed if PROGRESS.match(line)]
    repeats = [a for a, b in zip(progress, progress[1:]) if a == b]
    assert not repeats, repeats
    gaps = [(b[0] - a[0], a[1]) for a, b in zip(timed, timed[1:])]
    longest = max(gaps)
    assert longest[0] <= SILENT_S, f"{longest[0]:.1f}s of silence after: {longest[1]!r}"
