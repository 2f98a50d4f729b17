#!/usr/bin/env bash
# Validate a run and start it: queued on Slurm (train.slurm), or here with --local (torchrun).
# This script finds the environment setup.sh made and turns its flags into `llmtrain submit`
# (src/llmtrain/login/submit.py, also `llmtrain.submit()` in Python), which checks everything
# before anything is queued: config, model/tokenizer/dataset on disk, the cluster's limits, and
# the data prepared (else a CPU prepare job runs first, and training waits for it: afterok).
set -euo pipefail
shopt -s inherit_errexit  # a failing command inside $(...) stops the script too

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO
# Flags that set a config key: --nodes 2 is --set slurm.nodes=2.
declare -rA KEYS=([--nodes]=slurm.nodes [--gpus-per-node]=slurm.gpus_per_node
  [--procs-per-node]=slurm.procs_per_node [--time]=slurm.time [--partition]=slurm.partition
  [--account]=slurm.account [--qos]=slurm.qos)

usage() {
  cat >&2 <<'EOF'
Usage: bash submit.sh [options] [-- extra sbatch arguments]

  --config FILE       the run's config (default: config.yaml next to this script)
  --preset NAME       a ready config of configs/presets/ (tiny-llama, llama3-8b, llama3-70b, ...)
  --set K=V           override a config value, e.g. --set train.max_steps=100 (repeatable)
  --nodes N, --gpus-per-node N, --procs-per-node N, --time T, --partition P, --account A,
  --qos Q             set slurm.nodes, slurm.gpus_per_node, ... (the same as --set slurm.KEY=V)
  --dependency SPEC   sbatch --dependency, e.g. afterok:123
  --dry-run           print the sbatch command(s) and submit nothing
  --local             run on this machine with torchrun instead of Slurm
  --nproc N           --local: processes to start (default: slurm.procs_per_node, else 1)

Prints job_id:, run_dir:, config:, log: and watch: lines (run_dir: only, with --local).
EOF
}

die() { echo "submit.sh: $*" >&2; exit 1; }

presets() {  # the preset names, comma-separated
  local names="" f
  for f in "$REPO"/configs/presets/*.yaml; do names+="${names:+, }$(basename "$f" .yaml)"; done
  echo "$names"
}

# shellcheck source=lib/find-env.sh
source "$REPO/lib/find-env.sh"

main() {
  local config="$REPO/config.yaml" args=() extra=()
  while (($#)); do
    case "$1" in
      --config) config="${2:?--config needs a file}"; shift 2 ;;
      --preset)
        config="$REPO/configs/presets/${2:?--preset needs a name}.yaml"
        [[ -f "$config" ]] || die "--preset: no preset named $2 (configs/presets: $(presets))"
        shift 2 ;;
      --set) args+=(--set "${2:?--set needs section.key=value}"); shift 2 ;;
      --nodes | --gpus-per-node | --procs-per-node | --time | --partition | --account | --qos)
        args+=(--set "${KEYS[$1]}=${2:?$1 needs a value}"); shift 2 ;;
      --dependency) args+=(--dependency "${2:?--dependency needs a spec}"); shift 2 ;;
      --nproc) args+=(--nproc "${2:?--nproc needs a number}"); shift 2 ;;
      --dry-run | --local) args+=("$1"); shift ;;
      --) shift; extra=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      *) echo "submit.sh: unknown option: $1" >&2; usage; exit 2 ;;
    esac
  done
  [[ -f "$config" ]] || die "--config: no such file: $config"
  config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"  # jobs start elsewhere
  load_env
  exec llmtrain submit --config "$config" --script "$REPO/train.slurm" "${args[@]}" -- "${extra[@]}"
}

main "$@"
