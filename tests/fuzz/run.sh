#!/bin/sh
# run.sh — runs the libFuzzer harnesses (what `make fuzz` calls).
#
#   sh tests/fuzz/run.sh BUILD SECONDS [NAME...]
#
# Each harness BUILD/fuzz/NAME runs SECONDS seconds on its committed seeds
# (tests/fuzz/corpus/NAME, read only) and its working corpus
# (BUILD/corpus/NAME, where new inputs go; never committed), with
# tests/fuzz/NAME.dict when there is one. A crash, leak, UB report, timeout
# (10 s) or memory blow-up (2 GB) leaves its input in BUILD/artifacts/NAME/
# and makes the script fail after the others ran. Prints one line per
# harness: executions, executions per second, coverage (edges, features),
# corpus size; the full logs are in BUILD/logs/.
set -u
B=$1
S=$2
shift 2
names="$*"
[ -n "$names" ] || names=$(ls tests/fuzz/fuzz_*.c | sed 's|.*/fuzz_||; s|\.c$||')
: "${UBSAN_OPTIONS:=print_stacktrace=1:halt_on_error=1}"
export UBSAN_OPTIONS
# readable stack traces: Debian keeps llvm-symbolizer out of PATH unless the llvm package is in
if [ -z "${ASAN_SYMBOLIZER_PATH:-}" ] && ! command -v llvm-symbolizer >/dev/null 2>&1; then
    for s in /usr/lib/llvm-*/bin/llvm-symbolizer; do [ -x "$s" ] && ASAN_SYMBOLIZER_PATH=$s && export ASAN_SYMBOLIZER_PATH; done
fi
mkdir -p "$B/logs"
failed=""
printf '%-18s %10s %8s %6s %6s %7s  %s\n' harness execs exec/s cov ft corpus result
for n in $names; do
    bin="$B/fuzz/$n"
    [ -x "$bin" ] || { echo "run.sh: $bin is not built (make fuzz)" >&2; exit 2; }
    mkdir -p "$B/corpus/$n" "$B/artifacts/$n"
    log="$B/logs/$n.log"
    dict=""
    [ -f "tests/fuzz/$n.dict" ] && dict="-dict=tests/fuzz/$n.dict"
    "$bin" -max_total_time="$S" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$B/artifacts/$n/" $dict "$B/corpus/$n" "tests/fuzz/corpus/$n" >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
    ft=$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
    corp=$(ls "$B/corpus/$n" | wc -l)
    result=ok
    if [ "$rc" != 0 ]; then
        result="FAILED (rc $rc, $log)"
        failed="$failed $n"
    fi
    printf '%-18s %10s %8s %6s %6s %7s  %s\n' "$n" "${execs:--}" "${eps:--}" "${cov:--}" "${ft:--}" "$corp" "$result"
done
if [ -n "$failed" ]; then
    for n in $failed; do
        echo "---- $n: last lines of $B/logs/$n.log"
        tail -n 40 "$B/logs/$n.log"
    done
    echo "fuzz: failed:$failed (inputs in $B/artifacts/)"
    exit 1
fi
