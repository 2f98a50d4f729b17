#!/usr/bin/env bash
# Validate a run, prepare its data, and start it: here with --local (torchrun on this machine),
# or on the cluster through Slurm.
#
#   bash submit.sh --local [--config FILE] [--nproc N] [--set section.key=value ...]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO

usage() {
  cat >&2 <<'EOF'
Usage: bash submit.sh [--local] [--config FILE] [--nproc N] [--set section.key=value ...]

  --config FILE   the run's config (default: config.yaml next to this script)
  --set K=V       override a config value, e.g. --set train.max_steps=100 (repeatable)
  --local         run on this machine with torchrun instead of submitting to Slurm
  --nproc N       --local: processes to start (default: the config's slurm.procs_per_node)

Prints "run_dir: PATH" on a line of its own; metrics.jsonl and logs/ are in that folder.
EOF
}

die() { echo "submit.sh: $*" >&2; exit 1; }

# Find the environment setup.sh made: $LLMTRAIN_HOME, $SHARED_DIR/$PROJECT_NAME, the path
# setup.sh recorded in the repo, or the default layout, in that order.
load_env() {
  local home="${LLMTRAIN_HOME:-}"
  if [[ -z "$home" && -n "${SHARED_DIR:-}" ]]; then home="$SHARED_DIR/${PROJECT_NAME:-llmtrain}"; fi
  if [[ -z "$home" && -f "$REPO/.llmtrain-home" ]]; then home="$(<"$REPO/.llmtrain-home")"; fi
  home="${home:-$REPO/workspace/llmtrain}"
  [[ -f "$home/env.sh" ]] || die "no llmtrain environment in $home; run: bash setup.sh"
  # shellcheck source=/dev/null
  source "$home/env.sh"
}

run_local() {
  local config="$1" nproc="$2"
  shift 2
  local sets=("$@")
  if [[ -z "$nproc" ]]; then
    nproc="$(llmtrain check-config "$config" "${sets[@]}" --get slurm.procs_per_node)"
    nproc="${nproc:-1}"
  fi
  [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc: must be a positive integer (got '$nproc')"
  # Validate for this world size before anything runs: one line per problem, exit 2.
  llmtrain check-config "$config" "${sets[@]}" --world-size "$nproc" >/dev/null || exit 2
  llmtrain prepare --config "$config" "${sets[@]}"
  local run_dir
  run_dir="$(llmtrain check-config "$config" "${sets[@]}" --get run_dir)"
  echo "run_dir: $run_dir"
  # --standalone: a private rendezvous on a free local port, so two local runs never meet.
  torchrun --standalone --nproc-per-node "$nproc" -m llmtrain train --config "$config" "${sets[@]}"
  echo "run_dir: $run_dir"
}

main() {
  local config="$REPO/config.yaml" local_mode=0 nproc=""
  local sets=()
  while (($#)); do
    case "$1" in
      --config) config="${2:?--config needs a file}"; shift 2 ;;
      --set) sets+=(--set "${2:?--set needs section.key=value}"); shift 2 ;;
      --local) local_mode=1; shift ;;
      --nproc) nproc="${2:?--nproc needs a number}"; shift 2 ;;
      -h | --help) usage; exit 0 ;;
      *) echo "submit.sh: unknown option: $1" >&2; usage; exit 2 ;;
    esac
  done
  [[ -f "$config" ]] || die "--config: no such file: $config"
  load_env
  if ((local_mode)); then
    run_local "$config" "$nproc" "${sets[@]}"
  elif ! command -v sbatch >/dev/null; then
    die "no Slurm on this machine (sbatch not found); to run here, use: bash submit.sh --local"
  else
    die "submitting to Slurm is not available yet (issue 4); use: bash submit.sh --local"
  fi
}

main "$@"
