"""Run the given pytest selection once per CPU kernel family and thread count (`make test-kernels`).

Which float32 summation order a matmul, a reduction or an exp uses depends on the ATen kernel family
(default = scalar/auto-vectorised, AVX2, AVX-512) and on how many threads split the work. A tolerance
that is really derived holds for all of them; one tuned on the author's machine fails here, on the
machine where it was written, instead of on CI's other CPUs. Legs: ATEN_CPU_CAPABILITY = default, avx2,
and avx512 where this CPU has it, each with 1 and 2 threads per process. Each leg prints the capability
torch reports inside that leg (an unsupported request silently falls back, so we check rather than trust).

`--after-make-test` (what `.ci/run` passes) leaves out the one leg `make test` has just run: this CPU's best
capability with 1 thread (`make test` sets OMP_NUM_THREADS=1 and leaves ATEN_CPU_CAPABILITY unset, so the
same tests already ran under exactly those kernels); the summary names it as covered there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability())"


def capability(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def main(argv: list[str]) -> int:
    after_make_test = "--after-make-test" in argv
    selection = [a for a in argv if a != "--after-make-test"]
    if not selection:
        print("kernel_legs.py: give the tests to run (make test-kernels passes KERNEL_TESTS)", file=sys.stderr)
        return 2
    base = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    best = capability(base)
    # the kernels `make test` ran under (it passes ATEN_CPU_CAPABILITY through when set)
    tested = capability(dict(os.environ)) if "ATEN_CPU_CAPABILITY" in os.environ else best
    wanted = ["default", "avx2"] + (["avx512"] if best.startswith("AVX512") else [])
    print(f"[kernel legs] this CPU's best torch kernel capability: {best}; legs: {', '.join(wanted)} x 1, 2 threads")
    results = []
    for cap in wanted:
        got = capability(dict(base, ATEN_CPU_CAPABILITY=cap))  # read at start-up; threads do not change it
        for threads in (1, 2):
            env = dict(base, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS=str(threads))
            if got.lower() != cap.lower():  # e.g. an AVX2-only CPU asked for avx512
                results.append((cap, threads, got, "SKIPPED (not available)", 0.0))
                continue
            if after_make_test and threads == 1 and got == tested:
                results.append((cap, threads, got, "covered by make test", 0.0))
                continue
            # 1 thread: two xdist workers use both cores; 2 threads: one process at a time, 2 threads each.
            workers = ["-n", "2"] if threads == 1 else ["-p", "no:xdist"]
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", *workers, *selection]
            print(
                f"\n[kernel legs] ATEN_CPU_CAPABILITY={cap} OMP_NUM_THREADS={threads} (torch reports {got})", flush=True
            )
            t0 = time.time()
            rc = subprocess.run(cmd, env=env).returncode
            results.append((cap, threads, got, "passed" if rc == 0 else f"FAILED (pytest exit {rc})", time.time() - t0))
    print("\n[kernel legs] summary")
    for cap, threads, got, status, secs in results:
        print(f"  ATEN_CPU_CAPABILITY={cap:<8} threads={threads}  torch used {got:<8} {status:<24} {secs:6.0f} s")
    return 0 if all(r[3] in ("passed", "covered by make test") or r[3].startswith("SKIPPED") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
