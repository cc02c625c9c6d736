#!/usr/bin/env python3
"""Where a bench-admission server thread spends its CPU (docs/benchmarks.md).

Reads `perf script` output on stdin and counts the samples of one thread
name (comm, e.g. bench-server) into buckets: each sample goes to the first
rule (in the order below) that matches any frame of its call chain. Needs a
build with symbols and frame pointers; samples whose chain stops at a libc
leaf (malloc, free, memcpy: glibc has no frame pointers) are counted as
"other".

    perf script -i gate.data --comm bench-server | python3 tests/bench/perf_buckets.py bench-server
"""
import sys, re, collections
comm = sys.argv[1]
rules = [
    ("decode: review::decode", r"admission::review::decode"),
    ("drop of the decoded request", r"drop_in_place<kube_core::admission::AdmissionRequest"),
    ("decision: Gate::validate / mutate", r"Gate::validate|Gate::mutate|admission::decide::"),
    ("log line per decision (tracing json)", r"tracing_subscriber|tracing_core::event|tracing::"),
    ("metrics (prometheus-client)", r"prometheus_client"),
    ("response: review::respond", r"admission::review::respond"),
    ("null handler: uid parse", r"null_validate"),
    ("body read (Limited/collect)", r"http_body_util|Collected|Limited"),
    ("TLS (rustls, ring)", r"rustls|ring_core"),
    ("HTTP/2 + hyper + axum glue", r"h2::|hyper::|hyper_util|axum::"),
    ("kernel (TCP, syscalls, scheduling)", r"\[kernel"),
    ("tokio runtime", r"tokio::"),
]
counts = collections.Counter(); total = 0
cur = None; frames = []
def flush():
    global total
    if cur != comm: return
    total += 1
    text = "\n".join(frames)
    for name, pat in rules:
        if re.search(pat, text):
            counts[name] += 1; return
    leaf = frames[0] if frames else "?"
    counts["other (leaf: libc malloc/free/memcpy without a caller chain, ...)" ] += 1
for line in sys.stdin:
    if line and not line[0].isspace() and line.strip():
        flush(); cur = line.split()[0]; frames = []
    elif line.strip():
        frames.append(line.strip())
flush()
for name, c in counts.most_common():
    print(f"{100*c/total:6.1f}%  {name}")
print(f"{total} samples of {comm}")
