"""A rollout-only run (no trainer): the controller closes a window every ``--commit-every``.

Starts the controller with ``--commit-every`` and several rollout worker processes
(``examples/rollout_worker.py``); prints the committed windows. Windows before the workers
are up, and after they said bye, are empty but still committed (with ``bus/`` counters).

    python examples/rollout_only.py --workers 3 --seconds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import areal_stream  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_stream.controller import ControllerProcess, child_env

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--commit-every", type=float, default=0.5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "run.yaml"
        cfg.write_text(
            "stats_logger:\n  experiment_name: example\n  trial_name: rollout_only\n"
            f"  fileroot: {tmp}\n  tensorboard: {{path: null}}\n  console: {{enabled: false}}\n"
        )
        with ControllerProcess(str(cfg), commit_every=args.commit_every) as ctrl:
            procs = []
            try:
                for i in range(args.workers):
                    procs.append(subprocess.Popen(
                        [sys.executable, str(HERE / "rollout_worker.py"), "--data", ctrl.data,
                         "--control", ctrl.control, "--worker-id", f"rollout-{i}",
                         "--seconds", str(args.seconds), "--flows", "16", "--seed", str(i)],
                        env=child_env(),
                    ))  # fmt: skip
                for proc in procs:
                    if proc.wait(args.seconds + 120) != 0:
                        raise SystemExit(f"a rollout worker exited with {proc.returncode}")
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(10)
        for line in next(Path(tmp).glob("logs/*/*/*/stats.jsonl")).read_text().splitlines():
            rec = json.loads(line)
            s = rec["stats"]
            print(
                f"window {rec['global_step']}: reward {s.get('rollout/reward', float('nan')):.3f} "
                f"seq_len {s.get('rollout/seq_len', float('nan')):.1f} "
                f"workers {s['bus/expected_workers']} events {s['bus/events']}"
            )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the with/finally blocks above stopped the children
        sys.exit(130)
