"""Write the fuzz targets' seed corpus (tests/fuzz/corpus/) from the /proc
and cgroup fixtures and the budget and option forms the tests use. The
output is committed; run again after fixtures change:
``python tests/fuzz/seed.py``."""
from __future__ import annotations

import hashlib
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "proc"

# fuzz_procfs.c's parser numbers, by fixture file name (the bad/ fixtures are
# named "<parser>.<case>", v1 ones "<parser>.v1.<case>")
PROCFS = {"statm": 0, "status": 1, "meminfo": 2, "vmstat": 3, "memory.pressure": 4,
          "memory": 4, "psi": 4, "stat": 5, "cgroup": 6, "limit": 7, "memory.max": 7,
          "memory.high": 7, "memory.limit_in_bytes": 7, "memory.swap.max": 7,
          "memory.current": 7, "memory.usage_in_bytes": 7, "memory.oom_control": 10,
          "memory.events": 11, "cgevents": 11, "smaps_rollup": 12, "rollup": 12,
          "children": 13, "pids": 13, "environ": 15}
BUDGETS = ["auto", " Auto ", "12GiB", "1.5G", "512MB", "75%", "12.5%", "100%", "0", "-1",
           "1", "4611686018427387904", "4611686018427387905", "99999999999999999999TiB",
           "1e3GiB", "nan", "0.0000000001%", "7.123456789012345678KiB", "16EiB", "4096TiB"]
OPTIONS = ["100", "5", "60000", "4", "abc", "0.5", "1e12", "1e13", "-0", "nan", "inf", "/proc",
           "", "auto", "12GiB", "0.08", "10", "1048576", "1048577"]


def _parser(path: pathlib.Path) -> int | None:
    name = path.name
    if path.parent.name == "bad":
        kind, _, rest = name.partition(".")
        if kind in ("cgstat", "cgevents"):
            v1 = rest.startswith("v1.")
            return {"cgstat": 8 if v1 else 9, "cgevents": 10 if v1 else 11}[kind]
        return PROCFS.get(kind)
    if name == "memory.stat":
        return 8 if "/memory/" in str(path) and "unified" not in str(path) else 9
    if name == "memory" and path.parent.name != "pressure":
        return None
    return PROCFS.get(name)


def _write(target: str, data: bytes) -> None:
    out = HERE / "corpus" / target
    out.mkdir(parents=True, exist_ok=True)
    (out / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


def main() -> None:
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_file()):
        which = _parser(path)
        if which is not None:
            _write("procfs", bytes([which]) + path.read_bytes())
    for text in BUDGETS:
        for total, avail in ((24 << 30, 20 << 30), (0, 0), ((1 << 64) - 1, 1)):
            _write("budget", struct.pack("<QQ", total, avail) + text.encode())
    for index in range(22):
        for value in OPTIONS:
            _write("options", bytes([index]) + value.encode())


if __name__ == "__main__":
    main()
