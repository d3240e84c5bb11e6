"""Run every benchmark (``bench/bench_*.py``) and write ``bench/results/report.md``.

python -m bench                 # all
python -m bench core stream     # only bench_core.py and bench_stream.py
"""

from __future__ import annotations

import datetime
import importlib
import os
import pkgutil
import platform
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def _update_readme(report: str) -> None:
    """Replace the README's benchmark section (between its two markers) with ``report``."""
    path = os.path.join(os.path.dirname(HERE), "README.md")
    start, end = "<!-- bench-table -->", "<!-- /bench-table -->"
    with open(path) as f:
        text = f.read()
    a, b = text.index(start) + len(start), text.index(end)
    body = report.replace("# areal_stream benchmarks", "Latest `./dev bench` run:", 1)
    body = body.replace("\n### ", "\n#### ").replace("\n## ", "\n### ")
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + body.strip() + "\n" + text[b:])


def main(argv: list[str]) -> int:
    readme = "--readme" in argv
    argv = [a for a in argv if a != "--readme"]
    names = sorted(
        m.name[len("bench_") :] for m in pkgutil.iter_modules([HERE]) if m.name.startswith("bench_")
    )
    chosen = [n for n in names if not argv or n in argv]
    unknown = [a for a in argv if a not in names]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; known: {names}", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"# areal_stream benchmarks\n\n{now}; {_machine()}\n"]
    failed = []
    for name in chosen:
        t0 = time.perf_counter()
        print(f"== bench_{name}", flush=True)
        try:
            section = importlib.import_module(f"bench.bench_{name}").run()
        except Exception:
            traceback.print_exc()
            failed.append(name)
            section = f"## {name}\n\nFAILED (see the console output)\n"
        parts.append(section.rstrip() + f"\n\n_(bench_{name}: {time.perf_counter() - t0:.0f} s)_\n")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    out = os.path.join(HERE, "results", "report.md")
    with open(out, "w") as f:
        f.write("\n".join(parts))
    print(f"report written to {out}")
    if readme and not failed:
        _update_readme("\n".join(parts))
        print("README.md updated")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
