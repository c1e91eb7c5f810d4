"""ddops-action lock: the host's pivot lock and the journal of intent of the run that holds it.

The lock is a JSON file created exclusively (O_EXCL). Its holder is renewed (`renewed_at`, this host's
clock) by the run that holds it; `inspect` says how long its lease has left, so a run on another
control machine can tell a dead holder (lease expired) from a live one.

The journal (one JSON file beside the lock) is written before each change a pivot makes: what it is
about to change and how to undo it. Every journal write first checks that the caller still holds the
lock, so a run whose lock was broken learns it before its next change.

Actions: acquire, release (own token), renew (own token), inspect, clear (only the holder named by
token), journal-open, journal-note, journal-close (own token), journal-read.
"""
import json
import os
import sys
import time
# read_json and write_atomic come from hostlib.py, which probe_source() prepends to this script.


def lease_left(holder):
    """Seconds until the holder's lease runs out (None: a lock without a lease)."""
    if not isinstance(holder, dict) or not holder.get("lease_s") or not holder.get("renewed_at"):
        return None
    return round(holder["renewed_at"] + holder["lease_s"] - time.time(), 1)


def held_by(path, token):
    """The lock's holder, and whether it is the caller (its token)."""
    holder = read_json(path)
    return holder, isinstance(holder, dict) and holder.get("token") == token


def lock_action(spec, path, action):
    if action == "acquire":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        holder = dict(spec["holder"], renewed_at=time.time())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = read_json(path)
            return {"acquired": False, "holder": held, "lease_left_s": lease_left(held)}
        with os.fdopen(fd, "w") as fh:
            json.dump(holder, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return {"acquired": True, "holder": holder}
    holder, ours = held_by(path, spec.get("token"))
    if action == "release":
        if ours:
            os.unlink(path)
        return {"released": ours, "holder": holder}
    if action == "renew":
        if ours:
            write_atomic(path, json.dumps(dict(holder, renewed_at=time.time())))
        return {"renewed": ours, "holder": holder}
    if action == "inspect":
        return {"holder": holder, "lease_left_s": lease_left(holder)}
    if action == "clear":
        cleared = holder is not None and (holder.get("token") == spec.get("token") or "unreadable" in holder)
        if cleared:
            os.unlink(path)
        return {"cleared": cleared, "holder": holder}
    raise SystemExit("unknown lock action %r" % action)


def journal_action(spec, path, action):
    journal_path = spec["journal"]
    if action == "journal-read":
        return {"journal": read_json(journal_path), "holder": read_json(path)}
    holder, ours = held_by(path, spec["token"])
    if not ours:
        return {"lost": True, "holder": holder}
    journal = read_json(journal_path)
    if action == "journal-open":
        if journal is not None:
            return {"unfinished": journal}
        write_atomic(journal_path, json.dumps(dict(spec["record"], opened_at=time.time(), notes=[])))
        return {"opened": True}
    if action == "journal-note":
        if not isinstance(journal, dict) or journal.get("token") != spec["token"]:
            return {"lost": True, "holder": holder, "journal": journal}
        journal["notes"].append(dict(spec["note"], at=time.time()))
        journal.update(spec.get("update") or {})
        write_atomic(journal_path, json.dumps(journal))
        return {"noted": True}
    if action == "journal-close":
        if journal is not None:
            os.unlink(journal_path)
        return {"closed": journal is not None}
    raise SystemExit("unknown journal action %r" % action)


def main():
    spec = json.loads(sys.argv[1])
    path, action = spec["path"], spec["action"]
    act = journal_action if action.startswith("journal-") else lock_action
    json.dump(act(spec, path, action), sys.stdout)


main()
