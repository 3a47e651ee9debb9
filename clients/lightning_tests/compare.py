"""Compare two JUnit XML files from run.sh, test by test: control (DDP as asked) against substituted.

    python compare.py results/control.xml results/zero2.xml > results/compare.md

Prints counts per outcome in each run and, for every test that passed under control and did not pass when
substituted, its first failure line. Tests where a DDP strategy was seen carry the ``lz_ddp`` property
(lz_substitute.py); the others could not have been changed by the substitution.
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, tuple[str, str, list[str]]]:
    """nodeid-like key -> (outcome, first message line, lz_ddp values)."""
    result: dict[str, tuple[str, str, list[str]]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("error", "failure", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"error": "error", "failure": "failed", "skipped": "skipped"}[tag]
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        seen = [p.get("value", "") for p in case.iter("property") if p.get("name") == "lz_ddp"]
        # A test with an error in teardown appears as one testcase with both; keep the worst.
        previous = result.get(key)
        if previous is None or previous[0] == "passed":
            result[key] = (outcome, message, seen or (previous[2] if previous else []))
    return result


def main(control_path: str, substituted_path: str) -> None:
    control, substituted = outcomes(control_path), outcomes(substituted_path)
    print(f"# {control_path} vs {substituted_path}\n")
    for name, run in (("control", control), ("substituted", substituted)):
        counts = collections.Counter(o for o, _, _ in run.values())
        touched = sum(1 for _, _, seen in run.values() if seen)
        print(f"- {name}: {len(run)} tests, " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
              + f"; DDP seen in {touched}")
    broke = [k for k, (o, _, _) in control.items() if o == "passed" and k in substituted and substituted[k][0] != "passed"]
    fixed = [k for k, (o, _, _) in control.items() if o in ("failed", "error") and substituted.get(k, ("",))[0] == "passed"]
    print(f"- passed under control, not when substituted: {len(broke)}")
    print(f"- failed under control, passed when substituted: {len(fixed)}\n")
    for key in sorted(broke):
        outcome, message, seen = substituted[key]
        print(f"- `{key}` [{outcome}; ddp: {', '.join(sorted(set(seen))) or 'none'}]: {message}")
    if fixed:
        print("\nFailed under control, passed substituted:\n")
        for key in sorted(fixed):
            print(f"- `{key}`: {control[key][1]}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
