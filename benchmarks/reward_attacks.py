"""The reward hardening measured: the math verifier's refusal rate on honest answers and
credit rate on attacks, and the judge guard's flag rate on honest answers and miss rate on
attacks, on the sets in tests/data/reward_attacks/. Run it against any checkout (the sets are
read from this file's tree, the reward from whatever `tidal` imports):

    PYTHONPATH=/path/to/checkout python benchmarks/reward_attacks.py [--only math|judge]

Each math case runs in the main thread, where the reward's own SIGALRM deadline (timeout_s)
applies, so an answer that costs too much ends as a 0 after that deadline rather than
hanging: its time is printed. The judge side measures `detect_injection` alone (the check
made before any call) and, where the tree has it, the verdict's own flag is not counted here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import time

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "reward_attacks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"reward_attacks_{name}", DATA / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def math_rates() -> dict:
    from tidal.rewards.math import score

    data = load("math")
    score("\\boxed{1}", answer="1/1")  # imports math-verify before timing
    refused, credited, slow = [], [], []
    t0 = time.perf_counter()
    for completion, reference in data.HONEST:
        if score(completion, answer=reference)["correct"] != 1.0:
            refused.append(completion)
    honest_ms = (time.perf_counter() - t0) / len(data.HONEST) * 1e3
    for completion, reference, kind in data.ATTACKS:
        t0 = time.monotonic()
        if score(completion, answer=reference)["correct"] != 0.0:
            credited.append(f"{kind}: {completion!r} for {reference!r}")
        if time.monotonic() - t0 > 1.0:
            slow.append(f"{kind}: {completion!r} took {time.monotonic() - t0:.1f} s")
    return {"honest": len(data.HONEST), "honest_refused": len(refused), "honest_ms_per_answer": round(honest_ms, 2),
            "attacks": len(data.ATTACKS),
            "attacks_credited": len(credited), "refused": refused, "credited": credited, "slow": slow}


def judge_rates() -> dict:
    from tidal.rewards.injection import detect_injection

    data = load("judge")
    t0 = time.perf_counter()
    flagged = [t for t in data.HONEST if detect_injection(t)]
    honest_ms = (time.perf_counter() - t0) / len(data.HONEST) * 1e3
    missed: dict[str, list[str]] = {}
    total: dict[str, int] = {}
    for text, kind in data.ATTACKS:
        total[kind] = total.get(kind, 0) + 1
        if not detect_injection(text):
            missed.setdefault(kind, []).append(text[:80])
    return {"honest": len(data.HONEST), "honest_flagged": len(flagged), "honest_ms_per_answer": round(honest_ms, 2),
            "flagged": [t[:80] for t in flagged],
            "attacks": sum(total.values()), "attacks_missed": sum(len(v) for v in missed.values()),
            "by_class": {k: f"{total[k] - len(missed.get(k, []))}/{total[k]} caught" for k in total}, "missed": missed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["math", "judge"])
    args = ap.parse_args()
    out = {}
    if args.only in (None, "math"):
        out["math"] = math_rates()
    if args.only in (None, "judge"):
        out["judge"] = judge_rates()
    print(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
