"""Stop training: SIGTERM, a grace period to checkpoint, SIGKILL only if it must; verified."""

from __future__ import annotations

from dataclasses import asdict

from ..errors import StepFailed
from ..facts import Training
from ..inventory import Host
from ..plan import Operation, PlanContext, RunContext, start_again
from ..remote import run_probe


def plan_training(training: Training, kill_training: bool, host: str) -> list[Operation]:
    """Stop a running job. Without --kill-training only a dry run gets this far (preflight refuses a real
    run), so the plan still shows what a real run would stop, and says it needs the flag."""
    if not training.running:
        return []
    return [Operation(f"stop training pid {training.pid}" + (f" ({training.unit})" if training.unit else "")
                      + f" at step {training.last_step}"
                      + ("" if kill_training else " (a real run needs --kill-training)"),
                      data={"pids": list(training.pids)}, undo=start_again(training.unit) if training.unit else None,
                      requires=None if kill_training else f"a real run must stop training on {host}, so it needs "
                                                          "--kill-training")]


def stop_args(host: Host, grace_s: float) -> dict:
    spec = asdict(host.training)
    spec["grace_s"] = grace_s
    return spec


class TrainingStep:
    name = "training"
    title = "Stop training"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        return plan_training(ctx.facts.host.training, ctx.kill_training, ctx.profile.host)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        grace = ctx.profile.training_grace_s
        ctx.progress(f"SIGTERM, up to {grace:g}s for a final checkpoint")
        out = run_probe(ctx.executor, ctx.host, "stop_training", stop_args(ctx.host, grace), timeout=grace + 120)
        journal = ctx.journal
        journal.training = out
        stopped_unit = out.get("unit") if not out.get("already_stopped") else None
        if stopped_unit:
            journal.stopped_units.append(stopped_unit)
        journal.change(self.name, undo=start_again(stopped_unit) if stopped_unit else None)
        if not out["stopped"]:
            raise StepFailed(f"training is still running on {ctx.host.name} after SIGKILL: pids {out['left']}")
        if out.get("gpu_freed") is False:
            raise StepFailed(f"training stopped on {ctx.host.name} but its GPU memory was not released")
        ckpt = out.get("checkpoint") or {}
        lost = (out["step_after"] - ckpt["step"]) if ckpt.get("step") is not None and out.get("step_after") is not None else None
        out["steps_lost"] = lost
        how = "gracefully (SIGTERM)" if out["graceful"] else f"with SIGKILL after {grace:g}s (ignored SIGTERM)"
        return (f"stopped {how} in {out.get('stop_s')}s at step {out.get('step_after')}; newest checkpoint "
                f"{ckpt.get('path')}; steps lost: {lost}")
