"""Recovery without a lab (issue 36): the lock and journal action and the unitfile action run here, on
temp files, as a host runs them; the lock's liveness, the undos' records, the choice of a backup and
the flow's journal of intent over the fake ct200 of test_flow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tenacity import Retrying, stop_after_attempt

from ddops import history, hostlock
from ddops.backups import choose_backup
from ddops.errors import Refused, StepFailed, UsageError
from ddops.plan import Operation
from ddops.probes import probe_source
from ddops.rollback import rollback_command, rollback_undos, undo
from ddops.undo import Reinstall, RestoreBackup, RollBackReplicas, StartAgain, as_record, from_record
from test_flow import LAB, FakeExecutor, FakeStep, profile, run_pivot  # noqa: F401 - profile: a fixture

CT200 = LAB.host("ct200")


def script(name: str, args: dict | None = None, stdin: dict | None = None) -> dict:
    argv = [sys.executable, "-c", probe_source(name)] + ([json.dumps(args)] if args is not None else [])
    done = subprocess.run(argv, input=json.dumps(stdin) if stdin is not None else None, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- the lock and the journal, on the host --------------------------------------------------------

def test_the_journal_is_written_only_by_the_lock_holder_and_refuses_a_second_pivot(tmp_path):
    lock, journal = str(tmp_path / "pivot.lock"), str(tmp_path / "pivot.journal.json")

    def act(action, token, **spec):
        return script("lock", {"action": action, "path": lock, "journal": journal, "token": token, **spec})

    assert script("lock", {"action": "acquire", "path": lock, "holder": {"token": "t1", "pid": 7}})["acquired"]
    assert act("journal-open", "t2", record={"token": "t2"})["lost"]           # not the holder: nothing written
    assert not os.path.exists(journal)
    assert act("journal-open", "t1", record={"token": "t1", "profile": "p", "undo": [], "step": None})["opened"]
    assert act("journal-note", "t1", note={"step": "training"}, update={"step": "training"})["noted"]
    found = act("journal-read", None)["journal"]
    assert found["step"] == "training" and [n["step"] for n in found["notes"]] == ["training"]
    # the run dies; a second one takes the lock (after it was cleared): the journal refuses its pivot
    assert not act("clear", "wrong")["cleared"] and act("clear", "t1")["cleared"]
    assert script("lock", {"action": "acquire", "path": lock, "holder": {"token": "t3"}})["acquired"]
    assert act("journal-open", "t3", record={"token": "t3"})["unfinished"]["profile"] == "p"
    assert act("journal-note", "t3", note={"step": "x"})["lost"]     # a note only by the run that opened it
    assert act("journal-close", "t3")["closed"] and act("journal-read", None)["journal"] is None


def test_a_renewal_moves_the_lease_and_tells_a_run_its_lock_is_gone(tmp_path):
    lock = str(tmp_path / "pivot.lock")
    script("lock", {"action": "acquire", "path": lock, "holder": {"token": "t1", "lease_s": 120}})
    left = script("lock", {"action": "inspect", "path": lock})["lease_left_s"]
    assert 110 < left <= 120
    assert script("lock", {"action": "renew", "path": lock, "token": "t1"})["renewed"]
    out = script("lock", {"action": "renew", "path": lock, "token": "t2"})
    assert not out["renewed"] and out["holder"]["token"] == "t1"


def test_liveness_same_control_machine_by_pid_and_start_another_by_lease():
    me = history.who()["control_host"]
    alive = {"control_host": me, "pid": os.getpid(), "pid_start": hostlock.process_start(os.getpid())}
    assert hostlock.liveness(alive, None) is None
    assert "another process" in hostlock.liveness({**alive, "pid_start": "other-boot:1"}, None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert "no longer runs" in hostlock.liveness({"control_host": me, "pid": dead.pid}, None)
    elsewhere = {"control_host": "laptop-far-away", "pid": os.getpid()}   # its pid means nothing here
    assert hostlock.liveness(elsewhere, 30.0) is None
    assert "expired 5s ago" in hostlock.liveness(elsewhere, -5.0)
    assert "no lease" in hostlock.liveness(elsewhere, None)


class LockHost(FakeExecutor):
    """ct200's lock action answering `inspect` and `clear` with a given holder."""

    def __init__(self, holder: dict, lease_left_s: float | None) -> None:
        super().__init__()
        self.holder, self.lease_left_s = holder, lease_left_s

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
        if argv[:2] == ["python3", "-c"] and argv[2] == probe_source("lock"):
            self.commands.append(["lock", *argv[3:]])
            action = json.loads(argv[3])["action"]
            out = {"holder": self.holder, "lease_left_s": self.lease_left_s} if action == "inspect" else {
                "cleared": True, "holder": self.holder}
            return self.result(host, 0, json.dumps(out))
        return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)


