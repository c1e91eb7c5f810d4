#!/usr/bin/python3
"""Lab imitation of the DFlash drafter training job.

Logs `step N loss X` every --step-seconds, writes step_N.ckpt every --ckpt-every steps,
holds memory on every lab GPU while alive, resumes from the newest checkpoint, writes step_N.ckpt
at once on its checkpoint signal (--checkpoint-signal, SIGUSR1) and keeps training, and on SIGTERM
writes step_N-final.ckpt and exits 0. For fault tests: --ignore-sigterm logs SIGTERM and keeps
training; --ignore-checkpoint-signal logs the checkpoint signal and writes nothing; --no-final-checkpoint
exits on SIGTERM without a checkpoint (a trainer that saves only every N steps); --stall-at-step N
stops advancing at step N, alive, as a job waiting on a stalled data loader (so a test can read a
step that holds still). Each flag has a DFLASH_* environment twin (see main()).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, "/usr/lib/python3/dist-packages")
try:
    import ddops_lab_gpu
except ImportError:  # run outside a lab host
    ddops_lab_gpu = None

_CKPT = re.compile(r"^step_(\d+)(-final)?\.ckpt$")


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ckpt_dir = Path(args.checkpoints)
        self.log_file = open(args.log, "a", buffering=1)
        self.step = self.resume_step()
        self.rng = random.Random(self.step)
        self.stop_requested = False
        self.checkpoint_requested = False

    def log(self, message: str) -> None:
        print(message, flush=True)
        self.log_file.write(message + "\n")

    def resume_step(self) -> int:
        steps = [int(m.group(1)) for p in self.ckpt_dir.glob("step_*.ckpt")
                 if (m := _CKPT.match(p.name))]
        return max(steps, default=0)

    def loss(self) -> float:
        base = 0.35 + 2.9 * math.exp(-self.step / 150.0)
        return max(0.05, base + self.rng.gauss(0.0, 0.04))

    def checkpoint(self, final: bool = False) -> Path:
        name = f"step_{self.step}{'-final' if final else ''}.ckpt"
        path = self.ckpt_dir / name
        tmp = self.ckpt_dir / f".{name}.tmp"
        meta = {"step": self.step, "final": final, "time": time.time(), "model": "dflash-drafter",
                "loss": round(self.last_loss, 4)}
        with open(tmp, "w") as fh:
            fh.write(json.dumps(meta) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.log(f"checkpoint saved {path}")
        return path

    def on_checkpoint_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.args.ignore_checkpoint_signal:
            self.log(f"received {name}, ignoring it (--ignore-checkpoint-signal)")
            return
        self.log(f"received {name}: checkpoint requested at step {self.step}")
        self.checkpoint_requested = True   # written by the loop, between steps, never inside one

    def on_sigterm(self, signum, frame) -> None:
        if self.args.ignore_sigterm:
            self.log("received SIGTERM, ignoring it (--ignore-sigterm)")
            return
        self.stop_requested = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_sigterm)
        signal.signal(signal.SIGINT, self.on_sigterm)
        self.last_loss = self.loss()
        if self.args.checkpoint_signal != "none":
            signal.signal(getattr(signal, self.args.checkpoint_signal), self.on_checkpoint_signal)
        if ddops_lab_gpu is not None:
            try:
                count = int(ddops_lab_gpu.load_config()["count"])
                ddops_lab_gpu.hold(list(range(count)), self.args.gpu_mib)
            except (OSError, KeyError, ValueError) as err:
                self.log(f"warning: could not register GPU memory: {err}")
        self.log(f"training started pid {os.getpid()} at step {self.step}")
        while not self.stop_requested:
            deadline = time.monotonic() + self.args.step_seconds
            while not (self.stop_requested or self.checkpoint_requested) and (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 0.05))
            if self.stop_requested:
                break
            if self.checkpoint_requested:
                self.checkpoint_requested = False
                self.checkpoint()
                continue  # the step it interrupted starts again
            if self.args.stall_at_step and self.step >= self.args.stall_at_step:
                continue  # stalled: alive and answering signals, no step taken
            self.step += 1
            self.last_loss = self.loss()
            self.log(f"step {self.step} loss {self.last_loss:.4f}")
            if self.step % self.args.ckpt_every == 0:
                self.checkpoint()
            if self.args.max_steps and self.step >= self.args.max_steps:
                self.log("reached max steps")
                break
        if self.stop_requested and self.args.final_checkpoint:
            self.log(f"received SIGTERM at step {self.step}, saving final checkpoint")
            self.checkpoint(final=True)
        elif self.stop_requested:
            self.log(f"received SIGTERM at step {self.step}, exiting without a checkpoint (--no-final-checkpoint)")
        if ddops_lab_gpu is not None:
            ddops_lab_gpu.release()
        self.log("training exited cleanly")
        return 0


def main() -> int:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-seconds", type=float, default=float(env("DFLASH_STEP_SECONDS", "0.5")))
    parser.add_argument("--ckpt-every", type=int, default=int(env("DFLASH_CKPT_EVERY", "10")))
    parser.add_argument("--max-steps", type=int, default=int(env("DFLASH_MAX_STEPS", "0")))
    parser.add_argument("--gpu-mib", type=int, default=int(env("DFLASH_GPU_MIB", "71680")))
    parser.add_argument("--log", default=env("DFLASH_LOG", "/root/train/train.log"))
    parser.add_argument("--checkpoints", default=env("DFLASH_CHECKPOINTS", "/root/train/checkpoints"))
    parser.add_argument("--ignore-sigterm", action="store_true",
                        default=env("DFLASH_IGNORE_SIGTERM", "") not in ("", "0"))
    parser.add_argument("--checkpoint-signal", choices=("SIGUSR1", "SIGUSR2", "SIGHUP", "none"),
                        default=env("DFLASH_CHECKPOINT_SIGNAL", "SIGUSR1"))
    parser.add_argument("--ignore-checkpoint-signal", action="store_true",
                        default=env("DFLASH_IGNORE_CHECKPOINT_SIGNAL", "") not in ("", "0"))
    parser.add_argument("--no-final-checkpoint", dest="final_checkpoint", action="store_false",
                        default=env("DFLASH_FINAL_CHECKPOINT", "1") not in ("", "0"))
    parser.add_argument("--stall-at-step", type=int, default=int(env("DFLASH_STALL_AT_STEP", "0")))
    args = parser.parse_args()
    Path(args.checkpoints).mkdir(parents=True, exist_ok=True)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    return Trainer(args).run()


if __name__ == "__main__":
    sys.exit(main())
