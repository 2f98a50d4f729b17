#!/usr/bin/env bash
# Validate a run and start it: queued on Slurm (train.slurm), or here with --local (torchrun).
# Everything is checked before anything is queued: config, model/tokenizer/dataset on disk, and
# the data prepared (else a CPU prepare job runs first, and training waits for it: afterok).
# The sbatch command lines come from `llmtrain sbatch-command` (src/llmtrain/login/slurm.py).
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
  --set K=V           override a config value, e.g. --set train.max_steps=100 (repeatable)
  --nodes N, --gpus-per-node N, --procs-per-node N, --time T, --partition P, --account A,
  --qos Q             set slurm.nodes, slurm.gpus_per_node, ... (the same as --set slurm.KEY=V)
  --dependency SPEC   sbatch --dependency, e.g. afterok:123
  --dry-run           print the sbatch command(s) and submit nothing
  --local             run on this machine with torchrun instead of Slurm
  --nproc N           --local: processes to start (default: slurm.procs_per_node)

Prints job_id:, run_dir:, config:, log: and watch: lines (run_dir: only, with --local).
EOF
}

die() { echo "submit.sh: $*" >&2; exit 1; }

# shellcheck source=lib/find-env.sh
source "$REPO/lib/find-env.sh"
# shellcheck source=lib/run-local.sh
source "$REPO/lib/run-local.sh"

submit_slurm() {
  command -v sbatch >/dev/null || die "no Slurm on this machine (sbatch not found); to run here, use: bash submit.sh --local"
  local launch=(--launch) v=()  # a run that trains or waits now is refused, unless this job
  [[ -z "$DEPENDENCY" ]] || launch=()  # waits for one (--dependency)
  mapfile -t v < <(llmtrain check-config "$CONFIG" "${SETS[@]}" --offline --cluster "${launch[@]}" \
    --get run_dir --get prepared --get run.name)
  ((${#v[@]} == 3)) || exit 2  # llmtrain said why
  local run_dir="${v[0]}" prepared="${v[1]}" name="${v[2]}"
  # What was validated is what runs: the jobs train from a frozen copy of the resolved config
  # (overrides applied, the sbatch arguments after -- in slurm.extra_args), not from the file.
  FROZEN="$run_dir/submitted/$(date +%Y%m%d-%H%M%S)-$$.yaml"
  ((DRY_RUN)) || llmtrain check-config "$CONFIG" "${SETS[@]}" --freeze "$FROZEN" -- "${EXTRA[@]}" >/dev/null
  local after=() prep_id job_id
  [[ -z "$DEPENDENCY" ]] || after=(--dependency "$DEPENDENCY")
  if [[ "$prepared" != yes ]]; then  # unprepared data: one CPU job tokenizes it first
    prep_id="$(sbatch_job prepare "${after[@]}")"
    echo "prepare_job_id: $prep_id (tokenizes the data on one node; training waits for it)"
    after=(--after "$prep_id")
  fi
  job_id="$(sbatch_job train "${after[@]}")"
  printf '%s\n' "job_id: $job_id" "run_dir: $run_dir" "log: $run_dir/$name-$job_id.out" \
    "config: $FROZEN (the jobs train from this copy; to change the run, submit again)" \
    "watch: squeue -j $job_id; tail -f $run_dir/$name-$job_id.out; llmtrain status $job_id"
}

# Submit one job ($1: prepare or train) and print its id; with --dry-run, print its command line
# (on the real stdout) and a placeholder id instead.
sbatch_job() {
  local cmd=() out
  mapfile -d '' -t cmd < <(llmtrain sbatch-command "$1" --config "$CONFIG" "${SETS[@]}" \
    --frozen "$FROZEN" --script "$REPO/train.slurm" "${@:2}" -- "${EXTRA[@]}")
  ((${#cmd[@]})) || exit 2  # llmtrain said why
  if ((DRY_RUN)); then
    printf '%q ' "${cmd[@]}" >&3 && printf '\n' >&3
    echo "DRY_RUN_JOB_ID"
    return
  fi
  out="$("${cmd[@]}")" || die "sbatch failed (above); nothing more was submitted"
  [[ -n "$out" ]] || die "sbatch printed no job id"
  echo "${out%%;*}"  # --parsable prints "id" or "id;cluster"
}

main() {
  CONFIG="$REPO/config.yaml" DRY_RUN=0 DEPENDENCY="" SETS=() EXTRA=()
  local local_mode=0 nproc=""
  while (($#)); do
    case "$1" in
      --config) CONFIG="${2:?--config needs a file}"; shift 2 ;;
      --set) SETS+=(--set "${2:?--set needs section.key=value}"); shift 2 ;;
      --nodes | --gpus-per-node | --procs-per-node | --time | --partition | --account | --qos)
        SETS+=(--set "${KEYS[$1]}=${2:?$1 needs a value}"); shift 2 ;;
      --dependency) DEPENDENCY="${2:?--dependency needs a spec}"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --local) local_mode=1; shift ;;
      --nproc) nproc="${2:?--nproc needs a number}"; shift 2 ;;
      --) shift; EXTRA=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      *) echo "submit.sh: unknown option: $1" >&2; usage; exit 2 ;;
    esac
  done
  [[ -f "$CONFIG" ]] || die "--config: no such file: $CONFIG"
  CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"  # jobs start elsewhere
  load_env
  if ((local_mode)); then
    run_local "$nproc"
  else
    exec 3>&1  # sbatch_job's dry-run output, around the $(...) capture
    submit_slurm
  fi
}

main "$@"