def test_break_lock_refuses_a_live_holder_naming_it_and_clears_a_dead_one():
    me = history.who()["control_host"]
    live = {"user": "ana", "control_host": me, "pid": os.getpid(), "command": "ddops pivot --deploy x",
            "pid_start": hostlock.process_start(os.getpid()), "token": "t1"}
    ex = LockHost(live, 100.0)
    with pytest.raises(UsageError, match=f"locked by a live ddops run: ana@{me} pid {os.getpid()}"):
        hostlock.break_if_dead(ex, CT200)
    assert [json.loads(c[1])["action"] for c in ex.commands] == ["inspect"]      # nothing cleared
    far = LockHost({"user": "bo", "control_host": "laptop-far-away", "pid": 1, "token": "t2", "lease_s": 120}, -3.0)
    assert "expired" in hostlock.break_if_dead(far, CT200)["dead"]
    assert json.loads(far.commands[-1][1]) == {"action": "clear", "path": "/var/lib/ddops/pivot.lock", "token": "t2"}


# -- backups: checked before use ---------------------------------------------------------------------

def unit_files(tmp_path: Path) -> dict:
    (tmp_path / "x.service").write_text("[Service]\nExecStart=/bin/true\n")
    (tmp_path / "x.env").write_text("A=1\n")
    return {"unit": "x.service", "unit_path": str(tmp_path / "x.service"), "env_path": str(tmp_path / "x.env"),
            "backup_root": str(tmp_path / "backups")}


def test_a_damaged_backup_is_listed_with_why_and_never_restored(tmp_path):
    spec = unit_files(tmp_path)
    for backup_id in ("B1", "B2", "B3"):
        assert script("unitfile", stdin={**spec, "action": "backup", "backup_id": backup_id,
                                         "meta": {"reason": "pivot"}})["backup_id"] == backup_id
    (tmp_path / "backups" / "B2" / "unit").write_text("[Service]\nExecStart=/bin/false\n")   # tampered
    (tmp_path / "backups" / "B3" / "meta.json").write_text('{"unit": "x.ser')              # truncated
    listed = {b["id"]: b.get("damaged") for b in script("unitfile", stdin={**spec, "action": "list"})}
    assert listed["B1"] is None
    assert "'unit' does not match the checksum" in listed["B2"] and "does not parse" in listed["B3"]
    out = script("unitfile", stdin={**spec, "action": "restore", "backup_id": "B2", "save_as": "S1"})
    assert out == {"refused": "it is damaged: " + listed["B2"]}
    assert not (tmp_path / "backups" / "S1").exists()
    assert (tmp_path / "x.service").read_text() == "[Service]\nExecStart=/bin/true\n"


def test_a_restore_first_backs_up_what_it_replaces(tmp_path):
    spec = unit_files(tmp_path)
    script("unitfile", stdin={**spec, "action": "backup", "backup_id": "B1", "meta": {"reason": "pivot"}})
    (tmp_path / "x.service").write_text("[Service]\nExecStart=/bin/new\n")     # what a pivot installed
    out = script("unitfile", stdin={**spec, "action": "restore", "backup_id": "B1", "save_as": "S1"})
    assert out["saved_as"] == "S1" and (tmp_path / "x.service").read_text().endswith("/bin/true\n")
    assert (tmp_path / "backups" / "S1" / "unit").read_text().endswith("/bin/new\n")
    meta = json.loads((tmp_path / "backups" / "S1" / "meta.json").read_text())
    assert (meta["reason"], meta["replaced_by"]) == ("rollback", "B1")



