"""Send a JSONL journal to logging backends after the fact.

::

    python -m areal_stream.replay <log_dir>/stats.jsonl --config other.yaml [--only wandb,trackio]
                                  [--console] [--timeout SECONDS]

Use it for a backend that was down (or dropped steps) during the run: point ``other.yaml``
at that backend and replay the journal. Every line goes to every selected backend at its
recorded ``step``, in file order, Tables rebuilt from their ``__table__`` form. The backends
are those the config enables explicitly, or the ones named in ``--only``: the embedded
TensorBoard default (no ``tensorboard`` block) is *not* used here, so a replay never writes a
second copy into the original run's TensorBoard folder; give ``tensorboard.path`` to get it.
The console is off unless ``--console``. No journal is written. A torn last line (the run
was killed while writing it: it was never fully committed) is skipped with a note on stderr.

W&B only accepts increasing steps within a run: replaying into the original run id (same
experiment, trial and ``id_suffix``) refuses every step below the run's last one (counted as
wandb errors, exit status 1), so use another ``id_suffix`` for the replayed run.

Exit status: 0 when every step reached every backend; 1 when some backend reported errors
or dropped steps (printed per backend); 2 for bad arguments, config or journal.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from areal_stream._backends import create_backends, registered_backends
from areal_stream._backends.jsonl import read_journal
from areal_stream._fanout import Fanout
from areal_stream.config import AUTO, StatsLoggerConfig, load_config

__all__ = ["main", "replay"]


def _select(config: StatsLoggerConfig, only: set[str] | None, console: bool) -> StatsLoggerConfig:
    cfg = dataclasses.replace(
        config,
        console=dataclasses.replace(config.console, enabled=console),
    )
    if config.tensorboard.path == AUTO and (only is None or "tensorboard" not in only):
        cfg = dataclasses.replace(cfg, tensorboard=dataclasses.replace(cfg.tensorboard, path=None))
    return cfg


def _report_torn(journal: str) -> Callable[[int, str], None]:
    def report(line: int, reason: str) -> None:
        print(f"replay: {journal}:{line}: {reason}", file=sys.stderr)

    return report


def replay(
    journal: str,
    config: StatsLoggerConfig,
    *,
    only: set[str] | None = None,
    console: bool = False,
    timeout: float | None = None,
) -> dict[str, tuple[int, int, int]]:
    """Replay ``journal`` to the backends ``config`` enables (see the module doc); returns
    ``{backend: (logged, errors, dropped)}``. The journal is parsed fully before anything is
    sent, so a bad line sends nothing (``ValueError`` with its line number); a torn last line
    (the run was killed while writing it) is skipped with a note on stderr."""
    records = list(read_journal(journal, on_torn_tail=_report_torn(journal)))
    cfg = _select(config, only, console)
    backends = create_backends(cfg, cfg.log_dir(), only=only)
    if only is not None:
        missing = only - {n for n, _ in backends}
        if missing:
            raise ValueError(
                f"--only names backend(s) the config does not enable: {', '.join(sorted(missing))}"
            )
    fanout = Fanout(backends, queue_size=0)  # unbounded: a replay must not drop steps
    for record in records:
        fanout.submit(record)
    fanout.close(timeout if timeout is not None else cfg.close_timeout)
    return {
        w.name: (s.logged, s.errors, s.dropped) for w in fanout.workers for s in [w.statistics()]
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal_stream.replay",
        description="Send a stats.jsonl journal to the logging backends of a config.",
    )
    parser.add_argument("journal", help="path to stats.jsonl")
    parser.add_argument("--config", required=True, help="YAML with a stats_logger block")
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated backends to use (of: {', '.join(registered_backends())})",
    )
    parser.add_argument("--console", action="store_true", help="also print each step")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per backend (default close_timeout)"
    )
    args = parser.parse_args(argv)
    only = None
    if args.only is not None:
        only = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = only - set(registered_backends())
        if unknown:
            parser.error(f"unknown backend(s) in --only: {', '.join(sorted(unknown))}")
    try:
        config = load_config(args.config)
        result = replay(args.journal, config, only=only, console=args.console, timeout=args.timeout)
    except (ValueError, TypeError, OSError) as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    if not result:
        print("replay: the config enables no backend (see --only / the config)", file=sys.stderr)
        return 2
    ok = True
    for name, (logged, errors, dropped) in result.items():
        print(f"{name}: logged {logged}, errors {errors}, dropped {dropped}")
        ok = ok and errors == 0 and dropped == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
