"""`ddops monitor` on the lab: Debian's Prometheus installed on eval-a6000, scraping ct200's two replicas
(file-based discovery rendered from what the hosts run), a PromQL query over its HTTP API returning the
runtime's tokens and acceptance, every panel of the shipped Grafana dashboard returning data, and a
pivot to three replicas (eval-a6000 with role `monitor`) updating the targets without a restart.

The lab hosts share this machine's loopback, so eval-a6000's Prometheus answers on 127.0.0.1:9090 here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.lab.test_replicas import REPO, chat, ct200, ddops, variant
from tests.lab.test_top_tmux import RESET, serve_replicas

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PROMETHEUS = "http://127.0.0.1:9090"
DASHBOARD = REPO / "dashboards" / "ddtree.json"


@pytest.fixture(scope="module")
def monitored(lab):
    serve_replicas(lab)
    yield lab
    lab.ssh("eval-a6000", "systemctl disable --now prometheus.service; DEBIAN_FRONTEND=noninteractive apt-get "
                          "purge -y -q prometheus; rm -rf /etc/prometheus /etc/systemd/system/prometheus.service.d "
                          "/var/lib/prometheus /var/lib/ddops/backups/prometheus.service; systemctl daemon-reload", timeout=300)
    ct200(lab, RESET)


def query(expr: str) -> list[dict]:
    url = PROMETHEUS + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def eventually(expr: str, check, timeout: float = 90.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = query(expr)
            if check(result):
                return result
        except OSError:
            result = None
        assert time.monotonic() < deadline, f"{expr}: {result}"
        time.sleep(2)


def test_prometheus_scrapes_every_replica_and_the_dashboard_has_data(monitored, tmp_path):
    lab = monitored
    done = ddops(lab, "--limit", "ct200", "monitor", "--host", "eval-a6000", "--json", timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert sorted((t["unit"], t["port"]) for t in report["targets"]) == [("ddtree@1.service", 8201),
                                                                          ("ddtree@2.service", 8202)]
    assert "promtool" in lab.ssh("eval-a6000", "command -v promtool").stdout
    config = lab.ssh("eval-a6000", "cat /etc/prometheus/prometheus.yml").stdout
    assert "file_sd_configs" in config and "Managed by ddops" in config
    assert lab.ssh("eval-a6000", f"ls /var/lib/ddops/backups/prometheus.service/{report['backup_id']}/meta.json"
                   ).returncode == 0

    # (a Prometheus that ran here before may still hold a series of a replica gone since: each query names its own)
    up = eventually('up{job="ddops-serving", unit=~"ddtree@[12].service"}',
                    lambda r: len(r) == 2 and all(s["value"][1] == "1" for s in r))
    assert {s["metric"]["unit"] for s in up} == {"ddtree@1.service", "ddtree@2.service"}
    for _ in range(6):   # leastconn over two idle replicas: both generate
        chat()
    tokens = eventually('sum by (unit) (ddtree_generated_tokens_total{unit=~"ddtree@[12].service"})',
                        lambda r: len(r) == 2 and all(float(s["value"][1]) > 0 for s in r))
    assert {s["metric"]["unit"] for s in tokens} == {"ddtree@1.service", "ddtree@2.service"}
    acceptance = eventually('sum by (unit) (ddtree_acceptance_length_sum{unit=~"ddtree@[12].service"}) / '
                            'sum by (unit) (ddtree_acceptance_length_count)', lambda r: len(r) == 2)
    assert all(1.0 <= float(s["value"][1]) <= 16 for s in acceptance)

    # load while the rates fill a minute's window, then every panel's query returns data
    for _ in range(8):
        chat()
        time.sleep(1)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 6
    for title, expr in exprs:
        assert eventually(expr, lambda r: len(r) > 0, timeout=60), f"panel {title!r}: no data"

    # a pivot that adds a replica, with eval-a6000 marked `monitor` in the inventory: the discovery file
    # follows, and Prometheus finds the new replica without a restart
    doc = yaml.safe_load(Path(lab.inventory_path).read_text())
    doc["hosts"]["eval-a6000"]["roles"] = [*doc["hosts"]["eval-a6000"].get("roles", []), "monitor"]
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(doc))
    three = variant(tmp_path, replicas={"count": 3, "gpus_each": 1})
    pid = lab.ssh("eval-a6000", "systemctl show -p MainPID --value prometheus.service").stdout.strip()
    done = subprocess.run([sys.executable, "-m", "ddops", "-i", str(inventory), "pivot", "--deploy", str(three),
                           "--yes", "--json"], capture_output=True, text=True, timeout=900, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "monitor eval-a6000: Prometheus discovers" in done.stderr
    assert "127.0.0.1:8203" in lab.ssh("eval-a6000", "cat /etc/prometheus/ddops/ddops-serving.json").stdout
    eventually('up{unit="ddtree@3.service"}', lambda r: len(r) == 1 and r[0]["value"][1] == "1")
    assert lab.ssh("eval-a6000", "systemctl show -p MainPID --value prometheus.service").stdout.strip() == pid