def test_discard_removes_only_the_backup_it_names(tmp_path):
    spec = unit_files(tmp_path)
    for backup_id in ("B1", "B2"):
        script("unitfile", stdin={**spec, "action": "backup", "backup_id": backup_id, "meta": {"reason": "pivot"}})
    assert script("unitfile", stdin={**spec, "action": "discard", "backup_id": "B2"}) == {"discarded": True}
    assert script("unitfile", stdin={**spec, "action": "discard", "backup_id": ".."}) == {"discarded": False}
    assert sorted(p.name for p in (tmp_path / "backups").iterdir()) == ["B1"]

class Backups(FakeExecutor):
    def __init__(self, backups: list[dict], history_lines: list[dict] = ()) -> None:
        super().__init__(backups=backups)
        self.lines = list(history_lines)

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
        if argv[:2] == ["bash", "-c"] and stdin is None and argv[-1].endswith("history.jsonl"):
            return self.result(host, 0, "".join(json.dumps(r) + "\n" for r in self.lines))
        return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)


def test_the_newest_backup_damaged_is_refused_not_passed_over_and_rollbacks_own_are_not_chosen():
    good = {"id": "B1", "meta": {"reason": "pivot"}}
    bad = {"id": "B2", "meta": {}, "damaged": "meta.json does not parse: Expecting value"}
    saved = {"id": "B3", "meta": {"reason": "rollback"}}
    ex = Backups([good, bad, saved])
    with pytest.raises(UsageError, match="backup B2 of x.service on ct200 is damaged .meta.json does not parse") as err:
        choose_backup(ex, CT200, "x.service", None)
    assert "--to B1" in err.value.line()
    with pytest.raises(UsageError, match="B2 .* is damaged"):
        choose_backup(ex, CT200, "x.service", "B2")
    assert choose_backup(Backups([good, saved]), CT200, "x.service", None)["id"] == "B1"


def test_a_second_rollback_in_a_row_has_nothing_to_do():
    ex = Backups([{"id": "B1", "meta": {"reason": "pivot"}}], history_lines=[
        {"kind": "pivot", "unit": "x.service", "outcome": "ok", "time": 1},
        {"kind": "rollback", "unit": "x.service", "outcome": "ok", "backup_id": "B1", "time": 2}])
    report: dict = {}
    assert rollback_undos(ex, CT200, "x.service", None, None, report) is None
    assert report["unchanged"] and report["backup_id"] == "B1" and report["restarted"] == []
    # a pivot since: its backup is rolled back again
    ex.lines.append({"kind": "pivot", "unit": "x.service", "outcome": "ok", "time": 3})
    assert rollback_undos(ex, CT200, "x.service", None, None, {}) == [RestoreBackup("x.service", "B1", True)]


def test_a_rollback_to_a_pivot_s_backup_applies_the_way_back_it_recorded():
    """The release from before that pivot and what it stopped come back too, not only the unit's files."""
    previous = {"release": "0.1", "python": "p", "wheel": "w", "record": "r", "record_text": "{}"}
    way_back = [StartAgain("dflash-train.service"), Reinstall(previous), RestoreBackup("x.service", "B1")]
    ex = Backups([{"id": "B1", "meta": {"reason": "pivot"}}], history_lines=[
        {"kind": "pivot", "unit": "x.service", "outcome": "ok", "backup_id": "B1",
         "way_back": [as_record(u) for u in way_back]}])
    assert rollback_undos(ex, CT200, "x.service", None, None, {}) == [
        StartAgain("dflash-train.service"), Reinstall(previous), RestoreBackup("x.service", "B1", True)]



