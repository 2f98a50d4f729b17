#!/usr/bin/env bash
# Provision llmtrain on the login node: a Python venv with the package and its dependencies, and
# the directory layout on the shared filesystem. Idempotent: a second run changes nothing.
#
#   bash setup.sh [--shared-dir DIR] [--project-name NAME] [--extras wandb,tensorboard,fp8]
#   then:  source "$SHARED_DIR/$PROJECT_NAME/env.sh"
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO

usage() {
  cat >&2 <<EOF
Usage: bash setup.sh [--shared-dir DIR] [--project-name NAME] [--torch-spec SPEC]
                     [--torch-index-url URL] [--python PY] [--extras LIST]

Creates, under DIR/NAME (the "llmtrain home"):
  venv/      Python environment with llmtrain, torch, transformers, datasets, ...
  env.sh     source it: activates the venv, exports LLMTRAIN_HOME and the HF cache variables
  cache/     HF_HOME, TORCH_HOME;   models/, datasets/  (download_data_model.sh)
  prepared/  tokenized data;        runs/  run directories

Options (each also read from the environment variable in brackets):
  --shared-dir DIR      shared filesystem folder [SHARED_DIR] (default: $REPO/workspace)
  --project-name NAME   folder under it [PROJECT_NAME] (default: llmtrain)
  --torch-spec SPEC     pip requirement for torch [TORCH_SPEC] (default: torch==2.13.0; the same
                        pin gets the CUDA build on GPU clusters)
  --torch-index-url URL extra index for torch wheels [TORCH_INDEX_URL], e.g. a CUDA wheel index
  --python PY           interpreter for the venv [PYTHON] (default: python3)
  --extras LIST         optional parts [LLMTRAIN_EXTRAS]: tensorboard, wandb (metrics.*), fp8 (train.fp8),
                        test (the suite's, all three too), comma-separated; "" for none (default: test)
EOF
}

die() { echo "setup.sh: $*" >&2; exit 1; }

main() {
  local shared_dir="${SHARED_DIR:-$REPO/workspace}" project="${PROJECT_NAME:-llmtrain}"
  local torch_spec="${TORCH_SPEC:-torch==2.13.0}" torch_index="${TORCH_INDEX_URL:-}"
  local python="${PYTHON:-python3}" extras="${LLMTRAIN_EXTRAS-test}"
  while (($#)); do
    case "$1" in
      --shared-dir) shared_dir="${2:?--shared-dir needs a value}"; shift 2 ;;
      --project-name) project="${2:?--project-name needs a value}"; shift 2 ;;
      --torch-spec) torch_spec="${2:?--torch-spec needs a value}"; shift 2 ;;
      --torch-index-url) torch_index="${2:?--torch-index-url needs a value}"; shift 2 ;;
      --python) python="${2:?--python needs a value}"; shift 2 ;;
      --extras) extras="${2?--extras needs a value}"; shift 2 ;;
      -h | --help) usage; exit 0 ;;
      *) echo "setup.sh: unknown option: $1" >&2; usage; exit 2 ;;
    esac
  done
  [[ "$project" =~ ^[A-Za-z0-9._-]+$ ]] || die "--project-name: letters, digits, . _ - only (got '$project')"
  command -v "$python" >/dev/null || die "--python: '$python' not found; pass --python /path/to/python3"
  [[ "$extras" =~ ^((test|tensorboard|wandb|fp8)(,|$))*$ ]] || die "--extras: test, tensorboard, wandb, fp8, comma-separated (got '$extras')"

  mkdir -p "$shared_dir"
  local home
  home="$(cd "$shared_dir" && pwd)/$project"
  mkdir -p "$home"/{cache/huggingface,cache/torch,models,datasets,prepared,runs}
  make_venv "$home/venv" "$python" "$torch_spec" "$torch_index" "$extras"
  write_if_changed "$home/env.sh" "$(env_sh "$home")"
  write_if_changed "$REPO/.llmtrain-home" "$home"
  echo "llmtrain is set up in $home"
  echo "use it with:  source \"$home/env.sh\""
}

# The venv is rebuilt only when its recipe (python, torch spec, extras, pyproject.toml) changes.
make_venv() {
  local venv="$1" python="$2" torch_spec="$3" torch_index="$4" extras="$5"
  local stamp="$venv/.llmtrain-recipe" recipe
  recipe="$("$python" --version 2>&1) | $torch_spec | $torch_index | $extras | $(cksum <"$REPO/pyproject.toml")"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$recipe" ]]; then
    echo "venv is up to date: $venv"
    return
  fi
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  local index_args=()
  [[ -n "$torch_index" ]] && index_args=(--extra-index-url "$torch_index")
  echo "installing $torch_spec ..."
  "${pip[@]}" "${index_args[@]}" "$torch_spec"
  # Pin the torch just installed, so no later requirement can swap it for another build.
  "$venv/bin/python" -W ignore -c 'import torch; print("torch==" + torch.__version__)' >"$venv/constraints.txt"
  echo "installing llmtrain and its dependencies ..."
  "${pip[@]}" "${index_args[@]}" -c "$venv/constraints.txt" -e "${REPO}${extras:+[$extras]}"
  printf '%s' "$recipe" >"$stamp"
}

env_sh() {
  local home="$1" q
  q="$(printf '%q' "$home")"
  cat <<EOF
# Written by llmtrain's setup.sh; source it (do not edit: rerun setup.sh instead).
export LLMTRAIN_HOME=$q
export LLMTRAIN_REPO=$(printf '%q' "$REPO")
# shellcheck disable=SC1091
source "\$LLMTRAIN_HOME/venv/bin/activate"
export HF_HOME="\$LLMTRAIN_HOME/cache/huggingface"
export HF_HUB_CACHE="\$HF_HOME/hub"
export HF_DATASETS_CACHE="\$HF_HOME/datasets"
export TORCH_HOME="\$LLMTRAIN_HOME/cache/torch"
export HF_HUB_DISABLE_TELEMETRY=1
EOF
}

# Atomic and idempotent: an unchanged file keeps its bytes and its timestamp.
write_if_changed() {
  local path="$1" content="$2"
  [[ -f "$path" && "$(cat "$path")" == "$content" ]] && return
  printf '%s\n' "$content" >"$path.tmp.$$"
  mv -f "$path.tmp.$$" "$path"
}

main "$@"
