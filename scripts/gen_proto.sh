#!/usr/bin/env bash
# Regenerate the statestore.v1 stubs beside the .proto files.
#
# Run from anywhere; generation happens from the repository root with -I. so the modules are
# `proto.statestore.v1.*_pb2` (our top-level Python package is `statestore`: stubs importable
# as `statestore.v1` would shadow it). With OUT_DIR set, writes there instead (freshness test).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT_DIR:-$root}"
py="${PYTHON:-python}"
cd "$root"
"$py" -m grpc_tools.protoc -I. --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
    proto/statestore/v1/common.proto proto/statestore/v1/statestore.proto proto/statestore/v1/sessions.proto
