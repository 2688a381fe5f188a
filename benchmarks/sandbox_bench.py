"""The code verifier's seconds per sample (`reward.kind: code`), for `rlhf simulate --reward-seconds`.

    python -m benchmarks.sandbox_bench                     # 64 samples, processes 1 and 2
    python -m benchmarks.sandbox_bench --samples 128 --processes 1 2 4
    python -m benchmarks.sandbox_bench --cases 20           # stdin/stdout samples of 20 cases (CodeContests-like)
    python -m benchmarks.sandbox_bench --start fork         # only the default start (a fork of a warm interpreter)
    python -m benchmarks.sandbox_bench --language cpp       # C++ programs: a compile, then a run per case
    python -m benchmarks.sandbox_bench --hostile            # the hostile battery in the box: every attack fails

Each sample is a short program scored in the sandbox (`rlhf.data.sandbox.check_batch`): half assert-style (a
function and three asserts, one run), half stdin/stdout (`--cases` cases, 3 by default, a run each); a quarter of
the programs are wrong. `--language cpp`: every sample a C++ stdin/stdout program (```cpp, compiled with the
default `reward.sandbox.cpp_command`), a quarter wrong. Every configuration is timed `--rounds` times, interleaved;
the median wall-clock seconds over the samples is the seconds per sample a reward worker with that many `processes`
spends. Both ways to start a sample's process are timed side by side (`--start`): `fork` (a fork of a warm
interpreter, `reward.sandbox.fork_server: true`, the default) and `fresh` (a new interpreter per sample), each in
the box and without it (`--isolation`: `kernel`, the default, and `process`). Ends with one JSON line
(`seconds_per_sample` per isolation, start and processes setting, `fork_speedup` per processes setting, `box_cost`:
the box's seconds over the same without it, and the runs per sample).

`--hostile` runs rlhf/data/sandbox_hostile.py's battery (Python, and C++ where g++ is installed) in the box instead:
one line per attack with its verdict, then a JSON line (`worked`: attacks that got what they came for, which must
be none; the loopback listener's connections; processes left behind).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

ASSERT_OK = "```python\ndef add(a, b):\n    return a + b\n```"
ASSERT_BAD = "def add(a, b):\n    return a - b\n"
ASSERT_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15"
STDIO_OK = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"
STDIO_BAD = "print(0)\n"
CPP_OK = '```cpp\n#include <{}>\nint main() {{ long a, b; scanf("%ld %ld", &a, &b); printf("%ld\\n", a + b); }}\n```'
CPP_BAD = '```cpp\n#include <{}>\nint main() {{ printf("0\\n"); }}\n```'


def stdio_tests(cases: int) -> str:
    pairs = [(i * 7 - 20, 3 - i) for i in range(cases)]
    return json.dumps({"inputs": [f"{a} {b}\n" for a, b in pairs], "outputs": [str(a + b) for a, b in pairs]})


def samples(n: int, cases: int = 3, language: str = "python", include: str = "cstdio") -> tuple[list[str], list[str], int]:
    """n (response, tests) pairs and the program runs they take (a wrong stdio program stops at its first case)."""
    responses, answers, runs = [], [], 0
    tests = stdio_tests(cases)
    for i in range(n):
        wrong = i % 4 == 3
        if language == "cpp":
            responses.append((CPP_BAD if wrong else CPP_OK).format(include))
            answers.append(tests)
            runs += 1 if wrong else cases
        elif i % 2 == 0:
            responses.append(ASSERT_BAD if wrong else ASSERT_OK)
            answers.append(ASSERT_TESTS)
            runs += 1
        else:
            responses.append(STDIO_BAD if wrong else STDIO_OK)
            answers.append(tests)
            runs += 1 if wrong else cases
    return responses, answers, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sandbox_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--cases", type=int, default=3, help="stdin/stdout cases of each such sample")
    parser.add_argument("--start", choices=["fork", "fresh"], nargs="+", default=["fork", "fresh"],
                        help="how each sample's process starts: fork (reward.sandbox.fork_server: true) or fresh")
    parser.add_argument("--language", choices=["python", "cpp"], default="python",
                        help="cpp: C++ stdin/stdout programs, each compiled (g++) before its cases run")
    parser.add_argument("--isolation", choices=["kernel", "process"], nargs="+", default=["kernel", "process"],
                        help="reward.sandbox.isolation: kernel (the box) and process, side by side")
    parser.add_argument("--hostile", action="store_true", help="run the hostile battery in the box and report it")
    parser.add_argument("--cpp-include", default="cstdio",
                        help="the header the C++ programs include (bits/stdc++.h, as contest solutions do, compiles "
                             "far slower)")
    args = parser.parse_args(argv)
    if args.samples < 4 or args.rounds < 1 or min(args.processes) < 1 or args.cases < 1:
        parser.error("--samples >= 4, --rounds >= 1, --cases >= 1 and every --processes >= 1")

    from rlhf.data.sandbox import check_batch
    from rlhf.data.sandbox_exec import close_all
    from rlhf.schema import SandboxConfig, SandboxIsolation

    if args.hostile:
        return hostile(args.timeout_s)

    responses, answers, runs = samples(args.samples, args.cases, args.language, args.cpp_include)
    expected = [0.0 if i % 4 == 3 else 1.0 for i in range(args.samples)]
    # C++: with the precompiled header (the default) and without it, side by side
    headers = {"pch": SandboxConfig.cpp_precompiled_header, "plain": ""} if args.language == "cpp" else {"": ""}
    setups = [(iso, start, p, h) for iso in args.isolation for start in args.start for p in args.processes
              for h in headers]
    name = {k: "/".join(str(x) for x in k if x != "") for k in setups}
    times: dict[tuple, list[float]] = {k: [] for k in setups}
    extra = {}
    try:
        if args.language == "cpp":  # built once per worker process, before the first C++ sample: timed apart
            t0 = time.perf_counter()
            check_batch(responses[:1], answers[:1], SandboxConfig(processes=1, isolation=SandboxIsolation.process))
            extra["pch_build_and_first_sample_seconds"] = round(time.perf_counter() - t0, 3)
        for _ in range(args.rounds):
            for iso, start, p, h in setups:
                cfg = SandboxConfig(timeout_s=args.timeout_s, processes=p, fork_server=start == "fork",
                                    cpp_precompiled_header=headers[h], isolation=SandboxIsolation(iso))
                t0 = time.perf_counter()
                scores = [r.score for r in check_batch(responses, answers, cfg)]
                times[iso, start, p, h].append(time.perf_counter() - t0)
                if scores != expected:
                    raise SystemExit(f"{name[iso, start, p, h]}: scores {scores} differ from the expected {expected}")
    finally:
        close_all()  # the warm interpreters
    per_sample = {name[k]: round(statistics.median(t) / args.samples, 4) for k, t in times.items()}
    for k, t in times.items():
        print(f"{name[k]}: {', '.join(f'{s:.2f}' for s in t)} s for {args.samples} samples "
              f"({per_sample[name[k]] * 1000:.1f} ms a sample)", flush=True)
    h = "/pch" if args.language == "cpp" else ""
    iso = args.isolation[0]
    speedup = {str(p): round(per_sample[f"{iso}/fresh/{p}{h}"] / per_sample[f"{iso}/fork/{p}{h}"], 2)
               for p in args.processes if len(args.start) == 2}
    if len(args.isolation) == 2:
        extra["box_cost"] = {f"{start}/{p}{hh}": round(per_sample[f"kernel/{start}/{p}{hh}"]
                                                        / per_sample[f"process/{start}/{p}{hh}"], 2)
                             for start in args.start for p in args.processes for hh in ({h} | {""} if h else {""})
                             if f"kernel/{start}/{p}{hh}" in per_sample}
    if args.language == "cpp":
        extra["pch_speedup"] = {f"{i}/{start}/{p}": round(per_sample[f"{i}/{start}/{p}/plain"]
                                                          / per_sample[f"{i}/{start}/{p}/pch"], 2)
                                for i in args.isolation for start in args.start for p in args.processes}
    print(json.dumps({"language": args.language, **({"cpp_include": args.cpp_include} if args.language == "cpp" else {}),
                      "samples": args.samples, "cases": args.cases, "runs_per_sample": round(runs / args.samples, 2),
                      "seconds_per_sample": per_sample, "fork_speedup": speedup, **extra,
                      "seconds_all": {name[k]: [round(s, 3) for s in t] for k, t in times.items()}}))
    return 0


def hostile(timeout_s: float) -> int:
    """The hostile battery in the box; 1 when an attack got what it came for."""
    import os
    import shutil
    import socket
    import subprocess
    import tempfile
    import threading
    import uuid
    from pathlib import Path

    from rlhf.data.sandbox import check_batch
    from rlhf.data.sandbox_box import box_problem
    from rlhf.data.sandbox_exec import close_all
    from rlhf.data.sandbox_hostile import Setup, attacks, left_behind, response
    from rlhf.schema import SandboxConfig

    problem = box_problem()
    if problem:
        raise SystemExit(f"no box on this machine: {problem}")
    marker = uuid.uuid4().hex[:8]
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()[0].close()) for _ in iter(int, 1)],
                     daemon=True).start()
    holder = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ["PATH"], "SECRET": "env-" + marker})
    with tempfile.TemporaryDirectory() as d:
        files = {k: (str(Path(d, k)), f"{k}-{marker}") for k in ("ray_token", "weights", "home")}
        for path, text in files.values():
            Path(path).write_text(text)
        battery = [a for a in attacks(Setup(files, holder.pid, "env-" + marker, listener.getsockname()[1], os.getpid(),
                                            marker)) if a.language == "python" or shutil.which("g++")]
        try:
            results = check_batch([response(a) for a in battery], [a.tests for a in battery],
                                  SandboxConfig(timeout_s=timeout_s, max_output_kb=256))
        finally:
            close_all()
            holder.kill()
            listener.close()
    time.sleep(1.0)
    left = left_behind(marker)
    worked = [a.name for a, r in zip(battery, results) if r.score != 0.0 and not a.leaves_processes]
    for a, r in zip(battery, results):
        print(f"{a.name:<48} {r.status:<8} {r.detail.replace(chr(10), ' ')[-90:]}", flush=True)
    print(json.dumps({"attacks": len(battery), "worked": worked, "verdicts": {a.name: r.status for a, r in
                                                                             zip(battery, results)},
                      "listener_connections": len(accepted), "processes_left": len(left)}))
    return 1 if worked or accepted or left else 0


if __name__ == "__main__":
    raise SystemExit(main())
