#!/usr/bin/env bash
# Validate a run and start it: queued on Slurm (train.slurm), or here with --local (torchrun).
# Everything is checked before anything is queued: config, model/tokenizer/dataset on disk, and
# the data prepared (else a CPU prepare job runs first, and training waits for it: afterok).
#
#   bash submit.sh [--config FILE] [--nodes N] [--time T] [--set section.key=value ...] [--dry-run]
#   bash submit.sh --local [--config FILE] [--nproc N] [--set ...]
set -euo pipefail
shopt -s inherit_errexit  # a failing sbatch inside $(...) stops the script too

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO

usage() {
  cat >&2 <<'EOF'
Usage: bash submit.sh [options] [-- extra sbatch arguments]

  --config FILE          the run's config (default: config.yaml next to this script)
  --set K=V              override a config value, e.g. --set train.max_steps=100 (repeatable)
  --nodes N              slurm.nodes            --gpus-per-node N   slurm.gpus_per_node
  --procs-per-node N     slurm.procs_per_node   --time T            slurm.time
  --partition P          slurm.partition        --account A         slurm.account
  --qos Q                slurm.qos
  --dependency SPEC      sbatch --dependency, e.g. afterok:123
  --dry-run              print the sbatch command(s) and submit nothing
  --local                run on this machine with torchrun instead of Slurm
  --nproc N              --local: processes to start (default: slurm.procs_per_node)

Prints job_id:, run_dir: and log: lines (run_dir: only, with --local).
EOF
}

die() { echo "submit.sh: $*" >&2; exit 1; }

# shellcheck source=lib/find-env.sh
source "$REPO/lib/find-env.sh"

