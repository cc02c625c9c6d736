# volume-gate: one static-enough binary on a distroless, non-root base.
# Build: docker build -t ghcr.io/cozystack/volume-gate:0.1.0 .
# Pin the bases by digest in your registry mirror (tags shown for reading).

FROM docker.io/library/rust:1.95.0-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so source changes reuse the cached dependency layer.
# The test fixture (tests/testkit) is a workspace member: Cargo reads its
# manifest, and needs a target in it, to resolve the lock; it is not built.
COPY Cargo.toml Cargo.lock ./
COPY tests/testkit/Cargo.toml tests/testkit/
RUN mkdir -p src tests/testkit/src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs tests/testkit/src/lib.rs \
    && cargo build --release --locked --bin volume-gate \
    && rm -rf src
COPY src ./src
# Make cargo see the real sources as newer than the placeholder build.
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin volume-gate

# glibc is the only shared library the binary needs (rustls, no OpenSSL).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/volume-gate /usr/local/bin/volume-gate
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/volume-gate"]
CMD ["--help"]
