#!/usr/bin/env bash
# Fetch the Hugging Face model and dataset of a run onto the shared filesystem, on the login
# node (compute nodes usually have no internet). Complete downloads are skipped next time.
#
#   bash download_data_model.sh [--config FILE] [--model ID] [--dataset ID] [--allow-pattern GLOB]
#                               [--dataset-allow-pattern GLOB] [--config-only] [--force]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO

usage() {
  cat >&2 <<'EOF_USAGE'
Usage: bash download_data_model.sh [options]

  --config FILE          download the hub ids named in this config (default: config.yaml)
  --model ID             model repo id instead [MODEL_NAME]
  --dataset ID           dataset repo id instead [DATASET_NAME]
  --revision REV         model branch, tag or commit [REVISION] (default: main)
  --dataset-revision REV dataset revision [DATASET_REVISION] (default: main)
  --allow-pattern GLOB   only the model's files matching, repeatable [ALLOW_PATTERNS,
                         space-separated], e.g. '*.safetensors' --allow-pattern '*.json'
  --dataset-allow-pattern GLOB
                         only the dataset's files matching, repeatable
                         [DATASET_ALLOW_PATTERNS], e.g. 'data/train-*'
  --config-only          only the model's config and tokenizer files (megabytes), no weights,
                         no dataset: enough for `llmtrain estimate`; a later run without it
                         fetches the rest
  --force                download again even if complete [FORCE_REFRESH=1]

Gated models: set HF_TOKEN or log in once with `hf auth login`; the token is never printed.
Files land in $LLMTRAIN_HOME/models/<id> and $LLMTRAIN_HOME/datasets/<id>.
EOF_USAGE
}

die() { echo "download_data_model.sh: $*" >&2; exit 1; }

# shellcheck source=lib/find-env.sh
source "$REPO/lib/find-env.sh"

main() {
  local args=() config="$REPO/config.yaml" pattern patterns=()
  [[ -n "${MODEL_NAME:-}" ]] && args+=(--model "$MODEL_NAME")
  [[ -n "${DATASET_NAME:-}" ]] && args+=(--dataset "$DATASET_NAME")
  [[ -n "${REVISION:-}" ]] && args+=(--revision "$REVISION")
  [[ -n "${DATASET_REVISION:-}" ]] && args+=(--dataset-revision "$DATASET_REVISION")
  read -ra patterns <<<"${ALLOW_PATTERNS:-}"  # split on spaces, never glob
  for pattern in "${patterns[@]}"; do args+=(--allow-pattern "$pattern"); done
  read -ra patterns <<<"${DATASET_ALLOW_PATTERNS:-}"
  for pattern in "${patterns[@]}"; do args+=(--dataset-allow-pattern "$pattern"); done
  [[ "${FORCE_REFRESH:-0}" == 1 ]] && args+=(--force)
  while (($#)); do
    case "$1" in
      --config) config="${2:?--config needs a file}"; shift 2 ;;
      --model | --dataset | --revision | --dataset-revision | --allow-pattern | --dataset-allow-pattern)
        args+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
      --force | --config-only) args+=("$1"); shift ;;
      -h | --help) usage; exit 0 ;;
      *) echo "download_data_model.sh: unknown option: $1" >&2; usage; exit 2 ;;
    esac
  done
  load_env
  [[ -f "$config" ]] || die "--config: no such file: $config"
  llmtrain download --config "$config" "${args[@]}"
}

main "$@"
