"""The host scripts run here, on this machine's /proc, as a host runs them: the facts probe finds a
training job and its last step, the stop_training action stops it, and neither mistakes ddops's own
scripts (whose arguments name the same pattern) for the job; the lock action and the inspect probe
read the lock alike."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from ddops.probes import probe_source


def run(name: str, args: dict, *flags: str) -> dict:
    done = subprocess.run([sys.executable, *flags, "-c", probe_source(name), json.dumps(args)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_facts_finds_the_job_and_stop_training_stops_it_but_no_ddops_script(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "train.log").write_text("step 5 loss 2.1\nstep=17 loss 1.9\n")
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # fake_train_job_zz"])
    # another run's script, its arguments naming the pattern, as a concurrent pivot's probe would be
    other = subprocess.Popen([sys.executable, "-c", "# ddops-probe\nimport time; time.sleep(60)",
                              json.dumps({"pattern": "fake_train_job_zz"})])
    try:
        time.sleep(0.3)
        spec = {"pattern": "fake_train_job_zz", "unit": None, "log": str(tmp_path / "train.log"),
                "checkpoints": str(tmp_path / "ckpt")}
        facts = run("facts", {"training": spec, "services": []}, "-I", "-S")
        assert facts["training"]["pids"] == [job.pid] and facts["training"]["last_step"] == 17
        assert facts["training"]["last_loss"] == 1.9
        out = run("stop_training", {**spec, "grace_s": 5})
        assert out["pids"] == [job.pid] and out["stopped"] and out["graceful"] and out["step_after"] == 17
        assert job.wait(timeout=10) == -15  # SIGTERM
    finally:
        job.kill()
        other.kill()


def test_the_lock_action_and_the_inspect_probe_read_the_lock_alike(tmp_path):
    path = str(tmp_path / "pivot.lock")
    assert run("inspect", {"lock": path})["lock"] is None
    assert run("lock", {"action": "acquire", "path": path, "holder": {"token": "t1", "pid": 7}})["acquired"]
    lock = run("inspect", {"lock": path})["lock"]
    assert (lock["token"], lock["pid"]) == ("t1", 7) and lock["renewed_at"] > 0
    assert run("lock", {"action": "acquire", "path": path, "holder": {"token": "t2"}})["holder"]["token"] == "t1"
    assert not run("lock", {"action": "release", "path": path, "token": "t2"})["released"]
    assert run("lock", {"action": "release", "path": path, "token": "t1"})["released"]
    (tmp_path / "pivot.lock").write_text("{not json")
    assert run("inspect", {"lock": path})["lock"] == {"unreadable": True}
    assert run("lock", {"action": "clear", "path": path, "token": None}) == {"cleared": True,
                                                                            "holder": {"unreadable": True}}


def test_facts_reads_a_runtimes_load_and_its_pages_where_it_shows_them():
    """/health's running / max_running, and the paged pool's gauges from /metrics (not the others)."""
    import http.server
    import threading

    class Runtime(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (json.dumps({"status": "ok", "mode": "ddtree", "running": 3, "max_running": 16})
                    if self.path == "/health" else
                    "# TYPE ddtree_kv_pages_used gauge\nddtree_kv_pages_used 120\nddtree_kv_pages_free 880\n"
                    "ddtree_running_requests 3\n").encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Runtime)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        facts = run("facts", {"services": [{"unit": "ddtree.service", "port": server.server_address[1]}]})
    finally:
        server.shutdown()
    runtime, = facts["runtime"]
    assert runtime["healthy"] and runtime["detail"]["running"] == 3
    assert runtime["pool"] == {"ddtree_kv_pages_used": 120, "ddtree_kv_pages_free": 880}


def test_facts_reads_a_runtimes_metrics_with_its_key_from_stdin():
    """With `metrics`, the probe reads /metrics of each installed runtime, keeping only the wanted samples."""
    import http.server
    import threading

    seen = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            body = (b'# TYPE ddtree_requests_total counter\n'
                    b'ddtree_requests_total{endpoint="/v1/completions",status="500"} 2.0\n'
                    b'ddtree_queue_depth 3.0\nddtree_other 9\n')
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    args = {"services": [{"unit": "ddtree.service", "port": port, "health": "/health"}],
            "metrics": ["ddtree_requests_total", "ddtree_queue_depth"]}
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", probe_source("facts"), json.dumps(args)],
                              input=json.dumps({str(port): "k1"}), capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    runtime, = json.loads(done.stdout)["runtime"]
    scraped = runtime["metrics"]
    assert scraped["error"] is None and scraped["samples"] == [["ddtree_requests_total", {"endpoint": "/v1/completions", "status": "500"}, 2.0],
                                  ["ddtree_queue_depth", {}, 3.0]]
    assert "Bearer k1" in seen