def test_a_rollback_to_a_rolling_pivot_s_backup_cycles_each_replica_once_in_order():
    """The restore of every replica cycles them in the manifest's order; the pivot's undos of its batches
    (applied newest first) would cycle them again, the last batch first."""
    template = "ddtree@.service"
    way_back = [StartAgain("dflash-train.service"), RestoreBackup(template, "B1"),
                RollBackReplicas(template, ("ddtree@1.service",)), RollBackReplicas(template, ("ddtree@2.service",))]
    ex = Backups([{"id": "B1", "meta": {"reason": "pivot"}}], history_lines=[
        {"kind": "pivot", "unit": template, "outcome": "ok", "backup_id": "B1",
         "way_back": [as_record(u) for u in way_back]}])
    assert rollback_undos(ex, CT200, template, None, None, {}) == [
        StartAgain("dflash-train.service"), RestoreBackup(template, "B1", True)]


def test_a_rollback_with_nothing_to_roll_back_touches_nothing_not_even_the_lock():
    ex = Backups([])
    for backup_id in (None, "20990101T000000Z-dead"):
        with pytest.raises(UsageError, match="no backups of x.service on ct200"):
            rollback_command(ex, LAB, CT200, "x.service", backup_id, lambda m: None)
    actions = [json.loads(c[1])["action"] for c in ex.commands if c[0] == "lock"]
    assert actions == ["journal-read", "journal-read"] and ex.history == []

def test_an_unfinished_pivot_is_rolled_back_with_the_undos_it_recorded():
    recorded = [StartAgain("dflash-train.service"), RestoreBackup("ddtree.service", "B7"),
                Reinstall({"release": "0.1", "python": "p", "wheel": "w", "record": "r", "record_text": "{}"}),
                RollBackReplicas("ddtree@.service", ("ddtree@1.service",))]
    records = json.loads(json.dumps([as_record(u) for u in recorded]))   # through the journal's JSON
    assert [from_record(r) for r in records] == recorded
    journal = {"profile": "lab", "undo": records, "step": "sync", "started_at": "T", "user": "u"}
    report: dict = {}
    assert rollback_undos(Backups([]), CT200, "ddtree.service", None, journal, report) == recorded
    assert report["unfinished"]["step"] == "sync"
    with pytest.raises(UsageError, match="unfinished pivot .lab by u@"):
        rollback_undos(Backups([]), CT200, "ddtree.service", "B1", journal, {})


def test_training_the_rollback_finds_running_is_not_claimed_as_restarted():
    class Running(FakeExecutor):
        def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
            if argv[:2] == ["systemctl", "is-active"]:
                self.commands.append(list(argv))
                return self.result(host, 0, "active\n")
            return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)

    ex = Running()
    report = undo(ex, LAB, CT200, [StartAgain("dflash-train.service")],
                  retrying=Retrying(stop=stop_after_attempt(1), reraise=True))
    assert report["restarted"] == [] and report["running"] == ["dflash-train.service"]
    assert ex.systemctl() == []


# -- the flow's journal of intent ---------------------------------------------------------------------

class JournalHost(FakeExecutor):
    """ct200 whose lock action answers the journal actions as given (`answers`: action -> JSON)."""

    def __init__(self, answers: dict[str, dict]) -> None:
        super().__init__()
        self.answers = answers
        self.journal: list[dict] = []

    def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
        if argv[:2] == ["python3", "-c"] and argv[2] == probe_source("lock"):
            spec = json.loads(argv[3])
            self.journal.append(spec)
            if spec["action"] in self.answers:
                self.commands.append(["lock", argv[3]])
                return self.result(host, 0, json.dumps(self.answers[spec["action"]]))
        return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)


