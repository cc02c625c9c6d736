#!/usr/bin/env bash
# Lints and builds every test of the crate in one compile, then runs them,
# several test binaries at once.
#
# Each test binary starts its own control plane (tests/testkit/src/cluster.rs) and
# spends most of its time waiting on it: measured on 2 cores, `faults` keeps
# the CPUs 18% busy, `bypass` 40%, and only `load` (50 tenant clusters) more
# than 90%. `cargo test` runs the binaries one after another, so the suite's
# time was the sum of their times. This runs up to $VOLUME_GATE_TEST_JOBS
# binaries at once (default 2): a first tier of quick ones (the unit tests
# among them), then the longest first, `load` alone
# (it alone keeps the machine busy); each binary still runs its own tests as
# libtest does (as many at once as there are CPUs). Every binary runs even
# when one fails; the exit status fails if any did.
#
#   tests/suite.sh                 build, then run every test binary
#   tests/suite.sh -- ARGS         pass ARGS to every binary (a name filter,
#                                  --nocapture, ...)
#
# Each binary's output is printed whole when it ends (not interleaved), with
# its time; a table of all of them closes the run. The Go programs the tests
# run (tests/*/build.sh) are built first, one at a time, so a cold machine
# does not build the same thing in three processes at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
    echo "suite.sh: needs bash 5.1 or newer (it waits with 'wait -n -p'); this is bash $BASH_VERSION" >&2
    exit 2
fi
jobs="${VOLUME_GATE_TEST_JOBS:-2}"
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
    echo "suite.sh: VOLUME_GATE_TEST_JOBS must be a positive integer, not '$jobs'" >&2
    exit 2
fi
args=()
if [[ "${1:-}" == "--" ]]; then
    shift
    args=("$@")
