#!/usr/bin/env bash
# Install NVIDIA's aiperf (the independent load generator benchmarks/serving_aiperf_check.py
# compares kvserve bench with) into its own virtualenv, .venv/aiperf-env, so its many
# dependencies stay out of the project's environment.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ENV="$ROOT/.venv/aiperf-env"
VERSION="${AIPERF_VERSION:-0.13.0}"
[ -x "$ENV/bin/aiperf" ] && { echo "already installed: $ENV/bin/aiperf"; exit 0; }
python3 -m venv "$ENV"
"$ENV/bin/pip" install --upgrade pip
"$ENV/bin/pip" install "aiperf==$VERSION"
echo "installed $ENV/bin/aiperf"