run_local() {
  local config="$1" nproc="$2"
  shift 2
  if [[ -z "$nproc" ]]; then
    nproc="$(llmtrain check-config "$config" "$@" --get slurm.procs_per_node)"
    nproc="${nproc:-1}"
  fi
  [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc: must be a positive integer (got '$nproc')"
  llmtrain check-config "$config" "$@" --world-size "$nproc" --offline >/dev/null || exit 2
  llmtrain prepare --config "$config" "$@"
  local run_dir
  run_dir="$(llmtrain check-config "$config" "$@" --get run_dir)"
  echo "run_dir: $run_dir"
  # torchrun sets OMP_NUM_THREADS=1 when it starts several processes: each gets its share of the
  # CPUs this process may use instead, unless the user chose a number.
  if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    local cpus
    cpus="$(nproc)"  # the CPUs in this process's affinity mask
    export OMP_NUM_THREADS=$((cpus / nproc > 1 ? cpus / nproc : 1))
  fi
  echo "torchrun: $nproc process(es) x $OMP_NUM_THREADS thread(s) (OMP_NUM_THREADS)"
  # --standalone: a private rendezvous on a free local port, so two local runs never meet.
  # Ctrl-C saves and stops, as `llmtrain control RUN_DIR stop` does: torchrun runs in the
  # background, where SIGINT stays ignored (it is told not to take it over: its own handling
  # ends in a SignalException traceback), and the trap writes the stop switch. Bash runs a trap
  # only between commands: wait, and wait again after the trap.
  rm -f "$run_dir/logs/error.txt"
  trap 'ask_to_stop "$run_dir"' INT
  torchrun --signals-to-handle SIGTERM,SIGHUP,SIGQUIT --standalone --nproc-per-node "$nproc" \
    -m llmtrain train --config "$config" "$@" &
  local pid=$! rc=0
  while true; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - INT
  # The trainer's own line last, below torchrun's failure summary.
  if ((rc)); then
    [[ -f "$run_dir/logs/error.txt" ]] && cat "$run_dir/logs/error.txt" >&2
    exit "$rc"
  fi
  echo "run_dir: $run_dir"
}

ask_to_stop() {
  echo "interrupted: asking the trainer to save and stop at the next step" >&2
  mkdir -p "$1/control"
  printf 'user\n' >"$1/control/stop"
}

submit_slurm() {
  local config="$1" dependency="$2"
  shift 2
  local sets=() extra=()
  while (($#)) && [[ "$1" != -- ]]; do sets+=("$1"); shift; done
  (($#)) && shift && extra=("$@")

  command -v sbatch >/dev/null || die "no Slurm on this machine (sbatch not found); to run here, use: bash submit.sh --local"
  llmtrain check-config "$config" "${sets[@]}" --offline >/dev/null || exit 2
  local v extra_cfg
  mapfile -t v < <(llmtrain check-config "$config" "${sets[@]}" --get run.name --get run_dir \
    --get slurm.nodes --get slurm.gpus_per_node --get slurm.procs_per_node --get slurm.cpus_per_node \
    --get slurm.mem --get slurm.time --get slurm.partition --get slurm.account --get slurm.qos \
    --get prepared --get slurm.signal_lead_s --get slurm.max_requeues --get slurm.max_restarts)
  mapfile -t extra_cfg < <(llmtrain check-config "$config" "${sets[@]}" --get slurm.extra_args | sed '/^$/d')
  local name="${v[0]}" run_dir="${v[1]}" gpus="${v[3]}"

  local place=()  # where both jobs run
  [[ -n "${v[8]}" ]] && place+=(--partition="${v[8]}")
  [[ -n "${v[9]}" ]] && place+=(--account="${v[9]}")
  [[ -n "${v[10]}" ]] && place+=(--qos="${v[10]}")
  local sbatch=(sbatch --parsable
    --job-name="$name" --nodes="${v[2]}" --ntasks-per-node=1 --cpus-per-task="${v[5]}"
    --mem="${v[6]}" --time="${v[7]}" --output="$run_dir/%x-%j.out" --open-mode=append --requeue)
  ((v[12] > 0)) && sbatch+=(--signal="B:USR1@${v[12]}")
  ((gpus > 0)) && sbatch+=(--gpus-per-node="$gpus")
  sbatch+=("${place[@]}" "${extra_cfg[@]}" "${extra[@]}")
  # What was validated is what runs: the jobs train from a frozen copy of the resolved config
  # (--set overrides applied), not from the file, which may change while they wait or requeue.
  local frozen
  frozen="$run_dir/submitted/$(date +%Y%m%d-%H%M%S)-$$.yaml"
  ((DRY_RUN)) || llmtrain check-config "$config" "${sets[@]}" --freeze "$frozen" >/dev/null
  # The job's environment: which config, which llmtrain home, how many processes per node.
  local quoted
  printf -v quoted '%q ' "${sbatch[@]:1}"  # for a continuation job, should requeue be refused
  local env=(env "LLMTRAIN_CONFIG=$frozen" "LLMTRAIN_HOME=$LLMTRAIN_HOME" "LLMTRAIN_SBATCH_ARGS=$quoted"
    "LLMTRAIN_PROCS_PER_NODE=${v[4]:-$gpus}" "LLMTRAIN_RUN_DIR=$run_dir"
    "LLMTRAIN_MAX_REQUEUES=${v[13]}" "LLMTRAIN_MAX_RESTARTS=${v[14]}")

  ((DRY_RUN)) || mkdir -p "$run_dir"
  local dep="$dependency"
  if [[ "${v[11]}" != yes ]]; then  # unprepared data: one CPU job tokenizes it first
    # The training job's CPUs, memory, time and place; one task on one node; no GPUs, so none
    # of the user's GPU requests either; no warning signal (the prepare step has no trap).
    local prep=(sbatch --parsable --cpus-per-task="${v[5]}" --mem="${v[6]}" --time="${v[7]}"
      --requeue --open-mode=append "${place[@]}") prep_id
    without_gpus prep "${extra_cfg[@]}" "${extra[@]}"
    prep_id="$(sbatch_or_print "${env[@]}" LLMTRAIN_STEP=prepare "${prep[@]}" \
      --job-name="prepare-$name" --nodes=1 --ntasks=1 --output="$run_dir/prepare-%j.out" \
      ${dependency:+--dependency="$dependency"} "$REPO/train.slurm")"
    echo "prepare_job_id: $prep_id (tokenizes the data on one node; training waits for it)"
    dep="afterok:$prep_id"
  fi
  local job_id
  # --kill-on-invalid-dep: a failed prepare job cancels training instead of leaving it pending.
  job_id="$(sbatch_or_print "${env[@]}" "${sbatch[@]}" ${dep:+--dependency="$dep" --kill-on-invalid-dep=yes} \
    "$REPO/train.slurm")"
  echo "job_id: $job_id"
  echo "run_dir: $run_dir"
  echo "config: $frozen (the jobs train from this copy; to change the run, submit again)"
  echo "log: $run_dir/$name-$job_id.out"
  echo "watch: squeue -j $job_id; tail -f $run_dir/$name-$job_id.out; llmtrain status $job_id"
}

# Append sbatch arguments to the array named $1, less their GPU requests: --gpus*, -G, --gpu-*,
# --cpus-per-gpu, --mem-per-gpu (each with its value), and the gpu entries of a --gres.
without_gpus() {
  local -n out="$1"
  shift
  local arg spec entries kept
  while (($#)); do
    arg="$1"
    shift
    case "$arg" in
      --gres | --gres=*)
        if [[ "$arg" == --gres ]]; then spec="${1-}"; shift || true; else spec="${arg#--gres=}"; fi
        IFS=, read -ra entries <<<"$spec"
        kept=()
        for spec in "${entries[@]}"; do [[ "$spec" == gpu* ]] || kept+=("$spec"); done
        ((${#kept[@]} == 0)) || out+=("--gres=$(IFS=,; echo "${kept[*]}")")
        ;;
      --gpus*=* | --gpu-*=* | --cpus-per-gpu=* | --mem-per-gpu=* | -G?*) ;;
      --gpus* | --gpu-* | --cpus-per-gpu | --mem-per-gpu | -G) shift || true ;;  # and its value
      *) out+=("$arg") ;;
    esac
  done
}

# Run an sbatch command line and print the job id; with --dry-run, print the command line
# (shell-quoted, on the real stdout) and a placeholder id instead.
DRY_RUN=0
sbatch_or_print() {
  if ((DRY_RUN)); then
    printf '%q ' "$@" >&3
    printf '\n' >&3
    echo "DRY_RUN_JOB_ID"
    return
  fi
  local out
  out="$("$@")" || die "sbatch failed (above); nothing more was submitted"
  [[ -n "$out" ]] || die "sbatch printed no job id"
  echo "${out%%;*}"  # --parsable prints "id" or "id;cluster"
}

main() {
  local config="$REPO/config.yaml" local_mode=0 nproc="" dependency=""
  local sets=() extra=()
  while (($#)); do
    case "$1" in
      --config) config="${2:?--config needs a file}"; shift 2 ;;
      --set) sets+=(--set "${2:?--set needs section.key=value}"); shift 2 ;;
      --nodes) sets+=(--set "slurm.nodes=${2:?--nodes needs a number}"); shift 2 ;;
      --gpus-per-node) sets+=(--set "slurm.gpus_per_node=${2:?--gpus-per-node needs a number}"); shift 2 ;;
      --procs-per-node) sets+=(--set "slurm.procs_per_node=${2:?--procs-per-node needs a number}"); shift 2 ;;
      --time) sets+=(--set "slurm.time=${2:?--time needs HH:MM:SS}"); shift 2 ;;
      --partition) sets+=(--set "slurm.partition=${2:?--partition needs a name}"); shift 2 ;;
      --account) sets+=(--set "slurm.account=${2:?--account needs a name}"); shift 2 ;;
      --qos) sets+=(--set "slurm.qos=${2:?--qos needs a name}"); shift 2 ;;
      --dependency) dependency="${2:?--dependency needs a spec}"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --local) local_mode=1; shift ;;
      --nproc) nproc="${2:?--nproc needs a number}"; shift 2 ;;
      --) shift; extra=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      *) echo "submit.sh: unknown option: $1" >&2; usage; exit 2 ;;
    esac
  done
  [[ -f "$config" ]] || die "--config: no such file: $config"
  config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"  # jobs start elsewhere
  load_env
  if ((local_mode)); then
    run_local "$config" "$nproc" "${sets[@]}"
  else
    exec 3>&1  # sbatch_or_print's dry-run output, around the $(...) capture
    submit_slurm "$config" "$dependency" "${sets[@]}" -- "${extra[@]}"
  fi
}

main "$@"
