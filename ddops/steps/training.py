"""Step 2, stop training: SIGTERM, a grace period to checkpoint, SIGKILL only if it must; verified."""

from __future__ import annotations

from dataclasses import asdict

from ..errors import StepFailed
from .base import Change, PivotRun, run_probe


def plan_training(facts: dict, kill_training: bool) -> list[Change]:
    """Stop a running job. Without --kill-training only a dry run gets this far (preflight refuses a real
    run), so the plan still shows what a real run would stop, and says it needs the flag."""
    training = facts.get("training") or {}
    if not training.get("running"):
        return []
    unit = (training.get("unit") or {}).get("unit")
    return [Change(f"stop training pid {training.get('pid')}" + (f" ({unit})" if unit else "")
                   + f" at step {training.get('last_step')}"
                   + ("" if kill_training else " (a real run needs --kill-training)"),
                   data={"pids": training.get("pids")})]


def stop_args(host, grace_s: float) -> dict:
    spec = asdict(host.training)
    spec["grace_s"] = grace_s
    return spec


class TrainingStep:
    name = "training"
    title = "Stop training"

    def plan(self, run: PivotRun) -> list[Change]:
        return plan_training(run.facts[run.profile.host], run.kill_training)

    def apply(self, run: PivotRun, changes: list[Change]) -> str:
        grace = run.profile.training_grace_s
        run.progress(f"SIGTERM, up to {grace:g}s for a final checkpoint")
        out = run_probe(run.executor, run.host, "stop_training", stop_args(run.host, grace),
                        timeout=grace + 120)
        run.training = out
        if out.get("unit") and not out.get("already_stopped"):
            run.stopped_units.append(out["unit"])
        run.changed["training"] = True
        if not out["stopped"]:
            raise StepFailed(f"training is still running on {run.host.name} after SIGKILL: pids {out['left']}")
        if out.get("gpu_freed") is False:
            raise StepFailed(f"training stopped on {run.host.name} but its GPU memory was not released")
        ckpt = out.get("checkpoint") or {}
        lost = (out["step_after"] - ckpt["step"]) if ckpt.get("step") is not None and out.get("step_after") is not None else None
        out["steps_lost"] = lost
        how = "gracefully (SIGTERM)" if out["graceful"] else f"with SIGKILL after {grace:g}s (ignored SIGTERM)"
        return (f"stopped {how} in {out.get('stop_s')}s at step {out.get('step_after')}; newest checkpoint "
                f"{ckpt.get('path')}; steps lost: {lost}")
