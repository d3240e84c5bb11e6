"""``python -m areal_stream.demo``: a complete local async RLVR run, start to finish.

Starts the controller, the rollout workers and 2 gloo training ranks as child processes,
shows each committed step, and stops every child on exit or Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import yaml

from areal_stream.controller import ControllerProcess, child_env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m areal_stream.demo",
        description="Run a simulated asynchronous RLVR job with real areal_stream parts.",
    )
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--workers", type=int, default=3, help="rollout worker processes (default 3)")
    p.add_argument(
        "--workflows-per-worker", type=int, default=32, help="concurrent workflows (default 32)"
    )
    p.add_argument("--fileroot", default="runs", help="where logs go (default ./runs)")
    p.add_argument("--experiment-name", default="areal_stream_demo")
    p.add_argument("--trial-name", default=None, help="default: a timestamp")
    p.add_argument("--wandb", action="store_true", help="also log to W&B (offline)")
    p.add_argument("--swanlab", action="store_true", help="also log to SwanLab (offline)")
    p.add_argument("--trackio", action="store_true", help="also log to Trackio (local)")
    p.add_argument("--no-tensorboard", action="store_true", help="skip TensorBoard")
    p.add_argument(
        "--eval-before-train",
        action="store_true",
        help="one evaluation round before the first step (its metrics arrive with step 0)",
    )
    p.add_argument("--step-seconds", type=float, default=0.5, help="fake PPO step time")
    p.add_argument(
        "--eval-fraction", type=float, default=0.1, help="share of workflows run in eval mode"
    )
    p.add_argument("--seal-timeout", type=float, default=5.0)
    p.add_argument(
        "--full-table",
        action="store_true",
        help="also print every key of every step (the controller's console table)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "workers", "workflows_per_worker"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.step_seconds < 0:
        p.error("--step-seconds must be at least 0")
    if not 0.0 <= args.eval_fraction <= 1.0:
        p.error("--eval-fraction must be between 0 and 1")
    if args.seal_timeout <= 0:
        p.error("--seal-timeout must be positive")
    if os.path.exists(args.fileroot) and not os.path.isdir(args.fileroot):
        p.error(f"--fileroot {args.fileroot!r} exists and is not a directory")
    return args


def write_config(args: argparse.Namespace, trial: str, path: str) -> dict[str, Any]:
    """The spec's ``stats_logger:`` block for this run."""
    fileroot = os.path.abspath(args.fileroot)
    block: dict[str, Any] = {
        "experiment_name": args.experiment_name,
        "trial_name": trial,
        "fileroot": fileroot,
        "wandb": {"mode": "offline" if args.wandb else "disabled", "project": "areal_stream"},
        "swanlab": {"mode": "offline" if args.swanlab else "disabled", "project": "areal_stream"},
        "trackio": {"mode": "local" if args.trackio else "disabled", "project": "areal_stream"},
        "console": {"enabled": bool(args.full_table)},
    }
    if args.no_tensorboard:
        block["tensorboard"] = {"path": None}
    with open(path, "w") as f:
        yaml.safe_dump({"stats_logger": block}, f, sort_keys=False)
    return block


class Children:
    """Child processes that are always stopped: SIGTERM, a grace period, then SIGKILL.

    Each child runs in its own session (as the controller does), so a Ctrl-C in the
    terminal reaches only the demo, which then stops them in order (trainers, workers,
    controller): the workers' goodbyes still reach a live controller, which commits what it
    holds.
    """

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, start_new_session=True, env=child_env(), **kw)
        self.procs.append((name, proc))
        return proc

    def names(self, prefix: str) -> list[str]:
        return [n for n, _ in self.procs if n.startswith(prefix)]

    def stop(self, names: Sequence[str] | None = None, grace: float = 10.0) -> None:
        chosen = [(n, p) for n, p in self.procs if names is None or n in names]
        for _, p in chosen:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name, p in chosen:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"[demo] {name} did not stop in {grace:.0f}s; killing it", file=sys.stderr)
                p.kill()
                p.wait(timeout=10)


