#!/bin/sh
# pdstor's GPU qualification, from the bundle: ./run.sh OUT [qual.py options]
#
# Needs nothing but this directory, a POSIX shell and the machine's Python 3
# (python3 on PATH, or PYTHON=...; torch for the KV rungs, the NVIDIA driver
# for the GPU rungs). Writes OUT/report.json and OUT/report.md, every rung
# PASS / FAIL / SKIP with its reason, and exits 0 when no rung FAILed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-}}
if [ -z "$out" ]; then
    echo "usage: run.sh OUT [options]   (or OUT=dir run.sh): where report.json and report.md go" >&2
    exit 2
fi
[ $# -gt 0 ] && shift
mkdir -p "$out" || { echo "run.sh: cannot create $out" >&2; exit 2; }
python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
    msg="no Python: '$python' is not on PATH (set PYTHON=/path/to/python3)"
    echo "run.sh: $msg" >&2
    printf '{"error": "%s", "rungs": []}\n' "$msg" >"$out/report.json"
    printf '# pdstor GPU qualification\n\n**Not run**: %s\n' "$msg" >"$out/report.md"
    exit 2
fi
exec "$python" "$here/qual.py" --bundle "$here" --out "$out" "$@"