def test_the_journal_holds_every_undo_before_the_first_change(monkeypatch, profile):
    ex = JournalHost({})
    steps = [FakeStep("training", [Operation("stop training", undo=StartAgain("dflash-train.service"))]),
             FakeStep("start", [Operation("stop sglang", undo=StartAgain("sglang-qwen.service"))])]
    report, ex = run_pivot(monkeypatch, profile, steps, executor=ex)
    assert report["outcome"] == "ok"
    actions = [(s["action"], (s.get("update") or {}).get("step")) for s in ex.journal]
    assert actions == [("acquire", None), ("journal-open", None), ("journal-note", None),
                       ("journal-note", "training"), ("journal-note", "start"), ("journal-note", "health"),
                       ("journal-close", None), ("release", None)]
    way_back = ex.journal[2]["update"]["undo"]
    assert [u["unit"] for u in way_back] == ["dflash-train.service", "sglang-qwen.service"]


def test_an_unfinished_pivot_on_the_host_refuses_the_next_before_any_change(monkeypatch, profile):
    ex = JournalHost({"journal-open": {"unfinished": {"profile": "lab", "user": "u", "control_host": "c", "pid": 9,
                                                      "started_at": "T", "step": "sync"}}})
    training = FakeStep("training", [Operation("stop training", undo=StartAgain("dflash-train.service"))])
    report, ex = run_pivot(monkeypatch, profile, [training], executor=ex)
    assert (report["outcome"], report["exit_code"], report["failed_step"]) == ("failed", 2, "training")
    assert training.applied == [] and ex.systemctl() == []
    assert "ct200 has an unfinished pivot (lab by u@c pid 9, started T, got as far as sync)" in report["error"]
    assert "ddops rollback --host ct200" in report["error"]


def test_a_run_whose_lock_was_broken_stops_before_its_next_change_and_keeps_its_journal(monkeypatch, profile):
    ex = JournalHost({"journal-note": {"lost": True, "holder": {"user": "bo", "control_host": "far", "pid": 3}}})
    training = FakeStep("training", [Operation("stop training", undo=StartAgain("dflash-train.service"))])
    report, ex = run_pivot(monkeypatch, profile, [training], executor=ex)
    assert training.applied == [] and report["exit_code"] == 2
    assert "this run's lock on ct200 was broken (now held by bo@far pid 3)" in report["error"]
    assert "journal-close" not in [s["action"] for s in ex.journal]


def test_a_run_that_loses_its_lock_after_a_change_says_so_and_what_to_do_never_rollback_failed(monkeypatch,
                                                                                                   profile):
    """The lock is taken by another run once training has stopped: the run stops before the unit step,
    rolls nothing back (the host is the other run's now) and says what it changed and the way back."""
    class LosesAfterTraining(JournalHost):
        def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
            if argv[:2] == ["python3", "-c"] and argv[2] == probe_source("lock"):
                self.answers = {"journal-note": {"lost": True, "holder": {"user": "bo", "control_host": "far",
                                                                         "pid": 3}}} \
                    if (json.loads(argv[3]).get("update") or {}).get("step") == "unit" else {}
            return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)

    training = FakeStep("training", [Operation("stop training", undo=StartAgain("dflash-train.service"))],
                        undo=StartAgain("dflash-train.service"))
    unit = FakeStep("unit", [Operation("write unit")])
    report, ex = run_pivot(monkeypatch, profile, [training, unit], executor=LosesAfterTraining({}))
    assert len(training.applied) == 1 and unit.applied == [] and ex.systemctl() == []   # nothing rolled back
    assert (report["outcome"], report["exit_code"], report["failed_step"]) == ("lock-lost", 2, "unit")
    assert report.get("rolled_back") is None and "ROLLBACK FAILED" not in report["state"]
    assert report["state"].startswith("LOCK LOST on ct200: another run took the lock after this one changed "
                                      "training"), report["state"]
    assert "`ddops rollback --host ct200` restores the state from before it" in report["state"]
    assert "journal-close" not in [s["action"] for s in ex.journal]
    assert ex.history[-1]["outcome"] == "lock-lost"