elif (($#)); then
    echo "suite.sh: unexpected argument '$1' (pass arguments for the test binaries after --)" >&2
    exit 2
fi

# The first tier: the pure tests (the crate's unit tests: every rule's
# table, the judge, the scripted-API tests) and the binaries that start no
# control plane, seconds in all. They run before anything else and the
# suite says at once whether they passed, so a broken rule is known in a
# minute, not after the long binaries; every binary still runs either way.
first=("volume_gate (lib)" "volume-gate (bin)" docs_map docs_links webhook_https tls_reload chart network shipping harness_units)
# Then the longest binaries first (seconds each, measured alone on 2 cores),
# so the last to start are short; binaries not named here run after these,
# by name.
order=(load faults security gated infra bypass teardown alerts chart_install attach node binding worker_inputs platform slots
    outage flux_gated incident surface snapshots kept kept_proxmox capi_gated capi chart_cert_manager flux)
# Weight of a binary in the $jobs slots: load keeps both CPUs busy by itself,
# and runs alone (beside another binary it has overloaded the machine:
# tenant API servers failing /readyz, CSI sidecars timing out, a Pod of its
# 40th tenant never attached).
weight() { [[ "$1" == load ]] && echo "$jobs" || echo 1; }

started=$SECONDS
# The management cluster's real node (tests/node.rs) needs a container
# runtime and CNI plugins from Debian's packages: installed once, if missing.
bash tests/harness/node-deps.sh
for script in tests/*/build.sh; do
    bash "$script" >/dev/null
done
go_built=$((SECONDS - started))

# Build every test target, and read where each executable is (cargo's own
# JSON messages: one line per artifact). The build is also the lint: each
# crate of the workspace is compiled by clippy-driver with warnings denied
# (tests/clippy-rustc.sh), so a lint fails the build as `cargo clippy
# --workspace --all-targets -- -D warnings` would, over the same targets
# (the library and binary with their unit tests, every integration test,
# the examples, the fixture), and no dependency is compiled twice. Cargo
# keeps the workspace's crates built through a workspace wrapper apart
# from a plain build's (the wrapper is part of their fingerprint), so the
# first plain `cargo test` afterwards compiles those crates again, not the
# dependencies.
#
# A fresh clone on a machine that has run this before starts from the
# dependencies that run compiled (tests/rust-deps-cache.sh), and only this
# workspace's crates are compiled.
list="$(mktemp)"
logs="$(mktemp -d)"
trap 'rm -rf "$list" "$logs"' EXIT
# The cache only saves time: if it cannot be read or written (a read-only
# or full disk), the build compiles what it must and the tests still run.
bash tests/rust-deps-cache.sh restore ||
    echo "suite.sh: compiled dependencies not restored (see above); the build compiles them"
RUSTC_WORKSPACE_WRAPPER="$PWD/tests/clippy-rustc.sh" \
    cargo test --locked --no-run --message-format=json-render-diagnostics >"$list"
bash tests/rust-deps-cache.sh save ||
    echo "suite.sh: compiled dependencies not cached (see above); the next fresh clone compiles them again"
built=$((SECONDS - started))
declare -A exe=()
while IFS= read -r line; do
    # The test harnesses only: their profile says "test" (the binary
    # cargo also builds for the tests to run is not one).
    [[ "$line" == *'"reason":"compiler-artifact"'* && "$line" =~ \"profile\":\{[^}]*\"test\":true ]] || continue
    path="$(sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' <<<"$line")"
    name="$(sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*/\1/p' <<<"$line")"
    kind="$(sed -n 's/.*"target":{"kind":\["\([^"]*\)".*/\1/p' <<<"$line")"
    [[ -n "$path" && -n "$name" ]] || continue
    # The library's and the binary's unit tests share the crate's name.
    [[ "$kind" == test ]] || name="$name ($kind)"
    exe["$name"]="$path"
done <"$list"
if ((${#exe[@]} == 0)); then
    echo "suite.sh: cargo built no test executable (see $list)" >&2
    exit 1
fi

queue=()
tier=0
for name in "${first[@]}" "${order[@]}"; do
    [[ -n "${exe[$name]+x}" ]] && queue+=("$name")
done
for name in "${first[@]}"; do
    [[ -n "${exe[$name]+x}" ]] && tier=$((tier + 1))
done
while IFS= read -r name; do
    [[ " ${order[*]} " == *" $name "* || " ${first[*]} " == *" $name "* ]] || queue+=("$name")
done < <(printf '%s\n' "${!exe[@]}" | LC_ALL=C sort)

declare -A pid_of=() began=() took=() status=() result=()
running=()
used=0
failed=0
echo "suite.sh: ${#queue[@]} test binaries, up to $jobs slots at once (Go programs ready in ${go_built}s, tests built in $((built - go_built))s)"

# Stops the binaries still running (each takes its control plane with it).
stop_all() {
    local name
    for name in "${running[@]+"${running[@]}"}"; do
        kill "${pid_of[$name]}" 2>/dev/null || true
    done
}
trap 'stop_all; exit 130' INT TERM

finish() {
    local name="$1" rc="$2" rest=() r
    took["$name"]=$((SECONDS - began[$name]))
    status["$name"]=$rc
    result["$name"]="$(grep -E '^test result:' "$logs/$name.log" | tail -1 || true)"
    echo
    echo "──── ${exe[$name]#"$PWD/"} ($name): exit $rc in ${took[$name]}s"
    cat "$logs/$name.log"
    ((rc == 0)) || failed=$((failed + 1))
    for r in "${running[@]}"; do
        [[ "$r" == "$name" ]] || rest+=("$r")
    done
    running=("${rest[@]+"${rest[@]}"}")
    used=$((used - $(weight "$name")))
}

# Waits for any running binary to end and records it.
reap() {
    local done_pid rc=0 name
    wait -n -p done_pid "${pid_of[@]}" || rc=$?
    for name in "${running[@]}"; do
        if [[ "${pid_of[$name]}" == "$done_pid" ]]; then
            unset "pid_of[$name]"
            finish "$name" "$rc"
            return
        fi
    done
}

# Says how the first tier went, once all of it has ended.
first_tier_done() {
    local name bad=()
    for name in "${queue[@]:0:tier}"; do
        ((${status[$name]} == 0)) || bad+=("$name")
    done
    echo
    if ((${#bad[@]})); then
        echo "──── first tier FAILED in $((SECONDS - built))s: ${bad[*]} (the long binaries run anyway)"
    else
        echo "──── first tier passed in $((SECONDS - built))s: $tier binaries, the unit tests among them; the long binaries follow"
    fi
}

n=0
for name in "${queue[@]}"; do
    if ((n == tier && tier > 0)); then
        while ((${#running[@]})); do
            reap
        done
        first_tier_done
    fi
    n=$((n + 1))
    w=$(weight "$name")
    ((w > jobs)) && w=$jobs
    while ((used + w > jobs)); do
        reap
    done
    began["$name"]=$SECONDS
    "${exe[$name]}" "${args[@]+"${args[@]}"}" >"$logs/$name.log" 2>&1 &
    pid_of["$name"]=$!
    running+=("$name")
    used=$((used + w))
done
while ((${#running[@]})); do
    reap
done
((tier == 0 || n > tier)) || first_tier_done

echo
echo "──── suite: $((SECONDS - started))s in all (Go programs ${go_built}s, build $((built - go_built))s, tests $((SECONDS - built))s)"
passed=0
failed_tests=0
for name in "${queue[@]}"; do
    r="${result[$name]:-no "test result" line (its output is above)}"
    printf '%6ss  %-28s %s\n' "${took[$name]}" "$name" "$r"
    if [[ "$r" =~ ([0-9]+)\ passed\;\ ([0-9]+)\ failed ]]; then
        passed=$((passed + BASH_REMATCH[1]))
        failed_tests=$((failed_tests + BASH_REMATCH[2]))
    fi
done
echo "──── $passed passed, $failed_tests failed; $failed of ${#queue[@]} binaries failed"
((failed == 0))
