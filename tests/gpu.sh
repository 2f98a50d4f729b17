#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) on a machine with no network, such as the lent GPU machine.
#
#   bash tests/gpu.sh wheels   # here, where pip reaches PyPI: the wheels that machine lacks -> .whl/
#   bash tests/gpu.sh run      # there, in the repo root: install .whl/ into /tmp/site, run the tests
#   bash tests/gpu.sh bench    # there: the same install, then bench/gpu.py (llmtrain vs peers)
#
# .whl/ is git-ignored (.git/info/exclude), so a call of the device tool names it in `carry`.
# That machine's Python already has torch, transformers, pytest, pyarrow, xxhash and the rest;
# it lacks `datasets` (llmtrain prepare) with dill and multiprocess, and torchao (train.fp8). fsspec is
# carried too, at the version datasets was tested with here (datasets caps it). setup.sh cannot
# run there: no registry.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO
readonly WHEELS="$REPO/.whl"
readonly SITE=/tmp/site
readonly CARRIED=(datasets dill multiprocess fsspec torchao)
readonly MAX_MIB=30  # the device's working tree travels in 64 MiB together with the repo
# The device README's recipe: CPython 3.12 wheels for x86-64 Linux, whatever runs here.
readonly PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
                    manylinux2014_x86_64 manylinux1_x86_64)

usage() {
  cat >&2 <<'EOF_USAGE'
Usage: bash tests/gpu.sh wheels|run

  wheels   download into .whl/ (git-ignored) the wheels the GPU machine lacks, pinned to the
           versions of this checkout's environment (run where pip reaches PyPI)
  run      on the GPU machine, in the repo root: install .whl/*.whl into /tmp/site and run
           python3 -m pytest -m gpu -v tests/test_gpu.py; the full log goes to
           $OUT/gpu-tests.log when OUT is set; a short summary is printed last
  bench    on the GPU machine: the same install, then python3 bench/gpu.py [its options, such
           as --models gpt2-124m --rounds 1] (its runs' logs under $OUT/bench when OUT is set)
           then bench/host.py --device cuda (the host's work a layer, eager): its lines
           come after bench/gpu.py's table
EOF_USAGE
}

die() { echo "gpu.sh: $*" >&2; exit 1; }

# shellcheck source=lib/find-env.sh disable=SC1091  # followed under shellcheck -x
source "$REPO/lib/find-env.sh"

download_wheels() {
  load_env  # this checkout's venv: its versions are the ones the suite is tested with
  local exclude pins platform_args=() p size_kib
  exclude="$(git -C "$REPO" rev-parse --git-path info/exclude)"
  [[ "$exclude" == /* ]] || exclude="$REPO/$exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
  read -ra pins < <(python -c 'import sys, importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${CARRIED[@]}")
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  rm -rf "$WHEELS"  # one version of each: two stop the install there
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platform_args[@]}" -d "$WHEELS" "${pins[@]}"
  ls -l "$WHEELS"
  size_kib="$(du -sk "$WHEELS" | cut -f1)"
  echo "$WHEELS: $((size_kib / 1024)).$(((size_kib % 1024) * 10 / 1024)) MiB for ${pins[*]}"
  ((size_kib <= MAX_MIB * 1024)) || die "$WHEELS holds over $MAX_MIB MiB; carry less"
}

versions() {
  python3 - <<'EOF_PY'
import importlib.metadata as m, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()}, torch {torch.__version__}, {gpu}")
names = ("transformers", "datasets", "dill", "multiprocess", "fsspec", "torchao", "pyarrow", "xxhash",
         "huggingface_hub", "tqdm")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "MISSING"
print(", ".join(f"{n} {version(n)}" for n in names))
EOF_PY
}

summary() {
  local log="$1" status="$2"
  echo
  echo "== gpu tests: $(head -n 1 "$log") =="
  grep -oE '^tests/test_gpu\.py::[^ ]+ (PASSED|FAILED|SKIPPED|ERROR)' "$log" |
    awk -F'::| ' '{ printf "%-8s %s\n", $3, $2 }' || echo "(no test ran)"
  grep -E '^(FAILED|ERROR) tests/' "$log" | cut -c 1-240 || true  # pytest's one-line reasons
  grep -E '^=+ .*[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s' "$log" | tail -n 1 ||
    echo "pytest ended with status $status and no result line"
}

install_wheels() {
  local wheels
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  ((${#wheels[@]})) || die "no wheels in $WHEELS: run 'bash tests/gpu.sh wheels' where pip reaches PyPI and carry .whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}"
  export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
}

run_bench() {
  install_wheels
  versions
  cd "$REPO"
  python3 bench/gpu.py ${OUT:+--out "$OUT/bench"} "$@"
  # the host's dispatch a layer on this node's CPU, CUDA kernels queued (login/plan.py's HOST_*)
  python3 bench/host.py --device cuda --tp 2 8 --cp 2 --fsdp 8 || echo "bench/host.py failed (exit $?)"
}

run_tests() {
  local log status=0
  install_wheels
  if [[ -n "${OUT:-}" ]]; then log="$OUT/gpu-tests.log"; else log="$(mktemp)"; fi
  versions | tee "$log"
  cd "$REPO"
  python3 -m pytest -m gpu -v tests/test_gpu.py 2>&1 | tee -a "$log" || status=$?
  summary "$log" "$status"
  echo "full log: $log"
  return "$status"
}

main() {
  case "${1:-}" in
    wheels) download_wheels ;;
    run) run_tests ;;
    bench) shift; run_bench "$@" ;;
    -h | --help) usage ;;
    *) echo "gpu.sh: unknown mode: ${1:-(none given)}" >&2; usage; exit 2 ;;
  esac
}

main "$@"