def test_a_backup_that_cannot_be_written_stops_the_pivot_before_training_stops(monkeypatch, profile):
    class Prepared(FakeStep):
        def prepare(self, ctx, operations):
            raise StepFailed("backing up into /var/lib/ddops/backups/ddtree.service failed: No space left on device")

    training = FakeStep("training", [Operation("stop training", undo=StartAgain("dflash-train.service"))])
    unit = Prepared("unit", [Operation("write unit")])
    report, ex = run_pivot(monkeypatch, profile, [training, unit])
    assert training.applied == [] and unit.applied == [] and ex.systemctl() == []
    assert (report["outcome"], report["exit_code"], report["failed_step"]) == ("failed", 2, "unit")
    assert report["state"].startswith("nothing was changed on ct200") and "No space left" in report["error"]



def test_a_pivot_that_changed_nothing_removes_the_backup_it_took_before_the_first_change(monkeypatch, profile):
    """Left, that backup (of the state already there) would be the one `ddops rollback` restores."""
    class Discarding(FakeExecutor):
        def run(self, host, argv, *, timeout=None, stdin=None, on_output=None):
            if stdin and json.loads(stdin).get("action") == "discard":
                self.commands.append(["unitfile", stdin])
                return self.result(host, 0, json.dumps({"discarded": True}))
            return super().run(host, argv, timeout=timeout, stdin=stdin, on_output=on_output)

    class Refusing(FakeStep):
        def apply(self, ctx, operations):
            raise Refused("stopping training on ct200 would lose 5 step(s)")

    class BacksUp(FakeStep):
        def prepare(self, ctx, operations):
            ctx.journal.backup_id = "B9"
            return [RestoreBackup("ddtree.service", "B9")]

    steps = [Refusing("training", [Operation("stop training")]), BacksUp("unit", [Operation("write unit")])]
    report, ex = run_pivot(monkeypatch, profile, steps, executor=Discarding())
    assert (report["outcome"], report["changed"], report["backup_id"]) == ("refused", [], None)
    discarded = [json.loads(c[1]) for c in ex.commands if c[0] == "unitfile"]
    assert discarded == [{"action": "discard", "backup_root": "/var/lib/ddops/backups/ddtree.service",
                          "backup_id": "B9"}]
    assert ex.history[-1]["backup_id"] is None and ex.history[-1]["way_back"] == []
    # a pivot that changed something keeps it (the way back)
    steps = [FakeStep("training", [Operation("stop training")]), BacksUp("unit", [Operation("write unit")])]
    report, ex = run_pivot(monkeypatch, profile, steps, executor=Discarding())
    assert report["backup_id"] == "B9" and not [c for c in ex.commands if c[0] == "unitfile"]

# -- status: an unfinished pivot, a pivot in progress, a stale lock -----------------------------------

def test_status_tells_an_unfinished_pivot_from_one_in_progress_and_a_stale_lock():
    from ddops.status import pivot_state

    me = history.who()["control_host"]
    journal = {"profile": "lab", "user": "u", "control_host": me, "pid": os.getpid(), "started_at": "T",
               "step": "sync"}
    live = {"user": "u", "control_host": me, "pid": os.getpid(), "pid_start": hostlock.process_start(os.getpid())}
    dead = {**live, "pid_start": "another-boot:1"}
    running = pivot_state("ct200", {"lock": live, "journal": journal, "same_run": True, "lease_left_s": 100})
    assert running["state"] == "running" and "got as far as sync" in running["line"]
    crashed = pivot_state("ct200", {"lock": dead, "journal": journal, "same_run": True, "lease_left_s": 100})
    assert crashed["state"] == "unfinished" and "`ddops rollback --host ct200`" in crashed["line"]
    assert pivot_state("ct200", {"lock": None, "journal": journal, "same_run": False})["state"] == "unfinished"
    assert pivot_state("ct200", {"lock": dead, "journal": None, "same_run": False})["state"] == "stale-lock"
    assert pivot_state("ct200", {"lock": None, "journal": None, "same_run": False}) is None
