# shellcheck shell=bash
# Sourced by submit.sh: `--local`, the run on this machine with torchrun (through
# llmtrain.training.torchrun: no launcher traceback). Uses CONFIG and SETS.
run_local() {
  local nproc="$1" run_dir
  [[ -n "$nproc" ]] || nproc="$(llmtrain check-config "$CONFIG" "${SETS[@]}" --get slurm.procs_per_node)"
  nproc="${nproc:-1}"
  [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc: must be a positive integer (got '$nproc')"
  llmtrain check-config "$CONFIG" "${SETS[@]}" --world-size "$nproc" --offline --launch >/dev/null || exit 2
  llmtrain prepare --config "$CONFIG" "${SETS[@]}"
  run_dir="$(llmtrain check-config "$CONFIG" "${SETS[@]}" --get run_dir)"
  echo "run_dir: $run_dir"
  # torchrun sets OMP_NUM_THREADS=1 when it starts several processes: each gets its share of the
  # CPUs this process may use (its affinity mask) instead, unless the user chose a number.
  local share=$(($(nproc) / nproc))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((share > 1 ? share : 1))}"
  echo "torchrun: $nproc process(es) x $OMP_NUM_THREADS thread(s) (OMP_NUM_THREADS)"
  # --standalone: a private rendezvous on a free local port, so two local runs never meet.
  # Ctrl-C saves and stops, as `llmtrain control RUN_DIR stop` does: torchrun runs in the
  # background, where SIGINT stays ignored (it is told not to take it over: its own handling
  # ends in a SignalException traceback), and the trap writes the stop switch. Bash runs a trap
  # only between commands: wait, and wait again after the trap.
  rm -f "$run_dir/logs/error.txt"
  trap 'ask_to_stop "$run_dir"' INT
  python -m llmtrain.training.torchrun --signals-to-handle SIGTERM,SIGHUP,SIGQUIT --standalone \
    --nproc-per-node "$nproc" -m llmtrain train --config "$CONFIG" "${SETS[@]}" &
  local pid=$! rc=0
  while true; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - INT
  if ((rc)); then  # the trainer's own line last, below torchrun's failure summary
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
