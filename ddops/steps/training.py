"""Stop training, showing first what it costs: the job's step, its newest checkpoint's and the steps a
kill would lose. A checkpoint request (signal or command) goes first when the profile names one; a
kill that would still lose more than the run's limit is refused before SIGTERM, with nothing changed."""

from __future__ import annotations

from dataclasses import asdict

from ..errors import Refused, StepFailed
from ..facts import Training
from ..inventory import Host
from ..plan import Operation, PlanContext, RunContext
from ..profile import TrainingStop
from ..remote import run_probe
from ..undo import StartAgain


def plan_training(training: Training, kill_training: bool, host: str, stop: TrainingStop = TrainingStop(),
                  accepted: float | None = None) -> list[Operation]:
    """Stop a running job. Without --kill-training only a dry run gets this far (preflight refuses a real
    run), so the plan still shows what a real run would stop, and says it needs the flag."""
    if not training.running:
        return []
    limit = stop.limit(accepted)
    lines = [f"stop training pid {training.pid}" + (f" ({training.unit})" if training.unit else "")
             + f" at step {training.last_step}" + ("" if kill_training else " (a real run needs --kill-training)"),
             f"  {training.cost()}" + (f"; this run allows {limit}" if limit is not None else "")]
    if stop.request:
        lines.append(f"  first {stop.request}, then up to {stop.checkpoint_wait_s:g}s for a newer checkpoint"
                     + (f"; still over {limit} lost then: refused before SIGTERM" if training.over(limit) else ""))
    requires = None
    if not kill_training:
        requires = f"a real run must stop training on {host}, so it needs --kill-training"
    elif training.over(limit) and not stop.request:
        requires = f"a real run would lose {lost_words(training)} on {host}, so it needs --accept-lost-steps"
    return [Operation("\n".join(lines), data={"pids": list(training.pids), "limit": limit},
                      undo=StartAgain(training.unit) if training.unit else None, requires=requires,
                      figures={"step": training.last_step, "checkpoint_step": training.checkpoint_step,
                               "checkpoint": training.checkpoint_path, "lost_steps": training.lost_steps,
                               "limit": limit, "checkpoint_request": stop.request})]


def lost_words(training: Training) -> str:
    return f"{training.lost_steps} step(s)" if training.lost_steps is not None else "an unknown number of steps"


def stop_args(host: Host, grace_s: float, stop: TrainingStop = TrainingStop(), limit: int | None = None) -> dict:
    """The stop_training action's arguments (pinned by the unit tests)."""
    spec = asdict(host.training)
    spec.update(grace_s=grace_s, limit=limit, checkpoint_signal=stop.checkpoint_signal,
                checkpoint_command=list(stop.checkpoint_command), checkpoint_wait_s=stop.checkpoint_wait_s)
    return spec


def refusal(out: dict, host: str) -> str:
    """The one line for a kill the action refused: what it would lose, against what limit, what was tried."""
    lost = out.get("lost_at_kill")
    ckpt = out.get("checkpoint") or {}
    request = out.get("request") or {}
    tried = (f"{request['sent']} got no newer checkpoint within {request['waited_s']:g}s"
             if request.get("sent") and not request.get("new_checkpoint") else "")
    return (f"stopping training on {host} would lose {lost if lost is not None else 'an unknown number of'} step(s) "
            f"(step {out.get('step_now')}, newest checkpoint step {ckpt.get('step')}), more than the {out['limit']} "
            f"this run allows" + (f"; {tried}" if tried else ""))


class TrainingStep:
    name = "training"
    title = "Stop training"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        return plan_training(ctx.facts.host.training, ctx.kill_training, ctx.profile.host,
                             ctx.profile.training_stop, ctx.accept_lost_steps)

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        grace, stop = ctx.profile.training_grace_s, ctx.profile.training_stop
        limit = operations[0].data.get("limit")
        if stop.request:
            ctx.progress(f"{stop.request}, up to {stop.checkpoint_wait_s:g}s for a newer checkpoint")
        else:
            ctx.progress(f"SIGTERM, up to {grace:g}s for a final checkpoint")
        out = run_probe(ctx.executor, ctx.host, "stop_training", stop_args(ctx.host, grace, stop, limit),
                        timeout=grace + stop.checkpoint_wait_s + 180, progress=ctx.progress)
        journal = ctx.journal
        journal.training = out
        if out.get("refused"):
            raise Refused(refusal(out, ctx.host.name),
                             fix=f"nothing was changed: training still runs; pass --accept-lost-steps "
                                 f"{out.get('lost_at_kill') if out.get('lost_at_kill') is not None else 'all'} "
                                 "to accept the loss, or wait for its next checkpoint")
        stopped_unit = out.get("unit") if not out.get("already_stopped") else None
        if stopped_unit:
            journal.stopped_units.append(stopped_unit)
        journal.change(self.name, undo=StartAgain(stopped_unit) if stopped_unit else None)
        if not out["stopped"]:
            raise StepFailed(f"training is still running on {ctx.host.name} after SIGKILL: pids {out['left']}")
        if out.get("gpu_freed") is False:
            raise StepFailed(f"training stopped on {ctx.host.name} but its GPU memory was not released")
        ckpt = out.get("checkpoint") or {}
        lost = (out["step_after"] - ckpt["step"]) if ckpt.get("step") is not None and out.get("step_after") is not None else None
        out["steps_lost"] = lost
        how = "gracefully (SIGTERM)" if out["graceful"] else f"with SIGKILL after {grace:g}s (ignored SIGTERM)"
        asked = ""
        if (out.get("request") or {}).get("sent"):
            request = out["request"]
            asked = (f"{request['sent']}: newer checkpoint after {request['waited_s']:g}s; " if request["new_checkpoint"]
                     else f"{request['sent']}: no newer checkpoint within {request['waited_s']:g}s; ")
        return (f"{asked}stopped {how} in {out.get('stop_s')}s at step {out.get('step_after')}; newest checkpoint "
                f"{ckpt.get('path')}; steps lost: {lost}")