def _wait_for_file(
    path: str, what: str, procs: list[subprocess.Popen[bytes]], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early with code {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f}s")
        time.sleep(0.05)


def _read_journal(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    if not os.path.exists(path):
        return [], offset
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    lines = text.split("\n")
    complete, rest = lines[:-1], lines[-1]
    return [json.loads(line) for line in complete if line], offset + len(text) - len(rest)


COLUMNS = (
    ("reward", "rollout/reward", "{:.3f}"),
    ("eval", "eval-rollout/reward", "{:.3f}"),
    ("loss", "ppo_actor/update/loss/avg", "{:+.4f}"),
    ("kl_k3", "ppo_actor/train_infer/kl_k3", "{:.2e}"),
    ("stale", "ppo_actor/update/version_stats/stale_token_fraction", "{:.2f}"),
    ("tok/s", "train_perf/tokens_per_second", "{:,.0f}"),
    ("TFLOP/s", "train_perf/estimated_flops_per_second", "{:.1f}"),
    ("moe max/ideal", "moe_balance/layer_3/max_over_ideal", "{:.2f}"),
    ("events", "bus/window_events", "{:,.0f}"),
    ("missing", "bus/missing_workers", "{:.0f}"),
)


def _table_header() -> str:
    return " ".join(["  step", "    time"] + [f"{name:>{_width(name)}}" for name, _, _ in COLUMNS])


def _width(name: str) -> int:
    return max(8, len(name))


def _table_row(row: dict[str, Any], t0: float) -> str:
    """One line per committed step: the demo's progress and its per-step table."""
    s = row["stats"]
    cells = [f"{row['global_step']:>6}", f"{time.monotonic() - t0:7.1f}s"]
    for name, key, fmt in COLUMNS:
        v = s.get(key)
        if isinstance(v, (int, float)) and key == "train_perf/estimated_flops_per_second":
            v = v / 1e12
        text = fmt.format(v) if isinstance(v, (int, float)) else "-"
        cells.append(f"{text:>{_width(name)}}")
    return " ".join(cells)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _tool(name: str) -> str:
    """How to call a console script installed next to this Python (e.g. ``.venv/bin``)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        return name
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def run(args: argparse.Namespace) -> int:
    trial = args.trial_name or datetime.datetime.now().strftime("trial_%Y%m%d_%H%M%S")
    log_dir = os.path.join(
        os.path.abspath(args.fileroot), "logs", getpass.getuser(), args.experiment_name, trial
    )
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cannot create the log directory {log_dir}: {e.strerror}") from e
    config_path = os.path.join(log_dir, "run.yaml")
    write_config(args, trial, config_path)
    journal = os.path.join(log_dir, "stats.jsonl")
    if args.trackio:  # keep Trackio's database with the run's other logs
        os.environ.setdefault("TRACKIO_DIR", os.path.join(log_dir, "trackio"))
    py = sys.executable
    children = Children()
    ctrl = ControllerProcess(
        config_path, seal_timeout=args.seal_timeout, extra_args=("--log-level", "WARNING")
    )
    t0 = time.monotonic()
    # Closing the terminal or `kill <demo pid>` stops the children too, as Ctrl-C does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    with tempfile.TemporaryDirectory(prefix="areal_stream_demo_") as tmp:
        try:
            ctrl.start()
            controller = ctrl.proc
            addr = {"data": ctrl.data, "control": ctrl.control}
            print(f"[demo] controller listening on {addr['data']} (control {addr['control']})")
            worker_ready = []
            for i in range(args.workers):
                argv = [
                    py,
                    "-m",
                    "areal_stream.demo._worker",
                    "--data",
                    addr["data"],
                    "--control",
                    addr["control"],
                    "--worker-id",
                    f"rollout-{i}",
                    "--workflows",
                    str(args.workflows_per_worker),
                    "--seed",
                    str(i),
                    "--eval-fraction",
                    str(args.eval_fraction),
                ]
                path = os.path.join(tmp, f"worker{i}.ready")
                argv += ["--ready-file", path]
                if args.eval_before_train:
                    argv.append("--eval-before-train")
                worker_ready.append((path, children.start(f"rollout-{i}", argv)))
            for path, proc in worker_ready:
                _wait_for_file(path, "rollout worker", [proc, controller], 60)
            print(
                f"[demo] {args.workers} rollout workers x {args.workflows_per_worker} workflows"
                + (" (evaluation round done)" if args.eval_before_train else "")
            )

            store = os.path.join(tmp, "gloo_store")
            trainers = [
                children.start(
                    f"trainer-{r}",
                    [
                        py,
                        "-m",
                        "areal_stream.demo._trainer",
                        "--rank",
                        str(r),
                        "--world",
                        "2",
                        "--store",
                        store,
                        "--data",
                        addr["data"],
                        "--steps",
                        str(args.steps),
                        "--step-seconds",
                        str(args.step_seconds),
                    ],
                )
                for r in range(2)
            ]
            print(f"[demo] 2 training ranks (gloo) running {args.steps} steps\n")
            print(_table_header())

            offset, committed = 0, 0
            deadline = time.monotonic() + 120 + args.steps * (args.step_seconds + 5)
            while committed < args.steps:
                rows, offset = _read_journal(journal, offset)
                for row in rows:
                    committed += 1
                    print(_table_row(row, t0), flush=True)
                failed = [p.returncode for p in trainers if p.poll() not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a training rank failed with code {failed[0]}")
                if controller.poll() is not None:
                    raise RuntimeError(f"the controller exited with code {controller.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {committed}/{args.steps} steps committed in time")
                time.sleep(0.1)
            for p in trainers:
                p.wait(timeout=60)
            children.stop(children.names("rollout-"))
            if ctrl.stop(timeout=60) != 0:
                raise RuntimeError(f"the controller exited with code {controller.returncode}")
            rows, offset = _read_journal(journal, offset)
            for row in rows:
                print(_table_row(row, t0) + "  (rollout data after the last step)")
        except KeyboardInterrupt:
            print("\n[demo] interrupted: stopping every process", file=sys.stderr)
            _stop_all(children, ctrl)
            print(f"[demo] stopped. Logs so far: {log_dir}", file=sys.stderr)
            return 130
        finally:
            _stop_all(children, ctrl)
    print(f"\n[demo] done in {time.monotonic() - t0:.1f}s. Logs: {log_dir}")
    print(f"  journal:     {journal}")
    if not args.no_tensorboard:
        print(f"  TensorBoard: {_tool('tensorboard')} --logdir {log_dir}")
    if args.wandb:
        offline = os.path.join(log_dir, "wandb", "offline-run-*")
        print(f"  W&B offline: {_tool('wandb')} sync {offline}")
    if args.swanlab:
        for run_dir in sorted(glob.glob(os.path.join(log_dir, "run-*"))):
            print(f"  SwanLab:     {_tool('swanlab')} sync {run_dir}")
    if args.trackio:
        tdir = os.environ["TRACKIO_DIR"]
        print(f"  Trackio:     TRACKIO_DIR={tdir} {_tool('trackio')} show --project areal_stream")
    return 0


def _stop_all(children: Children, ctrl: ControllerProcess) -> None:
    """Trainers first, then the workers (their goodbyes reach the controller), then it."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # another Ctrl-C waits
        signal.signal(sig, signal.SIG_IGN)
    children.stop(children.names("trainer-"), grace=15)
    children.stop(children.names("rollout-"), grace=15)
    ctrl.stop(timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, TimeoutError) as e:
        print(f"[demo] failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
